"""Batches from the loader workers to the device: collated (unreadable files left out, and reported), decoded there
with --decode gpu (EncodedBatch, in a thread of its own, one batch ahead), normalised, moved, prefetched on a side
stream on GPUs. No value is read back from the device.
"""

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.utils.data import default_collate

from . import distributed
from .datasets import EncodedJPEG, SyntheticImages, decode_bytes, decoded, describe
from .errors import UnreadableFile, UnreadableImage, printable
from .preemption import waiting_for_data
from .transforms import planned

try:
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # (gone from a torchvision to come: --decode gpu then says so, common/data.py)
    decode_jpeg = None


class Collate:
    """collate_fn: (images, target, bad) from (image, label, bad) samples, skipped files left out (images None when
    all were). `normalise` (a Normalise, or None): normalised in the loader worker (on the CPU, where workers have
    cores to spare)."""

    def __init__(self, normalise=None):
        self.normalise = normalise

    def __call__(self, samples):
        bad = [entry for _, _, found in samples for entry in found]
        samples = [(image, label) for image, label, _ in samples if image is not None]
        if not samples:
            return None, None, bad
        if any(isinstance(image, EncodedJPEG) for image, _ in samples):
            return EncodedBatch(samples), torch.tensor([label for _, label in samples]), bad
        images, target = default_collate(samples)
        if self.normalise is not None:
            images = self.normalise(images)
        return images, target, bad


