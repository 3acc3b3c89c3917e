"""common/data.py: the data of one process assembled: the ranks' first batches together are one process's, validation
shards each image once, the recipe's flags reach the loaders, loader workers share a node's cores, the global batch
divides over the processes; a file that cannot be decoded is skipped (training: the next one takes its place;
validation: left out) and named, or ends the run in one line with --strict-data; a dataset's own bug is never
skipped; the ranks' lists pool at each save; a validation that reads too little ends the run."""

import io
import re
import shutil

import pytest
import torch
import torch.nn as nn
from PIL import Image

from common.data import (
    BadImageLog,
    SkipUnreadable,
    build_data,
    last_batch_for,
    loader_workers,
    per_process_batch,
    single_image_on_a_device,
)
from common.datasets import ImageFiles, build_datasets, load_image
from common.device_loader import Collate, DeviceLoader
from common.errors import UnreadableImage, UsageError, printable
from common.preemption import StopNow
from common.samplers import RepeatedAugmentationSampler
from common.transforms import Normalise, TrainPreset
from conftest import cpu_runtime, make_image_folder, parse, tensor_datasets

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables


@pytest.fixture
def folder(tiny_data, tmp_path):
    """A private, editable copy of the tiny ImageFolder."""
    return shutil.copytree(tiny_data, tmp_path / "data")


def data_of(config, rank=0, world_size=1, seed=5):
    return build_data(config, build_datasets(config), seed, cpu_runtime(rank, world_size))


def first_batch(config, rank, world_size):
    data = data_of(config, rank, world_size)
    data.train_sampler.set_epoch(0)
    images, labels, _ = next(iter(data.train_loader))
    return {(int(label), image.numpy().tobytes()) for image, label in zip(images, labels)}, data


def test_ranks_first_batches_together_are_the_single_process_first_batch(folder):
    # 13 validation images: 2 ranks cannot split them evenly, so padding (DistributedSampler's) would show.
    extra = next((folder / "val" / "circle").glob("0*.jpg"))
    shutil.copy(extra, extra.with_name("extra.jpg"))
    config = parse(
        "--data",
        folder,
        "-j",
        "0",
        "--train-crop-size",
        "24",
        "--val-resize-size",
        "32",
        "--val-crop-size",
        "32",
        "-b",
        "8",
    )
    single, _ = first_batch(config, rank=0, world_size=1)
    rank0, data0 = first_batch(config, rank=0, world_size=2)
    rank1, data1 = first_batch(config, rank=1, world_size=2)
    assert len(single) == 8 and len(rank0) == len(rank1) == 4
    assert rank0.isdisjoint(rank1)
    assert rank0 | rank1 == single
    # Validation: each of the 13 images on exactly one rank, none twice.
    shards = [list(data.val_loader.sampler) for data in (data0, data1)]
    assert sorted(shards[0] + shards[1]) == list(range(13)) and len(data0.val_loader.dataset) == 13
    assert [len(data.val_loader.sampler) for data in (data0, data1)] == [len(shard) for shard in shards] == [7, 6]
    assert data0.classes == ["circle", "ring", "square"]


def test_the_global_batch_must_divide_over_the_processes():
    assert per_process_batch(8, 2) == 4
    with pytest.raises(UsageError, match="multiple of 3"):
        per_process_batch(8, 3)


def test_the_dataset_crops_at_the_size_of_the_epoch_also_when_resumed(tiny_data):
    config = parse(
        "--data", tiny_data, "-j", "0", "--res-schedule", "16:32:0:2:8", "--train-crop-size", "20", "-b", "4"
    )
    data = data_of(config)
    dataset, sizes, images_at = data.train_loader.dataset, [], {}
    for epoch in range(4):
        dataset.set_epoch(epoch)
        images_at[epoch] = dataset[0][0]
        sizes.append(tuple(images_at[epoch].shape[-2:]))
    assert sizes == [(16, 16), (24, 24), (32, 32), (32, 32)]
    # A resumed run builds its data anew and sets the epoch it resumes in, mid-epoch or not.
    resumed = data_of(config).train_loader.dataset
    resumed.set_epoch(1)
    assert torch.equal(resumed[0][0], images_at[1])


