"""Without CUDA the Triton kernels run through Triton's interpreter. ``TRITON_INTERPRET`` must be set
before ``triton`` is first imported (its language functions are built for one mode at import), and
test modules of any folder may import it at collection: so it is set here, at the root, first.

Under pytest-xdist (``addopts`` in pyproject.toml) each worker, and the processes its tests start,
run torch on one thread: the workers share the machine's cores, and OpenMP threads oversubscribed
past them spin against each other.

The suite's temporary files go to a folder of its own (``TMPDIR``, set in the first pytest process,
inherited by the workers and every process a test starts), removed when the suite ends: torchrun,
vLLM and wandb leave folders in the temp folder (``torchelastic_*``, ``vllm_dist_*``, ``tmp*wandb-*``)
that would otherwise pile up in /tmp run after run. A ``TMPDIR`` already set is the parent."""

import atexit
import os
import shutil
import tempfile

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pool, and for child processes

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

SUITE_TMP = None  # the suite's temp folder, made by the first pytest process (not an xdist worker)
if not os.environ.get("PYTEST_XDIST_WORKER"):
    SUITE_TMP = tempfile.mkdtemp(prefix="nemo-tests-")
    os.chmod(SUITE_TMP, 0o1777)  # as /tmp: the sandbox tests' unprivileged user reaches folders below it
    os.environ["TMPDIR"] = SUITE_TMP
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    atexit.register(shutil.rmtree, SUITE_TMP, ignore_errors=True)  # also after a usage error
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
