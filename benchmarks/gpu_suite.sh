#!/usr/bin/env bash
# Measure jaxrl on this CUDA machine in one go (see benchmarks/gpu_suite.py for the steps):
#
#     bash benchmarks/gpu_suite.sh OUT_DIR [--wheels DIR] [--only STEPS] [--dry-run]
#
# With no network: the wheels of benchmarks/gpu_wheels.sh are installed from DIR into a private
# folder, and jaxrl itself from this checkout without its dependencies (the machine's own jax,
# flax, optax, ... are used, whatever their versions: the suite reports them). Prints the
# machine's facts, then runs the suite; OUT_DIR gets results.jsonl, summary.txt and a log per
# step.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash benchmarks/gpu_suite.sh OUT_DIR [--wheels DIR] [--only STEPS] [--dry-run]}"
shift
wheels=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
py="${PYTHON:-python3}"
mkdir -p "$out"
if [ -n "$wheels" ]; then
  site="$(mktemp -d)/site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$wheels"/*.whl || { echo "installing the wheels of $wheels failed"; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# jaxrl from this checkout; where pip cannot build it offline, the checkout on the path does.
"$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import jaxrl, omegaconf, hydra" \
  || { echo "jaxrl does not import: pass the wheels of benchmarks/gpu_wheels.sh with --wheels"; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi | tee "$out/nvidia-smi.txt"
export PYTHONUNBUFFERED=1
[[ " ${args[*]-} " == *" --dry-run "* ]] || export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
exec "$py" benchmarks/gpu_suite.py "$out" "${args[@]}"
