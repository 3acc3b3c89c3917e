"""common/agreement.py: what the ranks of one job compare before they train (arguments, checkpoints) and the one line
that names the first difference."""
from pathlib import Path

from common import agreement
from conftest import parse


def test_the_ranks_text_and_the_first_difference():
    assert agreement.ranks_text([3]) == "rank 3"
    assert agreement.ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"
    same = {"batch_size": 8, "lr": 0.1, "output_dir": "x"}
    assert agreement.argument_difference([same, dict(same)]) is None
    line = agreement.argument_difference([same, same, {**same, "lr": 0.2}, {**same, "lr": None}])
    assert "--lr is 0.1 on ranks 0-1, 0.2 on rank 2, unset on rank 3;" in line
    fresh = agreement.resume_facts(None, None)
    loaded = agreement.resume_facts(Path("a/checkpoint.pth"), {"epoch": 2, "seed": 1, "checkpoint_id": "x"})
    assert agreement.resume_difference([loaded, dict(loaded)]) is None
    assert agreement.resume_difference([fresh, fresh]) is None
    assert ("a/checkpoint.pth (epoch 2, seed 1) on rank 0, no checkpoint (a fresh start) on rank 1"
            in agreement.resume_difference([loaded, fresh]))
    assert agreement.resume_difference([loaded, {**loaded, "id": "y"}]) is not None  # same place, other bytes


def test_the_per_node_arguments_may_differ(no_platform_env):
    node = [parse("--data", f"/d{k}", "--output-dir", f"/n{k}", "-j", k) for k in (0, 1)]
    assert agreement.argument_difference([agreement.comparable_args(config) for config in node]) is None
    node[1] = node[1].replace(lr=0.2)
    assert ("--lr is 0.1 on rank 0, 0.2 on rank 1; every process takes the same ones (only --workers, --data and "
            "--output-dir may differ between nodes)") in agreement.argument_difference(
        [agreement.comparable_args(config) for config in node])
