"""Batches from the loader workers to the device: collated (files that could not be read left out, and
reported), normalised, moved, prefetched on a side stream on GPUs. No value is read back from the device.
"""

import torch
from torch.utils.data import default_collate

from . import distributed
from .datasets import SyntheticImages
from .preemption import waiting_for_data


class Collate:
    """collate_fn: (images, target, bad) from (image, label, bad) samples, leaving out skipped files
    (images None when all were). `normalise` (a Normalise, or None) turns the batch into normalised floats inside
    the loader worker: on the CPU, where the main process is the bottleneck and the workers have cores to spare."""

    def __init__(self, normalise=None):
        self.normalise = normalise

    def __call__(self, samples):
        bad = [entry for _, _, found in samples for entry in found]
        samples = [(image, label) for image, label, _ in samples if image is not None]
        if not samples:
            return None, None, bad
        images, target = default_collate(samples)
        if self.normalise is not None:
            images = self.normalise(images)
        return images, target, bad


class DeviceLoader:
    """The batches of `loader` on `device`, as normalised float images.

    On CUDA, images travel as they were decoded (uint8: a quarter of float32's bytes) and are converted,
    normalised (`normalise`, a Normalise; None: the loader's Collate did it) and made channels-last on the
    GPU, and the copy of the next batch runs on a side stream while the current one computes. On the CPU
    the loader workers have normalised them. The files skipped as undecodable go to on_bad(list of (path, reason))."""

    def __init__(self, loader, device, channels_last=False, on_bad=None, normalise=None, keep_empty=False):
        self.loader, self.device, self.channels_last, self.on_bad = loader, device, channels_last, on_bad
        self.keep_empty = keep_empty  # a batch of unreadable files alone as (None, None), not left out
        self.normalise = normalise.to(device) if normalise is not None else None

    def __len__(self):
        return len(self.loader)

    def _prepare(self, images, target):
        if images is None:
            return None, None
        images = images.to(self.device, non_blocking=True)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.normalise is not None:
            images = self.normalise(images)
        return images, target.to(self.device, non_blocking=True)

    def _batches(self):
        """The loader's non-empty (images, target), reporting skipped files on the way."""
        batches = iter(self.loader)
        while True:
            with waiting_for_data():  # a stop signal may end a wait that never ends (a hung file system)
                try:
                    batch = next(batches, None)
                except (EOFError, ConnectionResetError) as error:
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
            return (self._prepare(images, target) for images, target in self._batches())
        return self._prefetching()

    def _prefetching(self):
        stream, batches = torch.cuda.Stream(self.device), self._batches()
        stream.wait_stream(torch.cuda.current_stream(self.device))  # mean and std were made on that one

        def load_next():
            batch = next(batches, None)
            if batch is None:
                return None
            with torch.cuda.stream(stream):
                return self._prepare(*batch)

        upcoming = load_next()
        while upcoming is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            images, target = upcoming
            if images is not None:  # These tensors were made on the side stream; the main stream uses them.
                images.record_stream(torch.cuda.current_stream(self.device))
                target.record_stream(torch.cuda.current_stream(self.device))
            upcoming = load_next()
            yield images, target


class SyntheticOnDevice(DeviceLoader):
    """--dummy on a GPU: each batch made on the device, not by a loader (no worker, no copy), so that images/s is the
    model's: the synthetic image repeated, labels index % classes of the sampler's indices (resumable and sharded as
    any data), laid out and normalised as a copied batch is."""

    def __iter__(self):
        dataset = self.loader.dataset  # (a SyntheticImages: its image follows --res-schedule's epoch)
        images = dataset.image.to(self.device).expand(self.loader.batch_size, *dataset.image.shape)
        for indices in self.loader.batch_sampler:
            target = torch.as_tensor(indices) % dataset.num_classes
            yield self._prepare(images[: len(indices)], target)


def device_batches(loader, device, *args, **kwargs):
    """The DeviceLoader of `loader` on `device` (its other arguments DeviceLoader's): for --dummy on a GPU, batches made
    there (SyntheticOnDevice: the model's speed); on the CPU the loader's, as the tests use them."""
    synthetic = device.type == "cuda" and isinstance(loader.dataset, SyntheticImages)
    return (SyntheticOnDevice if synthetic else DeviceLoader)(loader, device, *args, **kwargs)


def equal_forwards(batches, forwards, placeholder):
    """(images, target, counted) of `batches` (a DeviceLoader with keep_empty) made `forwards` long: an empty batch
    or a missing one is `placeholder` (images, target), not counted. A sharded model's forward is a collective: every
    rank must run as many as the others."""
    batches = iter(batches)
    for _ in range(forwards):
        images, target = next(batches, (None, None))
        yield (*placeholder, False) if images is None else (images, target, True)


def validation_batches(batches, sharded, image_shape):
    """(images, target, counted) of this rank's validation `batches` (a DeviceLoader, keep_empty when `sharded`). A
    sharded model's forward is a collective: then every rank runs as many as the rank with the most, an empty batch
    (all its files unreadable) or a missing one as the forward of a zero image of `image_shape`, not counted."""
    if not sharded:
        return ((images, target, True) for images, target in batches)
    device = batches.device
    placeholder = (torch.zeros(1, *image_shape, device=device), torch.zeros(1, dtype=torch.long, device=device))
    return equal_forwards(batches, distributed.max_over_ranks(len(batches), device), placeholder)
