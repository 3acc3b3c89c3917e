#!/usr/bin/env bash
# One process drives every GPU of this node through nn.DataParallel (or the CPU when there is none).
#
#   run_scripts/single_node_dp.sh --data /data/imagenet -a resnet50 -b 256
#   GPUS=0,1 run_scripts/single_node_dp.sh --data /data/imagenet
#
# GPUS: the GPU ids to use (default: all visible). Extra arguments go to train_dp.py, which also
# reads EPOCHS, LR, BATCH_SIZE, DATASETS_PATH, DATASETS and WORKSPACE from the environment.
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/_common.sh"  # (a link to this script: its folder)
gpus=()
[ -z "${GPUS:-}" ] || gpus=(--gpus "$GPUS")
run "$PYTHON" "$REPO_DIR/train_dp.py" "${gpus[@]}" "$@"
