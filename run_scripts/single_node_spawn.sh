#!/usr/bin/env bash
# One node, one process per GPU, started by train_spawn.py itself with torch.multiprocessing.spawn.
#
#   run_scripts/single_node_spawn.sh --data /data/imagenet -a resnet50 -b 256
#   NPROC_PER_NODE=2 run_scripts/single_node_spawn.sh        # no GPU: 2 CPU processes with gloo
#
# NPROC_PER_NODE: processes (default: WORKER_PER_NODE, else the visible GPUs); MASTER_PORT: the
# rendezvous port on this machine (default 29500). Extra arguments go to train_spawn.py.
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/_common.sh"  # (a link to this script: its folder)
nproc=$(nproc_per_node)
run "$PYTHON" "$REPO_DIR/train_spawn.py" --nproc-per-node "$nproc" --master-addr 127.0.0.1 \
    --master-port "${MASTER_PORT:-29500}" "$@"
