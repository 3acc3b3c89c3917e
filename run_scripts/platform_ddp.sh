#!/usr/bin/env bash
# On a managed training platform: the platform runs this once on every node, e.g. with the command
#
#   bash run_scripts/platform_ddp.sh -a resnet50          # extra arguments go to train_ddp.py
#
# after setting (seed 004, "AILines ML"):
#   MASTER_ADDR, MASTER_PORT  where node 0 listens (MASTER_ADDR_WAIT: seconds to wait for its name to
#                             resolve, default 600)
#   WORLD_SIZE                processes in the whole job (= devices)
#   WORKER_PER_NODE           processes on each node
#   NODE_RANK                 this node's index (else RANK / WORKER_PER_NODE, RANK being the global rank
#                             of the node's first process)
#   BACKEND                   nccl on GPUs, gloo on CPUs
#   DATASETS_PATH, DATASETS   data root and dataset names: the data is $DATASETS_PATH/<first of $DATASETS>
#   WORKSPACE                 writable, persistent: outputs go to $WORKSPACE/<run name>
#   EPOCHS, LR, BATCH_SIZE    hyperparameters (BATCH_SIZE is the global batch here)
# The training script reads the last four groups itself; extra arguments go to train_ddp.py.
# TRAIN_SCRIPT=train_fsdp.py runs the FSDP script instead (the same launch; default: train_ddp.py).
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/_common.sh"  # (a link to this script: its folder)
require MASTER_ADDR "the address of node 0"
require MASTER_PORT "a free port on node 0"
require WORLD_SIZE "the number of processes in the job"
require WORKER_PER_NODE "the number of processes per node"
[ -n "${NODE_RANK:-}" ] || require RANK "the global rank of this node's first process (or set NODE_RANK)"
host MASTER_ADDR
whole MASTER_PORT 1 65535
whole WORLD_SIZE 1
whole WORKER_PER_NODE 1
[ $((WORLD_SIZE % WORKER_PER_NODE)) -eq 0 ] || fail "WORLD_SIZE=$WORLD_SIZE is not a multiple of WORKER_PER_NODE=$WORKER_PER_NODE"
if [ -z "${NODE_RANK:-}" ]; then
  whole RANK 0 $((WORLD_SIZE - 1))
  # (RANK 1 of WORKER_PER_NODE 2 was node 0, as was RANK 0: two nodes 0, each waiting for the other in silence)
  [ $((RANK % WORKER_PER_NODE)) -eq 0 ] || fail "RANK=$RANK is not a node's first process (a multiple of WORKER_PER_NODE=$WORKER_PER_NODE): set NODE_RANK, this node's index"
fi
node_rank="${NODE_RANK:-$((RANK / WORKER_PER_NODE))}"
nnodes=$((WORLD_SIZE / WORKER_PER_NODE))
NODE_RANK="$node_rank"
whole NODE_RANK 0 $((nnodes - 1))  # (RANK 8 of WORLD_SIZE 4 became node 4 of 2, and waited silently)
script_here "${TRAIN_SCRIPT:-train_ddp.py}"
check_endpoint "$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)"
# torchrun gives each process its own RANK, LOCAL_RANK and WORLD_SIZE.
unset RANK LOCAL_RANK
note_rendezvous "$nnodes"
run "${TORCHRUN[@]}" --nnodes="$nnodes" --node-rank="$NODE_RANK" --nproc-per-node="$WORKER_PER_NODE" \
    --rdzv-backend=static --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" "$REPO_DIR/${TRAIN_SCRIPT:-train_ddp.py}" "$@"
