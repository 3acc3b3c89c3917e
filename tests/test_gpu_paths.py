"""The GPU-path flags run on the CPU: everything in them that does not need a GPU.

--amp (autocast and the fp16 GradScaler, the DataParallel autocast wrapper), --channels-last,
--compile, --deterministic, per-rank random streams, and the refusals that go with them. What
only a GPU can show (NCCL, CUDA streams, DataParallel over several GPUs) is in
tools/gpu_check.py (`make gpu-check`) and tests/test_gpu_check.py.
"""
import re
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from common import checkpoint as ckpt
from common.distributed import shared_devices
from common.engine import AutocastForward
from common.trainer import rng_state, set_rng_state
from conftest import TINY, assert_ok, make_image_folder, run_script, torchrun

TINY_NET = ["-a", "tests.tiny_models:TinyNet", "--dropout", "0"]
ACC = re.compile(r"^ \* Acc@1 ([\d.]+)  Acc@5 ([\d.]+)  Loss ([\d.]+)  \((\d+) images\)$", re.MULTILINE)
STEP_LOSS = re.compile(r"^Epoch: \[\d+\] \[\s*\d+/\d+\]\s+loss (\S+)", re.MULTILINE)


def train(data, output_dir, *extra, script="train_dp.py", epochs=2):
    result = run_script(script, "--data", data, *TINY, *TINY_NET, "-b", "8", "--seed", "0", "--lr", "0.05",
                        "--epochs", str(epochs), "--output-dir", output_dir, *extra)
    return assert_ok(result)


def weights(output_dir):
    return torch.load(output_dir / "checkpoint.pth", map_location="cpu", weights_only=True)


def losses(stdout):
    return [float(value) for value in STEP_LOSS.findall(stdout)]


# ----------------------------------------------------------------------------- --amp

def test_autocast_forward_computes_in_the_amp_dtype_in_any_thread():
    """DataParallel runs each replica in a thread of its own, where the caller's autocast does not
    reach, and enters autocast there with the device's default dtype (parallel_apply). The wrapper
    must compute in the --amp dtype whatever the thread's own autocast says."""
    model = nn.Linear(8, 4)
    images = torch.randn(2, 8)
    results = {}

    def replica_thread():
        results["bare"] = model(images).dtype
        results["wrapped"] = AutocastForward(model, "cpu", "bf16")(images).dtype
        # What parallel_apply does in each replica's thread: autocast enabled, with no dtype (the
        # device's default: float16 on CUDA, bfloat16 on the CPU), then the replica's forward.
        with torch.autocast("cpu", enabled=True):
            results["wrapped fp16"] = AutocastForward(model, "cpu", "fp16")(images).dtype
        with torch.autocast("cpu", enabled=True):
            results["default"] = model(images).dtype

    with torch.autocast("cpu", dtype=torch.float16):  # the caller's autocast: not seen by the thread
        thread = threading.Thread(target=replica_thread)
        thread.start()
        thread.join(timeout=60)
    assert results == {"bare": torch.float32, "wrapped": torch.bfloat16,
                       "default": torch.bfloat16, "wrapped fp16": torch.float16}
    # Checkpoints hold the bare model: no wrapper prefix in its parameter names.
    assert ckpt.unwrap(nn.DataParallel(AutocastForward(model, "cpu", "bf16"))) is model


@pytest.fixture(scope="module")
def fp32(tiny_data, tmp_path_factory):
    """The reference: two epochs in float32, default flags (channels_last on the CPU)."""
    output_dir = tmp_path_factory.mktemp("fp32") / "out"
    return SimpleNamespace(output_dir=output_dir, stdout=train(tiny_data, output_dir))


def test_amp_bf16_follows_the_float32_run_and_warns_where_the_cpu_has_no_bf16(tiny_data, tmp_path, fp32):
    out = train(tiny_data, tmp_path / "bf16", "--amp", "bf16")
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    warned = "warning: --amp bf16 on this CPU" in out
    assert warned != native, out[-2000:]
    assert out.count("warning: --amp") <= 1  # once, not per process or per epoch
    # bf16 rounds differently (so autocast was on) but trains the same model.
    assert losses(out) != losses(fp32.stdout)
    assert losses(out) == pytest.approx(losses(fp32.stdout), abs=0.02)


def test_amp_fp16_resume_restores_the_scaler_state(tiny_data, tmp_path):
    """fp16 trains with a GradScaler; a resumed run goes on with the scale it had, not a new one."""
    output_dir = tmp_path / "fp16"
    first = train(tiny_data, output_dir, "--amp", "fp16", epochs=1)
    assert "warning: --amp fp16" in first or torch.ops.mkldnn._is_mkldnn_fp16_supported()
    state = weights(output_dir)
    assert state["scaler"]["scale"] == 65536.0  # GradScaler's initial scale: no overflow in so few steps
    # As if a long run had met overflows: the scale came down to 1024.
    state["scaler"].update(scale=1024.0, _growth_tracker=7)
    torch.save(state, output_dir / "checkpoint.pth")
    second = train(tiny_data, output_dir, "--amp", "fp16", "--resume", "auto", epochs=2)
    assert "resumed from" in second and "(epoch 1)" in second
    scaler = weights(output_dir)["scaler"]
    assert scaler["scale"] == 1024.0 and scaler["_growth_tracker"] == 7 + 3, scaler  # 3 more steps, no overflow
    assert all(loss == loss for loss in losses(second))


