"""The GPU path compiles (Triton -> PTX -> cubin for sm_90), even on a machine without a GPU.

The interpreter runs kernels as Python and never meets the compiler's rules (loop-carried types,
dot shapes, shared memory), so this compiles the kernels as the GPU would, in a subprocess without
TRITON_INTERPRET. It needs no driver: Triton ships ptxas.
"""

import os
import subprocess
import sys

import pytest

COMPILE = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import nemo_orchestra.kernels.grouped_advantage as ga
import nemo_orchestra.kernels.varlen_attention as va

def compile_for_sm90(kernel, types, consts, num_warps, num_stages):
    fn = kernel.fn if isinstance(kernel, triton.runtime.autotuner.Autotuner) else kernel
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.metadata.shared <= 228 * 1024, (fn.__name__, consts, compiled.metadata.shared)

for dtype, d in (("bf16", 128), ("fp16", 64), ("fp32", 64)):
    types = {n: "*" + dtype for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}
    types.update(LSE="*fp32", DELTA="*fp32", DLSE="*fp32", CU="*i32", qk_scale="fp32", sm_scale="fp32")
    for causal in (True, False):
        meta = dict(GROUP=4, HEAD_DIM=d, BLOCK_D=d, CAUSAL=causal, UPCAST=False)
        compile_for_sm90(va._fwd_kernel, types, dict(meta, BLOCK_M=128, BLOCK_N=64), 8, 3)
        compile_for_sm90(va._bwd_dkdv_kernel, types, dict(meta, BLOCK_M=32, BLOCK_N=128), 8, 2)
        compile_for_sm90(va._bwd_dq_kernel, types, dict(meta, BLOCK_M=128, BLOCK_N=32), 8, 2)
    compile_for_sm90(va._bwd_preprocess_kernel, types,
                     dict(HEAD_DIM=d, BLOCK_D=d, HAS_DLSE=True, BLOCK_T=64), 4, 1)
types = dict(R="*fp32", PERM="*i64", OFF="*i64", A="*fp32", eps="fp32", clip="fp32")
for has_perm in (False, True):
    for one_chunk in (True, False):
        for mode in (0, 1, 2):
            consts = dict(MODE=mode, HAS_CLIP=True, HAS_PERM=has_perm, ACC=tl.float32, GROUPS=256, BLOCK_N=16,
                          ONE_CHUNK=one_chunk)
            compile_for_sm90(ga._grouped_advantage_kernel, types, consts, 4, 1)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    result = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