class EncodedBatch:
    """--decode gpu: a batch whose JPEGs travel encoded (in one buffer), to be decoded on the device; the images its
    loader worker decoded (CMYK, a PNG) travel as they are."""

    def __init__(self, samples):
        jpegs = [(k, image) for k, (image, _) in enumerate(samples) if isinstance(image, EncodedJPEG)]
        ready = [(k, image) for k, (image, _) in enumerate(samples) if not isinstance(image, EncodedJPEG)]
        self.size, self.data = len(samples), torch.cat([image.data for _, image in jpegs])
        self.jpegs = [(k, len(image.data), image.plan, image.name) for k, image in jpegs]
        self.ready_at = [k for k, _ in ready]
        self.ready = torch.stack([image for _, image in ready]) if ready else None

    def pin_memory(self):  # (DataLoader's pin_memory: the decoded part; nvJPEG reads the bytes where they are)
        self.ready = self.ready.pin_memory() if self.ready is not None else None
        return self

    def decode(self, device):
        """(images, kept, bad) on `device`: the JPEGs decoded there in one call, each cropped as its plan says, the
        ready images in their places. A JPEG the device cannot decode is decoded by the CPU; one that neither can is
        left out (`kept`: the positions that remain; `bad`: (name, reason) of the others)."""
        parts, reasons = list(torch.split(self.data, [size for _, size, _, _ in self.jpegs])), {}
        if device.type == "cuda":
            # nvJPEG writes its outputs on a stream of its own, taken from this stream's free memory without waiting
            # for the work queued here (pytorch/vision#9606): a batch's crops still running would be overwritten.
            torch.cuda.current_stream(device).synchronize()
        try:
            images = decode_jpeg(parts, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # one JPEG fails the whole call: each on its own
            images = [_decoded_one(part, device, reasons, k) for k, part in enumerate(parts)]
        slots = [None] * self.size
        for (k, _, plan, _), image in zip(self.jpegs, images):
            slots[k] = planned(image, plan) if image is not None else None
        if self.ready is not None:
            for k, image in zip(self.ready_at, self.ready.to(device, non_blocking=True)):
                slots[k] = image
        kept = [k for k, image in enumerate(slots) if image is not None]
        bad = [(name, reasons[j]) for j, (k, _, _, name) in enumerate(self.jpegs) if slots[k] is None]
        return (torch.stack([slots[k] for k in kept]) if kept else None), kept, bad


def _decoded_one(encoded, device, reasons, index):
    """One JPEG decoded on `device`, else by the CPU as a loader worker decodes it, else None (the CPU decoder's
    reason in reasons[index])."""
    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    try:
        return decoded(lambda: decode_bytes(encoded.numpy().tobytes(), "jpg")).to(device)
    except UnreadableFile as error:  # (the reason as SkipUnreadable gives a loader worker's)
        reasons[index] = describe(error)
        return None


class DeviceLoader:
    """The batches of `loader` on `device`, as normalised float images: on CUDA, copied as uint8 on a side stream
    while the batch before computes, then normalised (`normalise`; None: Collate did it) and laid out there. The
    files skipped as undecodable go to on_bad(list of (path, reason))."""

    def __init__(
        self, loader, device, channels_last=False, on_bad=None, normalise=None, keep_empty=False, undecodable="skip"
    ):
        self.loader, self.device, self.channels_last, self.on_bad = loader, device, channels_last, on_bad
        self.keep_empty = keep_empty  # a batch of unreadable files alone as (None, None), not left out
        self.normalise = normalise.to(device) if normalise is not None else None
        # --decode gpu, a JPEG that no decoder reads: "skip" (validation: left out, reported), "end" (training: no other
        # image can take its place here, so the run ends), "strict" (--strict-data's end)
        self.undecodable = undecodable

    def __len__(self):
        return len(self.loader)

    def _prepare(self, images, target):
        """(images, target, bad): the batch on the device, normalised; `bad`, the JPEGs of an EncodedBatch that no
        decoder could read (the caller reports them: this may run in the decode thread)."""
        bad = []
        if isinstance(images, EncodedBatch):
            images, kept, bad = images.decode(self.device)
            if bad and self.undecodable != "skip":
                raise UnreadableImage(
                    f"cannot decode {printable(bad[0][0])} ({bad[0][1]}); "
                    + (
                        "without --strict-data such files are skipped and listed in bad_images.txt"
                        if self.undecodable == "strict"
                        else "--decode gpu found it in a training batch, where no other image can take its place: "
                        "--decode cpu skips such a file and lists it in bad_images.txt"
                    )
                )
            target = target[kept] if len(kept) < len(target) else target
        if images is None:
            return None, None, bad
        images = images.to(self.device, non_blocking=True)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.normalise is not None:
            images = self.normalise(images)
        return images, target.to(self.device, non_blocking=True), bad

    def _batches(self):
        """The loader's non-empty (images, target), reporting skipped files on the way."""
        batches = iter(self.loader)
        while True:
            with waiting_for_data():  # a stop signal may end a wait that never ends (a hung file system)
                try:
                    batch = next(batches, None)
                except (EOFError, ConnectionError) as error:
                    # A worker that died while handing over a batch (its tensors' shared memory can no longer
                    # be fetched from it): the fault torch reports as "DataLoader worker ... exited unexpectedly".
                    raise RuntimeError(
                        f"DataLoader worker exited unexpectedly while sending a batch ({type(error).__name__})"
                    ) from None
            if batch is None:
                return
            images, target, bad = batch
            if bad and self.on_bad is not None:
                self.on_bad(bad)
            if images is not None or self.keep_empty:
                yield images, target

    def __iter__(self):
        if self.device.type != "cuda":
            return self._handed_over(_one_ahead(self._prepare, self._batches()))
        return self._handed_over(self._prefetching(), on_device=True)

    def _handed_over(self, prepared, on_device=False):
        """The batches of `prepared` ((images, target, bad[, ready]): _prepare's, and on GPUs the event that marks the
        end of its work on the side stream), their bad files reported here, in the training process's thread."""
        with contextlib.closing(prepared):  # (left early: the decode thread ends here)
            for images, target, bad, *ready in prepared:
                if on_device:
                    torch.cuda.current_stream(self.device).wait_event(ready[0])
                    if images is not None:  # These tensors were made on the side stream; the main stream uses them.
                        images.record_stream(torch.cuda.current_stream(self.device))
                        target.record_stream(torch.cuda.current_stream(self.device))
                if bad and self.on_bad is not None:
                    self.on_bad(bad)
                if images is not None or self.keep_empty:  # (a batch of JPEGs that no decoder could read is none)
                    yield images, target

    def _prefetching(self):
        """_prepare's batches on a side stream, each begun before the one before is handed over."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # mean and std were made on that one

        def prepare(images, target):
            with torch.cuda.device(self.device), torch.cuda.stream(stream):  # (the decode thread's device too)
                batch, ready = self._prepare(images, target), torch.cuda.Event()
                ready.record(stream)
            return *batch, ready

        return _one_ahead(prepare, self._batches(), always=True)


def _one_ahead(prepare, batches, always=False):
    """prepare(*batch) of each of `batches`, in order. From the first EncodedBatch on, batches are prepared in a
    thread of its own, and after an EncodedBatch the next one is begun before it is handed over (its decode waits
    for the device while the caller queues this one's step). `always`: every batch one ahead."""
    pool, upcoming = None, None
    try:
        for images, target in batches:
            if isinstance(images, EncodedBatch) or pool is not None:  # (then one thread queues all on the stream)
                pool = pool or ThreadPoolExecutor(1, thread_name_prefix="decode")
                begun = pool.submit(prepare, images, target)
            else:
                begun = Future()
                begun.set_result(prepare(images, target))
            if upcoming is not None:
                yield upcoming.result()
            upcoming = begun
            if not (always or isinstance(images, EncodedBatch)):
                yield upcoming.result()
                upcoming = None
        if upcoming is not None:
            yield upcoming.result()
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)  # (waits for a decode under way: its tensors are in use)


class SyntheticOnDevice(DeviceLoader):
    """--dummy on a GPU: each batch made on the device (no worker, no copy), so that images/s is the model's: the
    synthetic image repeated, labels index % classes of the sampler's indices, normalised as a copied batch is."""

    def __iter__(self):
        dataset = self.loader.dataset  # (a SyntheticImages: its image follows --res-schedule's epoch)
        images = dataset.image.to(self.device).expand(self.loader.batch_size, *dataset.image.shape)
        for indices in self.loader.batch_sampler:
            target = torch.as_tensor(indices) % dataset.num_classes
            yield self._prepare(images[: len(indices)], target)[:2]


def device_batches(loader, device, *args, **kwargs):
    """The DeviceLoader of `loader` on `device` (the other arguments DeviceLoader's); SyntheticOnDevice for --dummy on
    a GPU."""
    synthetic = device.type == "cuda" and isinstance(loader.dataset, SyntheticImages)
    return (SyntheticOnDevice if synthetic else DeviceLoader)(loader, device, *args, **kwargs)


def equal_forwards(batches, forwards, placeholder):
    """(images, target, counted) of `batches` (a DeviceLoader with keep_empty) made `forwards` long: an empty batch
    or a missing one is `placeholder` (images, target), not counted."""
    batches = iter(batches)
    for _ in range(forwards):
        images, target = next(batches, (None, None))
        yield (*placeholder, False) if images is None else (images, target, True)


def validation_batches(batches, sharded, image_shape):
    """(images, target, counted) of this rank's validation `batches` (a DeviceLoader, keep_empty when `sharded`). A
    sharded model's forward is a collective: then every rank runs as many as the rank with the most, an empty or
    missing batch as the forward of a zero image of `image_shape`, not counted."""
    if not sharded:
        return ((images, target, True) for images, target in batches)
    device = batches.device
    placeholder = (torch.zeros(1, *image_shape, device=device), torch.zeros(1, dtype=torch.long, device=device))
    return equal_forwards(batches, distributed.max_over_ranks(len(batches), device), placeholder)