def test_build_data_wires_the_recipe_flags(tiny_data):
    config = parse(
        "--data",
        tiny_data,
        "-j",
        "0",
        "--train-crop-size",
        "16",
        "--ra-sampler",
        "--ra-reps",
        "2",
        "--auto-augment",
        "ta_wide",
        "--random-erase",
        "0.5",
        "-b",
        "8",
    )
    data = data_of(config, rank=1, world_size=2)
    assert isinstance(data.train_sampler, RepeatedAugmentationSampler) and data.train_sampler.repetitions == 2
    assert data.train_loader.dataset.transform.augmentation is not None
    data.train_sampler.set_epoch(0)
    images_batch, labels, _ = next(iter(data.train_loader))
    base = data.train_loader.dataset.base
    assert images_batch.shape == (4, 3, 16, 16) and labels.tolist() == [
        base.dataset.samples[index % len(base)][1] for index in list(data.train_sampler)[:4]
    ]


@pytest.mark.parametrize(
    "cores, processes, expected",
    [
        (2, 1, 1),  # this machine, train_dp.py: one worker, the process keeps a core
        (2, 2, 0),  # this machine, 2 ranks: no core to spare
        (3, 2, 1),  # a core to spare: at least one worker each
        (16, 1, 15),  # one GPU on 16 cores: 8 workers fed an H100 half of what 15 did (make benchmark-gpu)
        (64, 1, 16),  # at most 16 per process
        (96, 8, 11),  # a GPU node: 12 cores per rank
        (16, 8, 1),
        (8, 8, 0),
    ],
)
def test_auto_loader_workers_share_the_cores_among_the_processes(cores, processes, expected):
    assert loader_workers("auto", processes, cores=cores) == expected
    assert loader_workers(3, processes, cores=cores) == 3  # a number is kept


def test_the_training_loader_fills_every_batch_and_the_validation_loader_leaves_bad_files_out(tiny_data, tmp_path):
    """A truncated and an empty training image, random bytes in validation: every training batch full (the next
    image took each one's place), each readable validation image once, each bad file named."""
    root = shutil.copytree(tiny_data, tmp_path / "data")
    whole = next((root / "train" / "circle").iterdir())
    bad = {
        root / "train" / "circle" / "truncated.jpg": whole.read_bytes()[:300],
        root / "train" / "square" / "empty.jpg": b"",
        root / "val" / "ring" / "garbage.jpg": bytes(range(256)) * 8,
    }
    for path, content in bad.items():
        path.write_bytes(content)
    data = data_of(
        parse(
            "--data",
            root,
            "-j",
            "0",
            "-b",
            "8",
            "--train-crop-size",
            "16",
            "--val-resize-size",
            "16",
            "--val-crop-size",
            "16",
        )
    )
    data.train_sampler.set_epoch(0)
    train, val = list(data.train_loader), list(data.val_loader)
    assert sum(len(target) for _, target, _ in train) == len(data.train_loader.dataset) == 26  # every slot filled
    assert sum(len(target) for _, target, _ in val if target is not None) == len(data.val_loader.dataset) - 1 == 12
    assert sorted({path for *_, found in train + val for path, _ in found}) == sorted(map(str, bad))


