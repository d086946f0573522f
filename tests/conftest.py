"""Without CUDA the Triton kernels run through Triton's interpreter. ``TRITON_INTERPRET`` must be set
before ``triton`` is first imported (its language functions are built for one mode at import), and
test modules of any folder may import it at collection: so it is set here, at the root, first.

Under pytest-xdist (``addopts`` in pyproject.toml) each worker, and the processes its tests start,
run torch on one thread: the workers share the machine's cores, and OpenMP threads oversubscribed
past them spin against each other."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pool, and for child processes

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
