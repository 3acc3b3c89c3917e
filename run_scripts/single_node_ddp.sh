#!/usr/bin/env bash
# One node, one process per GPU, started by torchrun (--standalone: a private rendezvous on a free port).
#
#   run_scripts/single_node_ddp.sh --data /data/imagenet -a resnet50 -b 256
#   NPROC_PER_NODE=2 run_scripts/single_node_ddp.sh          # no GPU: 2 CPU processes with gloo
#
# NPROC_PER_NODE: processes (default: WORKER_PER_NODE, else the visible GPUs). Extra arguments go to
# train_ddp.py; -b is the global batch over all processes.
# TRAIN_SCRIPT=train_fsdp.py runs the FSDP script instead (the same launch; default: train_ddp.py).
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/_common.sh"  # (a link to this script: its folder)
nproc=$(nproc_per_node)
run "${TORCHRUN[@]}" --standalone --nproc-per-node="$nproc" "$REPO_DIR/${TRAIN_SCRIPT:-train_ddp.py}" "$@"
