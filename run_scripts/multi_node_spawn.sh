#!/usr/bin/env bash
# Several nodes, one process per GPU, started by train_spawn.py on every node. Run it once on each node:
#
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 run_scripts/multi_node_spawn.sh --data /data/imagenet
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 run_scripts/multi_node_spawn.sh --data /data/imagenet
#
# NNODES (default 1), NODE_RANK (required with NNODES > 1), MASTER_ADDR (node 0; required with
# NNODES > 1), MASTER_PORT (default 29500), NPROC_PER_NODE (default: WORKER_PER_NODE, else the
# visible GPUs). Global rank = NODE_RANK * NPROC_PER_NODE + local rank. Extra arguments go to
# train_spawn.py (e.g. --dist-url file:///shared/rendezvous instead of tcp://MASTER_ADDR:MASTER_PORT).
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/_common.sh"  # (a link to this script: its folder)
NNODES="${NNODES:-1}"
whole NNODES 1
if [ "$NNODES" -gt 1 ]; then
  require MASTER_ADDR "the address of node 0, reachable from every node"
  require NODE_RANK "this node's index, 0..$((NNODES - 1)); each node needs its own"
fi
[ -z "${MASTER_ADDR:-}" ] || host MASTER_ADDR
nproc=$(nproc_per_node)
run "$PYTHON" "$REPO_DIR/train_spawn.py" --nnodes "$NNODES" --node-rank "${NODE_RANK:-0}" \
    --nproc-per-node "$nproc" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" "$@"
