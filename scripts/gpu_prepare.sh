#!/usr/bin/env bash
# Wheels for a lent GPU machine whose image has PyTorch, Triton and transformers but nothing else the project
# needs, and no network: run this here, carry the folder with the call, and scripts/gpu_checks.sh installs it
# there (its prologue) before the first stage.
#
#   bash scripts/gpu_prepare.sh [DIR]        (DIR defaults to .whl; add "/.whl/" to .git/info/exclude)
#
# Environment: PY_VERSION (default 3.12, the image's Python), MAX_MB (default 64: what one call may carry).
# Fetched: megatron-core and the small dependencies the image lacks (omegaconf with its antlr4 runtime, orjson).
# TransformerEngine and vLLM are fetched only when their wheels fit in what is left of MAX_MB: their sizes are
# checked and printed, and a stage that needs them then says in one line that it cannot run there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
MAX_MB=${MAX_MB:-64}
CP="cp${PY_VERSION/./}"
mkdir -p "$DIR"
fetch() {  # binary wheels for the image's Python on x86-64 Linux, without dependencies
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${@:2}" 2>&1 | grep -v "is ignored" || true
}
fetch "$DIR" "megatron-core==$(sed -n 's/.*"megatron-core==\([0-9.]*\)".*/\1/p' pyproject.toml)" "omegaconf==2.3.0" orjson
# antlr4-python3-runtime 4.9.x (omegaconf's pin) is published as a source archive only: build its wheel here
python3 -m pip wheel --quiet --no-deps -w "$DIR" "antlr4-python3-runtime==4.9.3" 2>&1 | grep -v "is ignored" || true
used_mb() { du -sm "$DIR" | cut -f1; }
# The large ones: their wheel sizes from the index's JSON listing (PEP 691), so nothing is downloaded to learn
# that it does not fit. TransformerEngine's PyTorch binding (transformer-engine-torch) is published as a source
# archive only, built against the installed torch with CUDA's compiler: it is never carried.
python3 - "$DIR" "$MAX_MB" "$CP" "$(sed -n 's/.*"vllm==\([0-9.]*\)".*/\1/p' pyproject.toml)" <<'PYEOF'
import json, os, subprocess, sys, urllib.request
folder, max_mb, cp, vllm_version = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
used = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**20
for name, version, note in (
    ("transformer-engine-cu13", None, "and its torch binding is a source build"),
    ("vllm", vllm_version, ""),
):
    req = urllib.request.Request(f"https://pypi.org/simple/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
    except OSError as e:
        print(f"gpu_prepare: {name}: the index did not answer ({e}); not carried")
        continue
    wheels = [f for f in files if f["filename"].endswith(".whl") and "x86_64" in f["filename"]
              and (f"-{cp}-" in f["filename"] or "-py3-none-" in f["filename"] or "-abi3-" in f["filename"])
              and (version is None or f"-{version}-" in f["filename"])]
    if not wheels:
        print(f"gpu_prepare: {name}: no x86-64 wheel for {cp}; its stages will say so there")
        continue
    newest = max(wheels, key=lambda f: f["upload-time"])
    mb = newest["size"] / 2**20
    if used + mb <= max_mb and not note:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", folder, newest["url"]], check=True)
        used += mb
        print(f"gpu_prepare: {newest['filename']}: {mb:.0f} MB, carried")
    else:
        why = f"{mb:.0f} MB, more than the {max_mb - used:.0f} MB left of {max_mb}" if used + mb > max_mb else note
        print(f"gpu_prepare: {newest['filename']}: not carried ({why}); its stages will say so there")
PYEOF
ls -1 "$DIR"
echo "gpu_prepare: $(used_mb) MB in $DIR"
