"""common/device_loader.py: batches collated without the files that could not be read, normalised with one
arithmetic in the loader workers (CPU) and on the device (GPU), channels-last when asked, and a batch lost with its
worker reported as the dead worker, in one line."""

import io
import random
import threading

import numpy as np
import pytest
import torch

from common.datasets import encoded_jpeg
from common.device_loader import Collate, DeviceLoader, _one_ahead, equal_forwards
from common.errors import UnreadableImage
from common.launch import known_failure
from common.transforms import Normalise, TrainPreset


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_device_loader_and_the_loader_workers_normalise_alike_uint8_and_float_images(channels_last, dtype):
    """On a GPU DeviceLoader normalises (the batch travels as decoded), on the CPU the workers' Collate does: one
    arithmetic for both, uint8 images on the 0-255 scale, float ones on 0-1 (the same pixels give the same
    inputs). Once float images were left unnormalised on a GPU, silently."""
    pixels = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    images = pixels if dtype == torch.uint8 else pixels.float() / 255
    normalise = Normalise()
    loader = DeviceLoader([(images, torch.tensor([1, 2]), [])], torch.device("cpu"), channels_last, normalise=normalise)
    ((batch, target),) = list(loader)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    assert torch.allclose(batch, (pixels.float() / 255 - mean) / std, atol=1e-5)
    assert batch.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert target.tolist() == [1, 2] and len(loader) == 1
    collated, _, _ = Collate(normalise)([(image, label, ()) for image, label in zip(images, [1, 2])])
    assert torch.allclose(collated, batch, atol=1e-6)


def test_collate_leaves_out_what_could_not_be_read_and_the_device_loader_reports_it():
    image = torch.zeros(3, 4, 4, dtype=torch.uint8)
    samples = [(image, 1, [("a.jpg", "truncated")]), (None, None, [("b.jpg", "empty")]), (image, 2, [])]
    images, target, bad = Collate()(samples)
    assert images.shape == (2, 3, 4, 4) and images.dtype == torch.uint8 and target.tolist() == [1, 2]
    assert bad == [("a.jpg", "truncated"), ("b.jpg", "empty")]
    assert Collate(Normalise())([(None, None, [("c.jpg", "x")])]) == (None, None, [("c.jpg", "x")])
    reported = []
    batches = [(images, target, bad), (None, None, [("c.jpg", "x")])]
    assert len(list(DeviceLoader(batches, torch.device("cpu"), on_bad=reported.extend))) == 1  # the empty batch skipped
    assert reported == [*bad, ("c.jpg", "x")]


def test_a_sharded_model_runs_as_many_validation_forwards_on_every_rank_counting_only_real_batches():
    """FSDP's forward is a collective: a batch whose files were all unreadable, and the batches a shorter shard lacks,
    become forwards of a placeholder that are not counted."""
    image = torch.ones(1, 3, 4, 4)
    batches = [(image, torch.tensor([1]), []), (None, None, [("c.jpg", "x")]), (image * 2, torch.tensor([2]), [])]
    loader = DeviceLoader(batches, torch.device("cpu"), keep_empty=True)
    placeholder = (torch.zeros(1, 3, 4, 4), torch.zeros(1, dtype=torch.long))
    forwards = list(equal_forwards(loader, 5, placeholder))
    assert [counted for *_, counted in forwards] == [True, False, True, False, False]
    assert [images.sum().item() for images, _, _ in forwards] == [48, 0, 96, 0, 0]


class _BrokenHandOver:
    """A loader whose second batch cannot be fetched from its worker, as when the worker is killed while
    sending it (torch's fd hand-over then raises EOFError or ConnectionResetError in the main process)."""

    def __init__(self, error):
        self.error = error

    def __len__(self):
        return 2

    def __iter__(self):
        yield torch.zeros(1, 3, 4, 4, dtype=torch.uint8), torch.zeros(1, dtype=torch.long), ()
        raise self.error


