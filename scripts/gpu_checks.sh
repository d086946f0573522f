#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: each stage bounded in time, its log and JSON in OUT.
#
#   bash scripts/gpu_checks.sh [OUT]                     (OUT defaults to runs/gpu_checks)
#   STAGES="sync async" LAYERS=4 bash scripts/gpu_checks.sh
#
# Stages, in the order of STAGES (default "generate sync async tests kbench": the rollout figures first):
#   generate     recipes/benchmark.py generate at the Qwen3-8B shape with LAYERS layers, bf16: GENERATE_ENGINES
#                (default megatron with CUDA graphs, megatron:eager without, hf) on the same 128 sequences of
#                ~390 prompt tokens, 144 new tokens each (the GRPO step's generation): generated tokens/s per
#                engine, prefill and decode, against the device's bound (prefill FLOPs over its measured matmul
#                rate, decode bytes over its measured copy bandwidth), and the share of sequences whose tokens
#                are the first engine's. An engine that fails is named; the others are still measured.
#                GENERATE_PROFILE (default the first engine; empty: none) makes one more call under
#                torch.profiler: the kernels that took the device's time, and its busy share of the call.
#   sync, async  recipes/benchmark.py grpo at the Qwen3-8B shape with GRPO_LAYERS layers, bf16 (default LAYERS, 8;
#                6 on a GPU of less than 100 GiB: the 8-layer step peaked at 86.5 GB, 93.6 GB at K=4, on an H200),
#                16 prompts x 8 rollouts: tokens/s/GPU and MFU against the device's dense bf16 peak. sync: 1
#                warm-up and 3 measured steps; async: rollout.steps_ahead=ASYNC_K (default 4) with
#                loss.tis_cap=2.0, in steady state (the benchmark's K+1 warm-up steps, one period of K+1 measured).
#                ENGINE picks rollout.engine: auto (the default) is the generate stage's fastest engine with
#                its rollout.cuda_graphs (hf when that stage did not run), for async the same on weights of its
#                own where it reads the policy's (megatron -> megatron_copy); vllm needs the vllm package.
#   kbench       nemo_orchestra/kernels/bench.py: the Triton varlen attention (TFLOP/s, against flash-attn when
#                installed and PyTorch SDPA per sequence) and the grouped advantage (GB/s against a copy).
#   tests        the kernel tests on the device (compiled Triton, not the interpreter), the `gpu`-marked
#                tests, and the model-level tests that take the Triton attention backend on CUDA, in
#                TEST_WORKERS (default 4) pytest-xdist processes: Triton's compiles are CPU work. TESTS (paths or
#                node ids) replaces that selection.
# Time limits per stage, in seconds: GENERATE_S (default 140), GRPO_S (110, sync), ASYNC_S (190), TESTS_S (100),
# KBENCH_S (40).
# With the prologue they add up to under 600 s, one call's limit on the lent machine, so the whole script is one
# call (timeout_s=600); docs/results/*_nvidia-h200_gpu-checks.md give each stage's time there.
# Prologue: on a machine without the project's packages and without network, WHEELS (default .whl, made here by
# scripts/gpu_prepare.sh and carried with the call) is installed into SITE (default /tmp/nemo_orchestra_site),
# which goes on PYTHONPATH with the repository; then each optional package (TransformerEngine, vLLM,
# flash-attn) that is missing is named in one line with what it leaves out.
# Exit status: the number of stages that failed.
set -u
OUT=${1:-runs/gpu_checks}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
STAGES=${STAGES:-"generate sync async tests kbench"}
LAYERS=${LAYERS:-8}
ENGINE=${ENGINE:-auto}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "=== [$(($(date +%s) - T0)) s] $*"; }

stamp prologue
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=${SITE:-/tmp/nemo_orchestra_site}
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || { echo "prologue: installing the wheels in $WHEELS failed"; exit 1; }
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "prologue: $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS installed in $SITE"
fi
"$PY" -c "import megatron.core, omegaconf, orjson, transformers" 2>/dev/null \
  || { echo "prologue: the project's packages do not import; run scripts/gpu_prepare.sh here and carry $WHEELS"; exit 1; }
"$PY" -c "import transformer_engine.pytorch" 2>/dev/null \
  || echo "prologue: no TransformerEngine: the FP8 tests skip (its wheel is larger than a call carries)"
"$PY" -c "import vllm" 2>/dev/null \
  || echo "prologue: no vLLM: the vLLM GPU tests skip and the GRPO stages need ENGINE=hf (ENGINE=$ENGINE)"