def image_bytes(mode="RGB", fmt="JPEG", size=(40, 40), color=(200, 30, 30)):
    buffer = io.BytesIO()
    Image.new(mode, size, {"L": 128, "I;16": 40000}.get(mode, color[: len(mode)])).save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A readable JPEG, a truncated one, an empty .jpg; and valid files in odd forms: CMYK and grayscale JPEG, PNG
    content under a .jpg name, RGBA PNG, 16-bit grayscale PNG."""
    root = make_image_folder(tmp_path_factory.mktemp("faulty"), train_per_class=1, val_per_class=1, num_classes=1)
    whole = next((root / "train" / "circle").iterdir())
    bad = {root / "truncated.jpg": whole.read_bytes()[: whole.stat().st_size // 3], root / "empty.jpg": b""}
    odd = {
        root / "cmyk.jpg": image_bytes("CMYK", color=(0, 200, 200, 0)),
        root / "gray.jpg": image_bytes("L"),
        root / "png-inside.jpg": image_bytes(fmt="PNG"),
        root / "rgba.png": image_bytes("RGBA", fmt="PNG"),
        root / "gray16.png": image_bytes("I;16", fmt="PNG"),
    }
    for path, content in {**bad, **odd}.items():
        path.write_bytes(content)
    return str(whole), sorted(map(str, bad)), sorted(map(str, odd))


def test_odd_but_valid_files_load_as_rgb(files):
    for path in files[2]:
        image = load_image(path)
        assert image.dtype == torch.uint8 and image.shape == (3, 40, 40), path


def test_a_bad_file_is_replaced_and_the_batch_keeps_its_size_in_training_and_left_out_in_validation(files):
    good, bad, _ = files
    samples = ImageFiles([(bad[0], 0), (good, 1), (bad[1], 2)])
    train = SkipUnreadable(samples, replace=True, strict=False)
    images, target, found = Collate()([train[0], train[1], train[2]])
    assert images.shape[0] == 3 and target.tolist() == [1, 1, 1]  # the readable file took both places
    assert sorted({path for path, _ in found}) == bad
    val = SkipUnreadable(samples, replace=False, strict=False)
    images, target, found = Collate(Normalise())([val[0], val[1], val[2]])
    assert images.shape[0] == 1 and images.dtype == torch.float32 and target.tolist() == [1]
    assert Collate(Normalise())([val[0]])[:2] == (None, None)
    with pytest.raises(
        UnreadableImage,
        match=rf"^cannot decode {re.escape(bad[0])} \(.+\); without --strict-data such "
        r"files are skipped and listed in bad_images.txt$",
    ):
        SkipUnreadable(samples, replace=True, strict=True)[0]


class Failing:
    """A dataset whose items raise `error`."""

    def __init__(self, error):
        self.error = error

    def __len__(self):
        return 60

    def __getitem__(self, index):
        raise self.error


def test_a_dataset_s_own_bug_and_a_stop_are_raised_not_skipped():
    for error in (TypeError("a bug of the dataset"), AttributeError("another"), StopNow("stopped on SIGTERM")):
        with pytest.raises(type(error)):
            SkipUnreadable(Failing(error), replace=True, strict=False)[0]


def test_a_data_set_that_reads_nothing_ends_the_run_after_fifty_in_a_row():
    with pytest.raises(
        UnreadableImage,
        match=r"^50 files in a row cannot be decoded, from Failing\[3\] on \(gone\): is "
        r"the data set readable\?$",
    ):
        SkipUnreadable(Failing(OSError("gone")), replace=True, strict=False)[3]


def test_the_ranks_lists_pool_at_each_sync_and_each_epoch_starts_afresh(capsys):
    log = BadImageLog(rank=1, world_size=2)
    log.report([("a.jpg", "truncated"), ("a.jpg", "truncated")])
    assert capsys.readouterr().out == "warning: rank 1: skipped a.jpg: cannot decode it (truncated)\n"  # once
    assert log.state_dict() == [["a.jpg", "truncated"]]
    resumed = BadImageLog(rank=0, world_size=1)
    resumed.load_state_dict([["a.jpg", "truncated"]])
    resumed.report([("a.jpg", "truncated")])
    assert capsys.readouterr().out == ""  # said before the stop
    resumed.next_epoch()
    assert resumed.state_dict() == []


def test_a_share_of_unreadable_validation_images_over_the_limit_is_refused():
    log = BadImageLog(0, 1)
    log.check_validation(12, 13)  # one broken file of 13: skipped
    with pytest.raises(UsageError, match=r"could not read 2 of its 13 images, more than 10%"):
        log.check_validation(11, 13)
    with pytest.raises(UsageError, match=r"could not read 1 of its 1 images"):
        log.check_validation(0, 1)


def test_the_example_of_a_refused_validation_is_one_of_validation_s_files(capsys):
    """The epoch's training skipped a file first: the example is validation's (it named a train sample)."""
    log = BadImageLog(0, 1)
    log.report([("train-000002.tar:n01/a", "truncated")])
    log.report_validation([("val-000000.tar:n01/b", "broken data stream")])
    with pytest.raises(
        UsageError,
        match=r"could not read 2 of its 3 images \(e\.g\. val-000000\.tar:n01/b: broken data "
        r"stream\), more than 10%",
    ):
        log.check_validation(1, 3)
    assert log.state_dict() == [["train-000002.tar:n01/a", "truncated"], ["val-000000.tar:n01/b", "broken data stream"]]
    log.next_epoch()
    with pytest.raises(UsageError, match=r"could not read 2 of its 3 images, more than"):  # none of this epoch's
        log.check_validation(1, 3)


def test_a_file_name_that_is_not_utf8_is_printed_with_its_bytes_escaped():
    assert printable(b"broken-\xff.jpg".decode("utf-8", "surrogateescape")) == "broken-\\xff.jpg"


def test_a_file_name_that_would_break_the_line_is_printed_escaped_and_strict_data_s_line_keeps_it_whole(tmp_path):
    """A name holding a newline would split the warning, and --strict-data's error keeps only its last line."""
    assert printable("a\nb\\c\u2028\x1b.jpg") == "a\\nb\\\\c\\u2028\\x1b.jpg"
    bad = tmp_path / "line\nbreak.jpg"
    bad.write_bytes(b"\xff\xd8 not a jpeg")
    with pytest.raises(UnreadableImage, match=rf"^cannot decode {re.escape(str(tmp_path))}/line\\nbreak\.jpg \(.+\); "):
        SkipUnreadable(ImageFiles([(str(bad), 0)]), replace=True, strict=True)[0]


