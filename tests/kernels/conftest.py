"""Kernel tests run the Triton kernels on CPU through the interpreter when there is no CUDA device.

``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, i.e. when ``kernels.<op>`` is first
imported (lazily, on first use), so setting it here, at collection, is early enough. Other test
folders in the same pytest process see it too; the kernels package only uses it for CPU tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
