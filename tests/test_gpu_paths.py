"""The GPU paths' flags that need a real run on the CPU: --compile (inductor's C++ on the CPU), one graph per mode
however many epochs, and its checkpoint evaluating eagerly alike. (Autocast in DataParallel's threads, the fp16
GradScaler resumed, bf16, channels_last, per-rank random streams, --deterministic kept on resume: in-process, in
tests/unit/. What only a GPU can show, NCCL, CUDA streams, DataParallel over several GPUs: tools/gpu_check.py,
`make gpu-check`.)"""

import re

import pytest

from conftest import TINY, make_image_folder
from harness.jobs import assert_ok, run_script

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ACC = re.compile(r"^ \* Acc@1 ([\d.]+)  Acc@5 ([\d.]+)  Loss ([\d.]+)  \((\d+) images\)$", re.MULTILINE)


def test_compile_trains_with_one_graph_per_mode_and_its_checkpoint_evaluates_alike(tmp_path):
    """torch.compile (inductor, C++ on the CPU). 27 training images at -b 6 leave a last batch of 3,
    which compiling drops (it would cost a second training graph); 12 validation images make two
    full batches. So: two graphs in all, training and evaluation, however many epochs. And the
    compiled run's last validation equals an eager evaluation of the checkpoint it saved."""
    data = make_image_folder(tmp_path / "data", train_per_class=9, val_per_class=4)
    output_dir = tmp_path / "compiled"
    common = ["--data", data, *TINY, "-a", "tests.tiny_models:TinyNet", "--dropout", "0", "-b", "6", "--seed", "0"]
    out = assert_ok(
        run_script("train_dp.py", *common, "--epochs", "2", "--compile", "--output-dir", output_dir, timeout=600)
    )
    assert "torch.compile: 2 graph(s) compiled" in out, out[-3000:]
    assert re.findall(r"Epoch: \[1\] \[\s*(\d+)/(\d+)\]", out)[-1] == ("4", "4")  # the partial 5th dropped
    compiled = ACC.findall(out)[-1]
    eager = assert_ok(
        run_script(
            "train_dp.py", *common, "-e", "--resume", output_dir / "checkpoint.pth", "--output-dir", tmp_path / "eval"
        )
    )
    evaluated = ACC.findall(eager)[-1]
    assert compiled[0] == evaluated[0] and compiled[3] == evaluated[3] == "12"
    assert float(compiled[2]) == pytest.approx(float(evaluated[2]), abs=1e-4)
