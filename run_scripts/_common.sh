# Sourced by the launchers in this folder: the repository, the Python to use, and helpers.
set -euo pipefail
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The repository's .venv (made by `make demo` / `make test`) unless PYTHON says otherwise.
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO_DIR/.venv/bin/python" ]; then PYTHON="$REPO_DIR/.venv/bin/python"; else PYTHON=python3; fi
fi
# STOP_GRACE: the seconds a clean stop may take (the last step and its checkpoint: a large model on a slow
# file system). torchrun waits that long after passing a stop signal on before it SIGKILLs the processes
# (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, its --shutdown-timeout; its own default: 30 s; an older torchrun without
# it ignores the variable), and train_*.py read it (--stop-grace). Keep it within the scheduler's warning
# (slurm_*.sbatch: --signal=B:USR1@120).
export STOP_GRACE="${STOP_GRACE:-120}"
[[ "$STOP_GRACE" =~ ^[1-9][0-9]*$ ]] || { echo "error: $(basename "$0"): STOP_GRACE=$STOP_GRACE is not a whole number of seconds" >&2; exit 2; }
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$STOP_GRACE"
TORCHRUN=("$PYTHON" -m torch.distributed.run)  # the same program as `torchrun`, from this Python

fail() {  # fail "message": one line on stderr, exit code 2
  echo "error: $(basename "$0"): $1" >&2
  exit 2
}

require() {  # require VAR "what it is": stop unless VAR is set and non-empty
  [ -n "${!1:-}" ] || fail "set $1 ($2)"
}

whole() {  # whole VAR LOW [HIGH]: stop unless VAR is a whole number from LOW (to HIGH) (was: bash's or torchrun's error);
  local value="${!1:-}"  # VAR then holds it in decimal (08: bash's arithmetic took it for octal)
  [[ "$value" =~ ^[0-9]+$ ]] && [ "$((10#$value))" -ge "$2" ] && { [ -z "${3:-}" ] || [ "$((10#$value))" -le "$3" ]; } \
    || fail "$1=$value is not a whole number from $2${3:+ to $3}"
  printf -v "$1" '%d' "$((10#$value))"
}

host() {  # host VAR: stop unless VAR is one host's name or address, without a port, as torchrun takes them (was: its
  local value="${!1:-}" bare  # traceback); an IPv6 address may be in brackets
  [[ ! "$value" =~ ^[^:]*:[^:]*$ && ! "$value" =~ ^\[.*\]: ]] \
    || fail "$1=$value holds a port: give the host alone, and the port in MASTER_PORT"
  bare="${value#\[}" && bare="${bare%\]}"  # (brackets both or neither; % of a scoped IPv6 address)
  [[ "$bare" =~ ^[A-Za-z0-9_.:%-]+$ && ("$bare" == "$value" || "[$bare]" == "$value") ]] \
    || fail "$1='$value' is not one host's name or address (node 0's)"
}

# check_endpoint LISTENS: stop unless MASTER_ADDR resolves within MASTER_ADDR_WAIT seconds (default 600, as torchrun
# waits for its rendezvous: a platform's name for node 0 may come to its DNS after the nodes start) and, where this
# node's torchrun listens (LISTENS 1: node 0 of a static rendezvous), MASTER_PORT is free here (was: torchrun's wait
# of 600 s, saying nothing, or its traceback): common/launch.py's check_endpoint.
check_endpoint() {
  local said status=0
  MASTER_ADDR_WAIT="${MASTER_ADDR_WAIT:-600}"
  whole MASTER_ADDR_WAIT 0
  said=$("$PYTHON" -c 'import sys; sys.path.insert(0, sys.argv[1])
from common.launch import UsageError, check_endpoint
try:
    check_endpoint(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5]))
except UsageError as error:
    sys.exit(print(error) or 2)
