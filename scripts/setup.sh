#!/usr/bin/env bash
# Set up nemo-orchestra in ./.venv: torch first (the CPU build on a machine without an NVIDIA GPU,
# the normal CUDA build elsewhere), then the project with its test extra.
# Environment: PYTHON (default python3), VENV (default .venv), EXTRAS (default test; add gpu on CUDA).
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
  EXTRAS=${EXTRAS:-test}
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
  EXTRAS=${EXTRAS:-test}
fi

# torch is already satisfied, so the project's range (<=2.14.1) never pulls another build.
"$PY" -m pip install --quiet -e ".[$EXTRAS]"
"$PY" - <<'PYEOF'
import torch, megatron.core, transformers
print(f"setup: torch {torch.__version__} (cuda={torch.cuda.is_available()}), "
      f"megatron-core {megatron.core.__version__}, transformers {transformers.__version__}")
PYEOF
