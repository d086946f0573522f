"""Run Megatron-Core on a machine without CUDA.

Megatron-Core assumes a GPU in a handful of places: ``torch.cuda.current_device()``,
``torch.cuda.synchronize()``, the CUDA RNG state functions (and its own
``_get_cuda_rng_state``/``_set_cuda_rng_state``), hard-coded ``device="cuda"`` tensors in the
pipeline schedules, ``transformer/utils``, the grad buffers, clip-grads and the optimizers,
and the optimizers' check that parameters are ``torch.cuda.FloatTensor``. ``install()``
redirects exactly those to the CPU; it is a no-op when CUDA is available, and it is only
imported by ``nemo_orchestra.megatron.parallel`` when ``torch.cuda.is_available()`` is false.

Two mechanisms, both scoped to Megatron-Core's own modules:

- each listed module's global ``torch`` is replaced by a proxy that forwards everything to
  ``torch`` except tensor factories (``device="cuda"`` becomes the CPU) and ``torch.cuda``
  (a namespace whose device, stream, RNG and memory functions act on the CPU);
- the optimizer modules get a ``Tensor.type()`` shim while they build their parameter groups,
  reporting a CPU float tensor under its CUDA name so the dtype dispatch takes the fp32 path;
  checkpoint save/load and model construction (tied embeddings under PP) also get
  ``Tensor.cuda()`` as the identity (``on_cpu()``, ``cuda_tensors_stay()``).

The distributed-checkpoint modules are patched too, so ``dist_checkpointing`` (torch_dist) saves
and reshards on CPU over gloo; pipeline p2p needs nothing more than the schedules' factories.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch

_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "as_tensor",
)

# Megatron-Core modules that reach for CUDA directly.
_PATCHED_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.module",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.tensor_parallel.utils",
)


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return _NullEvent()


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def elapsed_time(self, other):
        return 0.0


def _make_cuda_namespace() -> types.SimpleNamespace:
    real = torch.cuda
    ns = types.SimpleNamespace()
    # Everything not overridden below falls through to the real torch.cuda.
    for name in dir(real):
        if not name.startswith("__"):
            setattr(ns, name, getattr(real, name))
    ns.is_available = lambda: False
    ns.current_device = lambda: torch.device("cpu")
    ns.device_count = lambda: 0
    ns.synchronize = lambda *a, **k: None
    ns.empty_cache = lambda: None
    ns.Stream = _NullStream
    ns.Event = _NullEvent
    ns.stream = lambda s=None: contextlib.nullcontext()
    ns.current_stream = lambda *a, **k: _NullStream()
    ns.default_stream = lambda *a, **k: _NullStream()
    ns.get_rng_state = lambda device=None: torch.get_rng_state()
    ns.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    ns.manual_seed = lambda seed: torch.manual_seed(seed)
    ns.manual_seed_all = lambda seed: torch.manual_seed(seed)
    ns.max_memory_allocated = lambda *a, **k: 0
    ns.memory_allocated = lambda *a, **k: 0
    ns.reset_peak_memory_stats = lambda *a, **k: None
    ns.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None)
    ns.random = types.SimpleNamespace(get_rng_state=lambda device=None: torch.get_rng_state())
    return ns


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by a patched Megatron module: CUDA requests land on the CPU."""

    def __init__(self, cuda_ns):
        super().__init__("torch")
        self.cuda = cuda_ns

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:

            @functools.wraps(attr)
            def factory(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return attr(*args, **kwargs)

            return factory
        return attr


@contextlib.contextmanager
def cuda_type_names():
    """While active, CPU float tensors report their CUDA type name (``torch.cuda.FloatTensor``).

    Re-entrant: a nested use keeps the outer shim.
    """
    original = torch.Tensor.type
    if getattr(original, "_cuda_type_names", False):
        yield
        return

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    type_._cuda_type_names = True
    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


@contextlib.contextmanager
def cuda_tensors_stay():
    """While active (and only without CUDA), ``Tensor.cuda()`` returns the tensor itself.

    The distributed optimizer's checkpoint gather and dist_checkpointing's exchange call it.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


@contextlib.contextmanager
def on_cpu():
    """Both shims: CUDA type names and ``Tensor.cuda()`` as identity (checkpoint save/load, optimizer)."""
    with cuda_type_names(), cuda_tensors_stay():
        yield


_installed = False


def install() -> None:
    """Redirect Megatron-Core's CUDA calls to the CPU. Idempotent; no-op with CUDA."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    cuda_ns = _make_cuda_namespace()
    proxy = _CpuTorch(cuda_ns)
    for name in _PATCHED_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = proxy

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _installed = True
