"""Kernel tests run the Triton kernels on CPU through the interpreter when there is no CUDA device.

``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, and ``triton`` itself when it is
first imported: ``tests/conftest.py`` sets it before any test module is collected; this repeats it
for a run of this folder from another root. The kernels package only uses it for CPU tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
