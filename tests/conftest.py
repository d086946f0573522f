"""Without CUDA the Triton kernels run through Triton's interpreter. ``TRITON_INTERPRET`` must be set
before ``triton`` is first imported (its language functions are built for one mode at import), and
test modules of any folder may import it at collection: so it is set here, at the root, first."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