except KeyboardInterrupt:
    sys.exit(130)' "$REPO_DIR" "$MASTER_ADDR" "$MASTER_PORT" "$1" "$MASTER_ADDR_WAIT") || status=$?
  case "$status" in  # (the refusal: exit code 2, its line on stdout; the note while it waits: on stderr)
    0) ;;
    2) fail "${said:-$PYTHON refused MASTER_ADDR or MASTER_PORT, saying nothing}" ;;
    130) exit 130 ;;
    *) fail "$PYTHON could not check MASTER_ADDR and MASTER_PORT (exit code $status)" ;;
  esac
}

slurm_endpoint() {  # MASTER_ADDR: the allocation's first host (not the submitting shell's); MASTER_PORT: 29500 unless set
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)" || true
  [ -n "$MASTER_ADDR" ] || fail "scontrol show hostnames $SLURM_JOB_NODELIST named no host"
  MASTER_PORT="${MASTER_PORT:-29500}"
  whole MASTER_PORT 1 65535
}

script_here() {  # script_here NAME: stop unless NAME is a training script of this repository (TRAIN_SCRIPT)
  [ -f "$REPO_DIR/$1" ] || fail "TRAIN_SCRIPT=$1 is not a script of this repository (train_ddp.py or train_fsdp.py)"
}

visible_gpus() {  # GPUs this node's processes may use (CUDA_VISIBLE_DEVICES respected)
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then  # (CUDA reads it up to its first entry naming no GPU: -1, NoDevFiles)
    echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | awk '!/^([0-9]+|GPU-.+|MIG-.+)$/ { exit } { n++ } END { print n + 0 }'
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

nproc_per_node() {  # NPROC_PER_NODE, else WORKER_PER_NODE, else Slurm's GPUs, else one per visible GPU
  local name
  for name in NPROC_PER_NODE WORKER_PER_NODE SLURM_GPUS_ON_NODE; do
    if [ -n "${!name:-}" ]; then
      [[ "${!name}" =~ ^0*[1-9][0-9]*$ ]] || fail "$name=${!name} is not a positive number"
      echo "$((10#${!name}))"
      return
    fi
  done
  local n
  n=$(visible_gpus)
  [ "$n" -gt 0 ] || fail "no GPU visible: set NPROC_PER_NODE (e.g. NPROC_PER_NODE=2 for 2 CPU processes)"
  echo "$n"
}

note_rendezvous() {  # note_rendezvous NNODES: what torchrun does before any process starts, where nodes must meet
  [ "$1" -le 1 ] || echo "note: torchrun waits up to 600 s for all $1 nodes (its rendezvous), saying nothing; a node that never comes ends it in torchrun's traceback" >&2
}

show() {  # the command, quoted as the shell reads it back (a path with a space can be pasted)
  local line
  printf -v line ' %q' "$@"
  echo "+$line" >&2
}

run() {  # print the command, then become it
  show "$@"
  exec "$@"
}

run_requeueing() {  # under sbatch: run the job step; on SIGUSR1 or SIGTERM, stop it with a checkpoint and requeue
  show "$@"
  "$@" &
  local step=$!
  # A signal to this script (sbatch --signal=B:USR1@120, scancel --batch) reaches only this shell. It
  # passes SIGTERM to the tasks of the job's steps through Slurm (scancel without --batch: not to this
  # shell, nor to srun, which answers a SIGTERM of its own by SIGKILLing the tasks); every rank stops
  # after the same step, rank 0 saves, and the requeued job goes on from there (--resume auto).
  # That scancel fails when the job is ending already (scancel JOBID, time limit, preemption: Slurm
  # sends the tasks SIGTERM itself): then the job is not requeued. Further signals are ignored
  # meanwhile (the requeue itself sends this shell a SIGTERM).
  trap 'trap "" USR1 TERM
        if scancel --signal=TERM "$SLURM_JOB_ID"; then
          echo "caught a stop signal: checkpointing, then requeueing job $SLURM_JOB_ID" >&2
          wait $step || true
          scontrol requeue "$SLURM_JOB_ID"
        else
          echo "caught a stop signal while job $SLURM_JOB_ID ends: waiting for its checkpoint; not requeueing" >&2
          wait $step || true
        fi
        exit 0' USR1 TERM
  wait $step
}
