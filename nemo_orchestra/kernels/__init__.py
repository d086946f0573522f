"""Triton kernels, each beside its PyTorch reference (``nemo_orchestra.kernels.reference``); one public op per kernel.

- ``varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None) -> (out, lse)``
- ``grouped_advantage(rewards, *, group_ids=None, offsets=None, mode="std", eps=1e-6, clip=None)``

A tensor that is not on CUDA runs the op's PyTorch reference (unless ``TRITON_INTERPRET=1``, which
runs the Triton kernel on CPU, for tests). Triton is imported only when a kernel first runs, so the
package imports and works on a machine without CUDA or Triton.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

from nemo_orchestra.kernels.reference import grouped_advantage_ref, varlen_attention_ref

__all__ = ["varlen_attention", "grouped_advantage", "varlen_attention_ref", "grouped_advantage_ref"]


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def use_triton(x) -> bool:
    """Run the Triton kernel for tensor ``x``: it is on CUDA, or the Triton interpreter is on."""
    return x.is_cuda or triton_interpret()


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None):
    """Flash-attention over packed sequences; see ``nemo_orchestra.kernels.varlen_attention`` (the module)."""
    if not use_triton(q):
        return varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale)
    return _kernel_module("varlen_attention").varlen_attention(
        q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale
    )


def grouped_advantage(rewards, *, group_ids=None, offsets=None, mode="std", eps=1e-6, clip=None):
    """Group-relative advantages; the math is in ``nemo_orchestra.kernels.reference.grouped_advantage_ref``."""
    if not use_triton(rewards):
        return grouped_advantage_ref(rewards, group_ids=group_ids, offsets=offsets, mode=mode, eps=eps, clip=clip)
    return _kernel_module("grouped_advantage").grouped_advantage(
        rewards, group_ids=group_ids, offsets=offsets, mode=mode, eps=eps, clip=clip
    )


_OPS = {"varlen_attention": varlen_attention, "grouped_advantage": grouped_advantage}


def _kernel_module(name):
    module = importlib.import_module(f"{__name__}.{name}")
    # Importing the submodule ``nemo_orchestra.kernels.<name>`` binds it over the op of the same name: rebind the op.
    globals()[name] = _OPS[name]
    return module


def make_op_module_callable(module_name, op):
    """Make module ``nemo_orchestra.kernels.<op>`` callable as the op.

    Each op shares its name with the module that holds its kernel, and Python binds a submodule on
    its package when it is first imported, over the op. A module imported some other way than
    through the op (a test, the benchmark) then still answers ``nemo_orchestra.kernels.<op>(...)`` correctly.
    """

    class OpModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return op(*args, **kwargs)

    sys.modules[module_name].__class__ = OpModule
