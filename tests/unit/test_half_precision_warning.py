"""bf16/fp16 on a CPU without native instructions for it is named at start-up, not discovered as a slow run."""

import torch

from nemo_orchestra.train.flops import cpu_half_precision_flags, slow_half_precision_warning

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
SAPPHIRE = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16\n"


def _cpuinfo(tmp_path, text):
    p = tmp_path / "cpuinfo"
    p.write_text(text)
    return str(p)


def test_bf16_on_an_avx2_only_cpu_is_named_with_the_key(tmp_path):
    msg = slow_half_precision_warning("bf16", torch.device("cpu"), _cpuinfo(tmp_path, AVX2_ONLY))
    assert msg and "model.params_dtype=bf16" in msg and "avx512_bf16" in msg and "\n" not in msg


def test_fp16_asks_for_the_fp16_instructions(tmp_path):
    msg = slow_half_precision_warning("fp16", torch.device("cpu"), _cpuinfo(tmp_path, AVX2_ONLY))
    assert "avx512_fp16" in msg and "avx512_bf16" not in msg


def test_no_warning_with_native_bf16_fp32_or_unreadable_flags(tmp_path):
    native = _cpuinfo(tmp_path, SAPPHIRE)
    assert cpu_half_precision_flags(native) == {"avx512_bf16", "amx_bf16", "avx512_fp16"}
    assert slow_half_precision_warning("bf16", torch.device("cpu"), native) is None
    assert slow_half_precision_warning("fp32", torch.device("cpu"), _cpuinfo(tmp_path, AVX2_ONLY)) is None
    assert slow_half_precision_warning("bf16", torch.device("cpu"), str(tmp_path / "missing")) is None


def test_no_warning_on_a_gpu(tmp_path):
    assert slow_half_precision_warning("bf16", torch.device("cuda", 0), _cpuinfo(tmp_path, AVX2_ONLY)) is None
