#!/usr/bin/env bash
# N jaxrl processes on this machine, each with its own fake CPU devices (development and tests).
#
#   launch/local.sh N [train args ...]
#   launch/local.sh 2 --config configs/quickstart.yaml trainer.total_training_steps=2
#
# Every process runs `$JAXRL_LAUNCH_CMD "$@"` (default: python -m jaxrl.train) with
#   JAXRL_COORDINATOR=127.0.0.1:<free port>, JAXRL_NUM_PROCESSES=N, JAXRL_PROCESS_ID=0..N-1,
#   XLA_FLAGS=--xla_force_host_platform_device_count=D, JAX_PLATFORMS=cpu (unless set).
# Environment:
#   JAXRL_LOCAL_DEVICES  D, fake CPU devices per process (default 8/N when N divides 8, else 4)
#   JAXRL_LAUNCH_CMD     the command each process runs (default "python -m jaxrl.train";
#                        word-split, so e.g. "python my_script.py --flag")
#   JAXRL_LOG_DIR        where process_<i>.log go (default logs/local-<date>-<pid>)
#   JAXRL_PORT           coordinator port (default: a free one)
#   JAXRL_QUIET=1        do not echo process 0's log to the terminal
# When a process exits non-zero, the others are stopped (TERM, then KILL after 10 s) and this
# script exits with that status; it exits 0 when all N processes do.
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
n=$1
shift
python=${PYTHON:-python}
if [[ -n ${JAXRL_LOCAL_DEVICES:-} ]]; then
  devices=$JAXRL_LOCAL_DEVICES
elif ((8 % n == 0)); then
  devices=$((8 / n))
else
  devices=4
fi
port=${JAXRL_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
log_dir=${JAXRL_LOG_DIR:-logs/local-$(date +%Y%m%d-%H%M%S)-$$}
read -r -a cmd <<<"${JAXRL_LAUNCH_CMD:-$python -m jaxrl.train}"
mkdir -p "$log_dir"
echo "local.sh: $n processes x $devices CPU devices, coordinator 127.0.0.1:$port, logs in $log_dir" >&2

pids=()
for ((i = 0; i < n; i++)); do
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices" \
    JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} \
    JAXRL_COORDINATOR=127.0.0.1:$port JAXRL_NUM_PROCESSES=$n JAXRL_PROCESS_ID=$i \
    PYTHONUNBUFFERED=1 \
    "${cmd[@]}" "$@" >"$log_dir/process_$i.log" 2>&1 &
  pids+=($!)
done
tail_pid=
if [[ -z ${JAXRL_QUIET:-} ]]; then
  tail -n +1 -F "$log_dir/process_0.log" 2>/dev/null &
  tail_pid=$!
fi

stop_all() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 100); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  if [[ -n $tail_pid ]]; then kill "$tail_pid" 2>/dev/null || true; fi
}
trap 'echo "local.sh: interrupted; stopping all processes" >&2; stop_all; exit 130' INT TERM

status=0
remaining=$n
declare -A done_
while ((remaining > 0)); do
  for ((i = 0; i < n; i++)); do
    [[ -n ${done_[$i]:-} ]] && continue
    kill -0 "${pids[$i]}" 2>/dev/null && continue
    rc=0
    wait "${pids[$i]}" || rc=$?
    done_[$i]=1
    remaining=$((remaining - 1))
    if ((rc != 0)); then
      sleep 2 # let the others print why they stop too (jaxrl.distributed names the culprit)
      echo "local.sh: process $i exited with status $rc; stopping the others" >&2
      echo "---- last lines of $log_dir/process_$i.log ----" >&2
      tail -n 20 "$log_dir/process_$i.log" >&2
      stop_all
      exit "$rc"
    fi
  done
  sleep 0.5
done
if [[ -n $tail_pid ]]; then
  sleep 0.5
  kill "$tail_pid" 2>/dev/null || true
fi
echo "local.sh: all $n processes exited 0 (logs in $log_dir)" >&2
exit "$status"
