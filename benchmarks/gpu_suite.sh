#!/usr/bin/env bash
# Measure jaxrl on this CUDA machine in one go (see benchmarks/gpu_suite.py for the steps):
#
#     bash benchmarks/gpu_suite.sh OUT_DIR [--wheels DIR] [--no-install] [gpu_suite.py options]
#
# With no network: the wheels of benchmarks/gpu_wheels.sh are installed from DIR into a private
# folder, and jaxrl itself from this checkout without its dependencies (the machine's own jax,
# flax, optax, ... run it, whatever their versions: the suite records them). Prints nvidia-smi
# and JAX's environment, then runs the suite; OUT_DIR gets results.jsonl, summary.txt,
# env.txt and a log per step. --no-install: jaxrl is importable already (CI's dry run).
set -uo pipefail
usage="usage: bash benchmarks/gpu_suite.sh OUT_DIR [--wheels DIR] [--no-install] [--only STEPS] [--limit STEP=S] [--dry-run]"
out="${1:?$usage}"
shift
mkdir -p "$out" && out="$(cd "$out" && pwd)"
wheels=""
install=1
dry=0
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels)
      [ $# -ge 2 ] || { echo "$usage"; exit 2; }
      wheels="$(cd "$2" && pwd)" || { echo "--wheels $2: no such folder"; exit 2; }
      shift 2 ;;
    --no-install) install=0; shift ;;
    --dry-run) dry=1; args+=("$1"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
if [ -n "$wheels" ]; then
  site="$(mktemp -d)/site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$wheels"/*.whl || { echo "installing the wheels of $wheels failed"; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$install" = 1 ]; then
  # jaxrl from this checkout; where pip cannot build it offline, the checkout on the path.
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$py" -c "import jaxrl.config, jaxrl.trainer.fit, omegaconf, hydra" \
  || { echo "jaxrl does not import: pass the wheels of benchmarks/gpu_wheels.sh with --wheels"; exit 2; }
[ "$dry" = 1 ] || export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
if command -v nvidia-smi >/dev/null; then nvidia-smi | tee "$out/nvidia-smi.txt"; fi
"$py" -c "import jax; jax.print_environment_info()" 2>&1 | tee "$out/env.txt"
export PYTHONUNBUFFERED=1
exec "$py" benchmarks/gpu_suite.py "$out" ${args[@]+"${args[@]}"}