"$PY" -c "import flash_attn" 2>/dev/null || echo "prologue: no flash-attn: kbench compares with SDPA only"

stamp environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no NVIDIA GPU here"; exit 1; }
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ "$ENGINE" = vllm ] && ! "$PY" -c "import vllm" 2>/dev/null; then
  echo "ENGINE=vllm without vLLM here: the sync and async stages cannot run"; STAGES=${STAGES//async/}; STAGES=${STAGES//sync/}
fi

GPU_GIB=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) / 1024 ))
if [ -z "${GRPO_LAYERS:-}" ]; then
    GRPO_LAYERS=$LAYERS
    if [ "$GPU_GIB" -lt 100 ] && [ "$LAYERS" -gt 6 ]; then
        GRPO_LAYERS=6; echo "a GPU of $GPU_GIB GiB: the GRPO stages at 6 layers (GRPO_LAYERS), generate at $LAYERS"
    fi
fi

ASYNC_K=${ASYNC_K:-4}
GENERATE_ENGINES=${GENERATE_ENGINES:-megatron,megatron:eager,hf}
GENERATE_PROFILE=${GENERATE_PROFILE-${GENERATE_ENGINES%%,*}}
TESTS=${TESTS:-"tests/integration/kernels tests/unit/test_attention_backends.py tests/unit/test_rope.py
    tests/unit/test_grpo_update.py tests/unit/test_shared_prompts.py tests/unit/test_tiers.py
    tests/integration/test_megatron_engine.py tests/integration/test_engine_streams.py tests/integration/test_vllm_gpu.py
    tests/integration/distributed/test_fp8.py"}
SHAPE=("model=qwen3_8b" "model.num_layers=$LAYERS" "model.params_dtype=bf16")
GRPO_SHAPE=("model=qwen3_8b" "model.num_layers=$GRPO_LAYERS" "model.params_dtype=bf16")
engine() {  # the engine overrides a GRPO stage runs with: ENGINE, or with auto the generate stage's fastest (for
            # async: that engine on weights of its own, which can run ahead)
    if [ "$ENGINE" = auto ]; then
        "$PY" -c "import json, sys; print(' '.join(json.load(open(sys.argv[1]))[sys.argv[2]]))" "$OUT/generate.json" \
            "$([ "$1" = async ] && echo fastest_ahead_args || echo fastest_args)" 2>/dev/null \
            || { echo "ENGINE=auto: no $OUT/generate.json from the generate stage; the hf engine" >&2; echo rollout.engine=hf; }
    else
        echo "rollout.engine=$ENGINE"
    fi
}
failed=0
for stage in $STAGES; do
    stamp "$stage"
    if [ "$stage" = sync ] || [ "$stage" = async ]; then
        read -r -a eng <<< "$(engine "$stage")"
        echo "$stage: ${eng[*]}"
        GRPO=(recipes/benchmark.py grpo "${GRPO_SHAPE[@]}" "${eng[@]}" "data.prompts_per_step=16" "rollout.group_size=8")
    fi
    case $stage in
        generate) timeout "${GENERATE_S:-140}" "$PY" recipes/benchmark.py generate "${SHAPE[@]}" \
            --engines "$GENERATE_ENGINES" --profile "$GENERATE_PROFILE" --out "$OUT/generate.json" ;;
        sync) timeout "${GRPO_S:-110}" "$PY" "${GRPO[@]}" --steps 3 --warmup 1 --out "$OUT/grpo_sync.json" \
            "run.output_dir=$OUT/run_sync" ;;
        async) timeout "${ASYNC_S:-190}" "$PY" "${GRPO[@]}" --steps "$((ASYNC_K + 1))" --out "$OUT/grpo_async.json" \
            "run.output_dir=$OUT/run_async" "rollout.steps_ahead=$ASYNC_K" loss.tis_cap=2.0 ;;
        kbench) timeout "${KBENCH_S:-40}" "$PY" -m nemo_orchestra.kernels.bench --out "$OUT/kernel_bench.json" ;;
        tests) timeout "${TESTS_S:-100}" "$PY" -m pytest -o addopts="" -q -p no:cacheprovider -rfEs \
            -n "${TEST_WORKERS:-4}" --durations=10 \
            $TESTS --timeout=120 ;;
        *) echo "unknown stage '$stage' (generate, sync, async, tests, kbench)"; false ;;
    esac > >(tee "$OUT/$stage.log") 2>&1
    rc=$?
    [ $rc -eq 0 ] || failed=$((failed + 1))
    stamp "$stage: exit $rc"
done
stamp "done: $failed stage(s) failed"
exit $failed