def test_the_reason_says_no_file_object_of_pil_s():
    """PIL names the object it read: a file's name is in the warning already, a BytesIO's address means nothing."""
    import io

    from PIL import Image, UnidentifiedImageError

    from common.data import describe

    with pytest.raises(UnidentifiedImageError) as error:
        Image.open(io.BytesIO(b"not an image"))
    assert "BytesIO object at 0x" in str(error.value) and describe(error.value) == "cannot identify image file"
    assert (
        describe(OSError("cannot identify image file <_io.BufferedReader name='/d/a.jpg'>"))
        == "cannot identify image file"
    )


def decode_gpu_batches(root, decode, reported):
    """Every training batch of epoch 1 and every validation batch of `root` with --decode `decode`, on the CPU, as
    the Trainer makes them: a loader worker (a real process), then DeviceLoader (channels-last)."""
    config = parse("--data", root, "--decode", decode, "-j", "1", "-b", "4", "--seed", "0", "--train-crop-size", "48")
    data = build_data(config, build_datasets(config), 0, cpu_runtime())
    data.train_sampler.set_epoch(1)
    data.train_loader.dataset.set_epoch(1)
    normalise = data.normalise if decode == "gpu" else None
    val_set = data.val_loader.dataset
    kinds = sorted(type(val_set[k][0]).__name__ for k in range(len(val_set)))  # (what the workers hand over)
    return kinds, [
        list(DeviceLoader(loader, torch.device("cpu"), True, reported.extend, normalise))
        for loader in (data.train_loader, data.val_loader)
    ]


