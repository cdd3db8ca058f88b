#!/usr/bin/env bash
# jaxrl on a Cloud TPU slice: the same command on every TPU VM worker (one JAX process each).
#
#   launch/tpu_pod.sh TPU_NAME ZONE [train args ...]
#   launch/tpu_pod.sh my-v5e-16 us-west4-a --config configs/X.yaml mesh.fsdp=-1 ...
#
# JAX finds the workers, their ids and the coordinator (worker 0) from the TPU metadata, so no
# JAXRL_COORDINATOR is set. The repository must be at the same path on every worker (see
# launch/README.md for copying it and installing jax[tpu]).
# Environment:
#   JAXRL_TPU_DIR       the repository on the workers (default ~/jaxrl)
#   JAXRL_SETUP         shell code run first on every worker (default: activate
#                       $JAXRL_TPU_DIR/.venv if it exists)
#   JAXRL_LAUNCH_CMD    the command (default "python -m jaxrl.train")
#   JAXRL_TPU_PROJECT   the GCP project (default: gcloud's)
#   JAXRL_INIT_TIMEOUT, JAXRL_HEARTBEAT_TIMEOUT   passed on to every worker
# Each worker's output is kept in $JAXRL_TPU_DIR/logs/tpu-worker.log on that worker and streamed
# here (lines prefixed [process i/N]).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
tpu=$1
zone=$2
shift 2
dir=${JAXRL_TPU_DIR:-'~/jaxrl'}
setup=${JAXRL_SETUP:-"if [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi"}
launch=${JAXRL_LAUNCH_CMD:-python -m jaxrl.train}
exports=""
for var in JAXRL_INIT_TIMEOUT JAXRL_HEARTBEAT_TIMEOUT; do
  if [[ -n ${!var:-} ]]; then exports+="export $var=$(printf '%q' "${!var}"); "; fi
done
args=""
if [[ $# -gt 0 ]]; then args=$(printf '%q ' "$@"); fi
remote="cd $dir && $setup && ${exports}mkdir -p logs && $launch $args 2>&1 | tee logs/tpu-worker.log; exit \${PIPESTATUS[0]}"

echo "tpu_pod.sh: on every worker of $tpu ($zone): $remote" >&2
exec gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" ${JAXRL_TPU_PROJECT:+--project="$JAXRL_TPU_PROJECT"} \
  --worker=all --command="$remote"
