#!/usr/bin/env bash
# Several nodes, one process per GPU, started by torchrun on every node. Run it once on each node:
#
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 run_scripts/multi_node_ddp.sh --data /data/imagenet
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 run_scripts/multi_node_ddp.sh --data /data/imagenet
#
# NNODES (default 1), NODE_RANK (0..NNODES-1; required with NNODES > 1), MASTER_ADDR (node 0's
# address, reachable from every node; required with NNODES > 1), MASTER_PORT (default 29500),
# NPROC_PER_NODE (default: WORKER_PER_NODE, else the visible GPUs), MASTER_ADDR_WAIT (seconds to wait for
# MASTER_ADDR to resolve, default 600).
# RDZV_BACKEND=static (default): node k holds global ranks k*NPROC_PER_NODE...; =c10d: torchrun's
# elastic rendezvous (ranks in order of arrival; NODE_RANK unused; needed for --max-restarts across
# nodes: MAX_RESTARTS=N passes torchrun --max-restarts=N). Extra arguments go to train_ddp.py.
# TRAIN_SCRIPT=train_fsdp.py runs the FSDP script instead (the same launch; default: train_ddp.py).
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/_common.sh"  # (a link to this script: its folder)
NNODES="${NNODES:-1}"
whole NNODES 1
if [ "$NNODES" -gt 1 ]; then
  require MASTER_ADDR "the address of node 0, reachable from every node"
  [ "${RDZV_BACKEND:-static}" != static ] || require NODE_RANK "this node's index, 0..$((NNODES - 1)); each node needs its own"
fi
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" NODE_RANK="${NODE_RANK:-0}" MASTER_PORT="${MASTER_PORT:-29500}"
host MASTER_ADDR
whole MASTER_PORT 1 65535
[[ "${RDZV_BACKEND:-static}" =~ ^(static|c10d|etcd|etcd-v2)$ ]] || fail "RDZV_BACKEND=$RDZV_BACKEND is not static or c10d (or etcd, etcd-v2)"
[ "${RDZV_BACKEND:-static}" != static ] || whole NODE_RANK 0 $((NNODES - 1))  # (a wrong one waited silently)
script_here "${TRAIN_SCRIPT:-train_ddp.py}"
check_endpoint "$([ "${RDZV_BACKEND:-static}" = static ] && [ "$NODE_RANK" = 0 ] && echo 1 || echo 0)"
nproc=$(nproc_per_node)
rdzv=(--rdzv-backend="${RDZV_BACKEND:-static}" --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT")
if [ "${RDZV_BACKEND:-static}" = static ]; then rdzv+=(--node-rank="$NODE_RANK"); else rdzv+=(--rdzv-id="${RDZV_ID:-imagenet}"); fi
if [ -n "${MAX_RESTARTS:-}" ]; then whole MAX_RESTARTS 0; rdzv+=(--max-restarts="$MAX_RESTARTS"); fi
note_rendezvous "$NNODES"
run "${TORCHRUN[@]}" --nnodes="$NNODES" --nproc-per-node="$nproc" "${rdzv[@]}" "$REPO_DIR/${TRAIN_SCRIPT:-train_ddp.py}" "$@"