def test_decode_gpu_on_the_cpu_gives_the_loader_workers_batches_bit_for_bit(files, tmp_path):
    """--decode gpu: the JPEGs travel encoded and are decoded, cropped and flipped where the model is (here the CPU:
    the same decoder), with each image's own seeded box and flip; a CMYK JPEG and a PNG under a .jpg name are the
    loader worker's, a truncated file is skipped and named in both. Once the flip was drawn after the crop's
    transform ran in one path and before it in the other."""
    root = shutil.copytree(files[0].rsplit("/train/", 1)[0], tmp_path / "data")
    make_image_folder(root, train_per_class=3, val_per_class=2, num_classes=2)  # (adds classes beside circle)
    for split in ("train", "val"):
        for name in ("cmyk.jpg", "gray.jpg", "png-inside.jpg", "truncated.jpg"):
            shutil.copy(root / name, root / split / "circle" / f"odd-{name}")
    found = {decode: [] for decode in ("cpu", "gpu")}
    kinds, batches = {}, {}
    for decode in found:
        kinds[decode], batches[decode] = decode_gpu_batches(root, decode, found[decode])
    count = len(kinds["cpu"])
    assert kinds["cpu"] == ["NoneType"] + ["Tensor"] * (count - 1)
    assert kinds["gpu"] == ["EncodedJPEG"] * (count - 3) + ["NoneType"] + ["Tensor"] * 2  # (CMYK, PNG: the worker's)
    for split, (cpu, gpu) in enumerate(zip(batches["cpu"], batches["gpu"])):
        assert len(cpu) == len(gpu) > 1, split
        for (images, target), (images_gpu, target_gpu) in zip(cpu, gpu):
            assert torch.equal(images, images_gpu) and torch.equal(target, target_gpu)
            assert images_gpu.is_contiguous(memory_format=torch.channels_last)
    assert sorted(found["gpu"]) == sorted(found["cpu"]) and len(found["cpu"]) == 2  # the truncated one, twice


def test_auto_augment_on_images_of_other_than_1_or_3_channels_is_refused_at_start():
    """torchvision's policies' colour ops take 1 or 3 channels: 4-channel images were a traceback once one was drawn."""
    pixels = lambda i, channels: torch.full((channels, 20, 20), i % 250, dtype=torch.uint8)  # noqa: E731
    for channels in (1, 3, 4):
        stats = ("--mean", ",".join(["0.5"] * channels), "--std", ",".join(["0.2"] * channels))
        config = parse("--dummy", "--auto-augment", "ta_wide", *stats)
        items = [(pixels(i, channels), i % 2) for i in range(8)]
        if channels == 4:
            with pytest.raises(UsageError, match=r"^--auto-augment ta_wide takes images of 1 or 3 channels, .*have 4"):
                build_data(config, (["a", "b"], items, items), 0, cpu_runtime())
        else:
            data = build_data(config, (["a", "b"], items, items), 0, cpu_runtime())
            assert [data.train_loader.dataset[i][0].shape[0] for i in range(8)] == [channels] * 8