def test_dataparallel_resume_restores_every_gpus_random_stream():
    """rng_state keeps one stream per device the process drives; a checkpoint written before
    that (one CUDA state, not a dict) still loads. (On the CPU there is no CUDA stream to save.)"""
    cpu = [torch.device("cpu")]
    state = rng_state(cpu)
    assert state["cuda"] == []
    expected = torch.rand(3)
    set_rng_state(state, cpu)
    assert torch.equal(torch.rand(3), expected)
    set_rng_state({**state, "cuda": torch.zeros(8, dtype=torch.uint8)}, cpu)  # the older format
    assert torch.equal(torch.rand(3), expected)


# ----------------------------------------------------------------------------- per-rank random streams

def test_ranks_draw_different_dropout_masks_from_the_same_weights(tiny_data, tmp_path):
    """Every rank starts from the same weights but draws its own dropout masks (seed + rank)."""
    result = torchrun("train_ddp.py", 2, "--data", tiny_data, *TINY, "-a", "tests.probe_models:DropoutMaskNet",
                      "-b", "8", "--seed", "0", "--epochs", "1", "--output-dir", tmp_path / "ddp")
    masks = dict(re.findall(r"^rank (\d) dropout mask ([01]+)$", assert_ok(result), re.MULTILINE))
    assert set(masks) == {"0", "1"}, result.stdout[-2000:]
    assert masks["0"] != masks["1"]
    # Rank 0 draws as a single process does: DataParallel (and world size 1) is unchanged.
    single = train(tiny_data, tmp_path / "dp", "-a", "tests.probe_models:DropoutMaskNet", "--dropout", "0.5",
                   epochs=1)
    assert re.search(r"^rank 0 dropout mask ([01]+)$", single, re.MULTILINE).group(1) == masks["0"]


# ----------------------------------------------------------------------------- -e, --channels-last, --compile, --deterministic

@pytest.mark.parametrize("extra, message", [
    ([], "error: -e evaluates the weights of --resume PATH or --pretrained: give one of them"),
    (["--resume", "auto"], "error: -e: no checkpoint in {out} to evaluate (--resume auto): give --resume PATH, "
                           "or --pretrained"),
])
def test_evaluate_without_weights_is_refused(tiny_data, tmp_path, extra, message):
    """-e on random weights would print a meaningless accuracy as if it were the model's."""
    out = tmp_path / "empty"
    result = run_script("train_dp.py", "--data", tiny_data, *TINY, "-e", *extra, "--output-dir", out)
    assert result.returncode == 2
    assert result.stdout.strip() == message.format(out=out), result.stdout[-2000:]


def test_channels_last_trains_as_the_default_format_does(tiny_data, tmp_path, fp32):
    """NHWC (on by default for a CNN on the CPU: --channels-last auto) changes the kernels, not the
    arithmetic beyond float rounding."""
    assert "model: tests.tiny_models:TinyNet, channels_last memory format (--channels-last auto)" in fp32.stdout
    nchw = train(tiny_data, tmp_path / "nchw", "--channels-last", "off")
    assert "default memory format (--channels-last off)" in nchw
    a, b = weights(fp32.output_dir)["state_dict"], weights(tmp_path / "nchw")["state_dict"]
    first = torch.load(fp32.output_dir / "checkpoint_prev.pth", weights_only=True)["state_dict"]
    assert max((a[k] - first[k]).abs().max().item() for k in a) > 1e-3  # the second epoch moved the weights
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert losses(nchw) == pytest.approx(losses(fp32.stdout), abs=1e-4)


def test_compile_trains_with_one_graph_per_mode_and_its_checkpoint_evaluates_alike(tmp_path):
    """torch.compile (inductor, C++ on the CPU). 27 training images at -b 6 leave a last batch of 3,
    which compiling drops (it would cost a second training graph); 12 validation images make two
    full batches. So: two graphs in all, training and evaluation, however many epochs. And the
    compiled run's last validation equals an eager evaluation of the checkpoint it saved."""
    data = make_image_folder(tmp_path / "data", train_per_class=9, val_per_class=4)
    output_dir = tmp_path / "compiled"
    common = ["--data", data, *TINY, *TINY_NET, "-b", "6", "--seed", "0"]
    out = assert_ok(run_script("train_dp.py", *common, "--epochs", "2", "--compile", "--output-dir", output_dir,
                               timeout=600))
    assert "torch.compile: 2 graph(s) compiled" in out, out[-3000:]
    assert re.findall(r"Epoch: \[1\] \[\s*(\d+)/(\d+)\]", out)[-1] == ("4", "4")  # the partial 5th dropped
    compiled = ACC.findall(out)[-1]
    eager = assert_ok(run_script("train_dp.py", *common, "-e", "--resume", output_dir / "checkpoint.pth",
                                 "--output-dir", tmp_path / "eval"))
    evaluated = ACC.findall(eager)[-1]
    assert compiled[0] == evaluated[0] and compiled[3] == evaluated[3] == "12"
    assert float(compiled[2]) == pytest.approx(float(evaluated[2]), abs=1e-4)


def test_deterministic_run_stays_deterministic_when_resumed(tiny_data, tmp_path):
    output_dir = tmp_path / "det"
    train(tiny_data, output_dir, "--deterministic", epochs=1)
    assert weights(output_dir)["args"]["deterministic"] is True
    resumed = train(tiny_data, output_dir, "--resume", "auto", epochs=2)
    assert "resumed from" in resumed
    assert weights(output_dir)["args"]["deterministic"] is True  # followed the checkpoint, not the default


# ----------------------------------------------------------------------------- two ranks on one GPU

def test_shared_devices_finds_two_ranks_on_one_gpu_of_one_host():
    assert shared_devices([("a", "gpu0"), ("a", "gpu1"), ("b", "gpu0")]) is None
    assert shared_devices([("a", "gpu0"), ("a", "gpu1"), ("a", "gpu0")]) == (0, 2, "gpu0")