@pytest.mark.parametrize(
    "error",  # (refused: the worker's end reaped where SIGCHLD was ignored, a traceback once)
    [EOFError(), ConnectionResetError(104, "Connection reset by peer"), ConnectionRefusedError(111, "refused")],
)
def test_a_batch_lost_with_its_worker_is_reported_as_the_dead_worker_in_one_line(error):
    batches = iter(DeviceLoader(_BrokenHandOver(error), torch.device("cpu")))
    next(batches)
    with pytest.raises(RuntimeError) as raised:
        next(batches)
    assert known_failure(raised.value) == (
        f"error: DataLoader worker exited unexpectedly while sending a batch "
        f"({type(error).__name__}) (killed for memory? fewer --workers use less; a crash? -j 0 decodes in the "
        "training process, where it shows)"
    )


@pytest.mark.parametrize("channels_last", [False, True])
def test_synthetic_batches_made_on_the_device_are_the_loaders_batches_resumed_and_sharded_alike(channels_last):
    """--dummy on a GPU (SyntheticOnDevice) makes each batch where it computes, no loader worker and no copy: the same
    images, labels and batch sizes as the loader's batches (normalised and laid out as those are), over the sampler's
    indices, so a resumed epoch and a rank's shard are those of the loader. Here on the CPU: the same code."""
    from torch.utils.data import DataLoader

    from common.datasets import SyntheticImages
    from common.device_loader import SyntheticOnDevice
    from common.samplers import ResumableSampler

    dataset = SyntheticImages(23, 8, num_classes=5)
    sampler = ResumableSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(dataset, sampler=sampler, batch_size=4, collate_fn=Collate(), num_workers=0)
    normalise, cpu = Normalise(), torch.device("cpu")
    for start in (0, 4):  # a resumed epoch starts part-way through the shard
        sampler.set_epoch(1, start=start)
        made = list(SyntheticOnDevice(loader, cpu, channels_last, normalise=normalise))
        sampler.set_epoch(1, start=start)
        loaded = list(DeviceLoader(loader, cpu, channels_last, normalise=normalise))
        assert (
            [len(target) for _, target in made]
            == [len(target) for _, target in loaded]
            == ([4, 4, 4] if not start else [4, 4])
        )
        for (images, target), (images_loaded, target_loaded) in zip(made, loaded):
            assert torch.equal(images, images_loaded) and torch.equal(target, target_loaded)
            assert images.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    # The Trainer's choice: made on the device on a GPU only; real data always through its loader.
    from common.device_loader import device_batches

    assert type(device_batches(loader, torch.device("cuda"))) is SyntheticOnDevice
    assert type(device_batches(loader, cpu)) is DeviceLoader
    images = DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 3, 2, 2)), batch_size=2)
    assert type(device_batches(images, torch.device("cuda"))) is DeviceLoader


def jpeg(seed, size=(24, 32)):
    from PIL import Image

    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "JPEG")
    return buffer.getvalue()


def broken_jpeg():
    """A JPEG whose header passes (the loader worker hands it over encoded) but whose Huffman table is broken: the
    device's decoder and the CPU's both fail on it."""
    good = jpeg(0)
    start = good.index(b"\xff\xc4") + 5  # (the first Huffman table's counts)
    return good[:start] + b"\xff" * 16 + good[start + 16 :]


def test_a_jpeg_that_no_decoder_reads_is_left_out_of_a_validation_batch_and_ends_a_training_run():
    """--decode gpu: such a JPEG is found in the training process, after its batch was made. In validation it is left
    out and reported with the CPU decoder's reason, its label with it (a batch of it alone is no batch); in training,
    where no other image can take its place, and under --strict-data, it ends the run in one line."""
    samples = [encoded_jpeg(data, name) for data, name in [(jpeg(0), "good.jpg"), (broken_jpeg(), "broken.jpg")]]
    assert None not in samples
    preset = TrainPreset(16)
    batch = Collate()(
        [(preset(image, random.Random(k)), label, ()) for k, (image, label) in enumerate(zip(samples, [3, 4]))]
    )
    reported = []
    ((images, target),) = list(
        DeviceLoader([batch], torch.device("cpu"), on_bad=reported.extend, normalise=Normalise())
    )
    assert images.shape == (1, 3, 16, 16) and target.tolist() == [3]
    assert reported == [("broken.jpg", "broken data stream when reading image file")]  # (PIL's words)
    alone = Collate()([(preset(samples[1], random.Random(0)), 4, ())])
    assert list(DeviceLoader([alone], torch.device("cpu"), on_bad=reported.extend, normalise=Normalise())) == []
    for undecodable, ending in [
        (
            "end",
            "--decode gpu found it in a training batch, where no other image can take its place: --decode cpu "
            "skips such a file and lists it in bad_images.txt",
        ),
        ("strict", "without --strict-data such files are skipped and listed in bad_images.txt"),
    ]:
        loader = DeviceLoader([batch], torch.device("cpu"), normalise=Normalise(), undecodable=undecodable)
        with pytest.raises(UnreadableImage) as raised:
            list(loader)
        assert str(raised.value) == f"cannot decode broken.jpg (broken data stream when reading image file); {ending}"