def test_decode_gpu_refuses_what_it_cannot_run_in_one_line(tiny_data, monkeypatch):
    with pytest.raises(UsageError, match=r"^--decode gpu decodes JPEGs, and --dummy has none"):
        parse("--dummy", "--decode", "gpu")
    config = parse("--data", tiny_data, "--decode", "gpu", "--auto-augment", "ta_wide")
    with pytest.raises(UsageError, match=r"^--decode gpu crops .*; this run has --auto-augment ta_wide, which the"):
        build_data(config, build_datasets(config), 0, cpu_runtime())
    config = parse("--data", tiny_data, "--decode", "gpu", "--preset", "tv-v2")  # (was "--auto-augment or ...")
    with pytest.raises(
        UsageError,
        match=r"; this run has --auto-augment ta_wide and --random-erase 0\.1 \(some from --preset tv-v2\), which",
    ):
        build_data(config, build_datasets(config), 0, cpu_runtime())
    config = parse("--data", tiny_data, "--decode", "gpu")
    classes, train_set, val_set = build_datasets(config)
    with pytest.raises(UsageError, match=r"^--decode gpu decodes the image files of --data, and the train set is a"):
        build_data(config, (classes, [(torch.zeros(3, 8, 8), 0)], val_set), 0, cpu_runtime())
    with pytest.raises(
        UsageError, match=r"^--decode gpu .*; this run has the transforms added by build_transforms, which"
    ):
        build_data(config, (classes, train_set, val_set), 0, cpu_runtime(), lambda t, v: (t.then(lambda x: x), v))
    own = lambda t, v: (TrainPreset(32, augmentation=lambda image: image), v)  # noqa: E731 (was dropped, silently)
    with pytest.raises(UsageError, match=r"; this run has an augmentation of build_transforms' own, which the loader"):
        build_data(config, (classes, train_set, val_set), 0, cpu_runtime(), own)
    monkeypatch.setattr("common.device_loader.decode_jpeg", None)  # (torchvision's decoders are deprecated)
    with pytest.raises(
        UsageError, match=r"^--decode gpu needs torchvision.io.decode_jpeg, which torchvision \S+ lacks$"
    ):
        build_data(config, (classes, train_set, val_set), 0, cpu_runtime())


def test_data_of_one_class_is_refused_in_one_line(tmp_path):
    """One class would train to a loss of 0 and 100% accuracy, which mean nothing: refused, whatever the source."""
    root = make_image_folder(tmp_path / "one", train_per_class=1, val_per_class=1, num_classes=1)
    config = parse("--data", root)
    with pytest.raises(UsageError, match=r"^the data has 1 class \['circle'\]: a classifier needs 2 or more$"):
        build_data(config, build_datasets(config), 0, cpu_runtime())
    _, train_set, val_set = tensor_datasets()
    with pytest.raises(UsageError, match=r"^the data has 0 classes \[\]: a classifier needs 2 or more$"):
        build_data(config, ([], train_set, val_set), 0, cpu_runtime())


def test_a_last_batch_that_leaves_a_device_a_single_image_is_dropped_for_a_model_with_batchnorm(tiny_data):
    for images in range(0, 20):
        for devices in range(1, 9):
            split = [len(chunk) for chunk in torch.arange(images).chunk(devices)]  # (DataParallel's scatter)
            assert single_image_on_a_device(images, devices) == (1 in split), (images, devices, split)
    assert len(build_datasets(parse("--data", tiny_data))[1]) == 24  # training images: 2 ranks take 12 each
    batch_norm, none = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), nn.Sequential(nn.Conv2d(3, 4, 3))
    for batch, world_size, dropped in [(4, 1, False), (23, 1, True), (22, 1, False), (22, 2, True), (10, 2, False)]:
        data = data_of(parse("--data", tiny_data, "-j", "0", "-b", str(batch)), world_size=world_size)
        assert data.train_loader.drop_last is False and data.val_loader.drop_last is False
        assert last_batch_for(data, none, 1).train_loader.drop_last is False  # (a model without trains on one)
        kept = last_batch_for(data, batch_norm, 1).train_loader
        samples, share = 24 // world_size, batch // world_size
        assert kept.drop_last is dropped and len(kept) == samples // share + (not dropped and samples % share > 0)
    data = data_of(parse("--data", tiny_data, "-j", "0", "-b", "48"), rank=23, world_size=24)  # (an image each)
    with pytest.raises(
        UsageError, match=r"^each process trains on 1 image\(s\) an epoch, and a device would have a single"
    ):
        last_batch_for(data, batch_norm, 1)
    compiled = data_of(parse("--data", tiny_data, "-j", "0", "-b", "32", "--compile"))  # (its last batch left out)
    with pytest.raises(
        UsageError, match=r"^each process trains on 24 image\(s\) an epoch, fewer than its batch of 32, and --compile"
    ):
        last_batch_for(compiled, none, 1)