def decode_threads():
    return [thread for thread in threading.enumerate() if thread.name.startswith("decode")]


def test_decode_gpu_decodes_in_a_thread_one_batch_ahead_and_hands_the_batches_over_in_order():
    """The decode waits for the device: the training process takes the next batch from the loader, and a thread of
    its own begins decoding it, before this one is handed over (on a GPU its step is queued meanwhile). Batches come
    in the loader's order, one the worker decoded among them; unreadable files are reported in the training process's
    thread, each with its batch; the thread ends with the iteration, also one left early."""
    preset, taken, reported = TrainPreset(16), [], []
    encoded = lambda data, label: (preset(encoded_jpeg(data, f"{label}.jpg"), random.Random(label)), label, ())  # noqa: E731
    batches = [
        Collate()([encoded(jpeg(0), 0)]),
        Collate()([encoded(jpeg(1), 1), encoded(broken_jpeg(), 9)]),
        Collate()([(torch.zeros(3, 16, 16, dtype=torch.uint8), 2, ())]),  # (decoded by the worker)
        Collate()([encoded(jpeg(3), 3)]),
    ]

    def loader():
        for k, batch in enumerate(batches):
            taken.append(k)
            yield batch

    def on_bad(bad):
        reported.append((len(taken), threading.current_thread() is threading.main_thread(), bad))

    with torch.inference_mode():  # (a tensor made in the decode thread is not an inference tensor: where it was made)
        handed = iter(DeviceLoader(loader(), torch.device("cpu"), on_bad=on_bad, normalise=Normalise()))
        first = next(handed)
        assert taken == [0, 1] and len(decode_threads()) == 1
        handed = [first, *handed]
        assert [target.tolist() for _, target in handed] == [[0], [1], [2], [3]] and decode_threads() == []
        # every batch from the first EncodedBatch on, the workers' too: one thread queues all on the device's stream
        assert [images.is_inference() for images, _ in handed] == [False] * 4
        assert next(iter(DeviceLoader(batches[2:3], torch.device("cpu"), normalise=Normalise())))[0].is_inference()
    assert reported == [(3, True, [("9.jpg", "broken data stream when reading image file")])]
    handed = iter(DeviceLoader(loader(), torch.device("cpu"), normalise=Normalise()))
    next(handed)
    handed.close()
    assert decode_threads() == []


def test_on_a_gpu_every_batch_is_prepared_one_ahead_in_order():
    """_prefetching's order (on a GPU: each batch's copy and normalisation queued on the side stream before the one
    before is handed over), here with a prepare that records when it ran."""
    begun = []
    prepared = _one_ahead(lambda images, target: begun.append(images) or (images, target), ((k, k) for k in range(4)))
    assert [(images, list(begun)) for images, _ in prepared] == [
        (0, [0]),
        (1, [0, 1]),
        (2, [0, 1, 2]),
        (3, [0, 1, 2, 3]),
    ]
    begun.clear()
    ahead = _one_ahead(
        lambda images, target: begun.append(images) or (images, target), ((k, k) for k in range(4)), always=True
    )
    assert [(images, list(begun)) for images, _ in ahead] == [
        (0, [0, 1]),
        (1, [0, 1, 2]),
        (2, [0, 1, 2, 3]),
        (3, [0, 1, 2, 3]),
    ]
