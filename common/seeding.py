"""Seeds, random streams and determinism. Every rank starts from the same seed (the same initial weights); once the
model is built, each rank's streams are seeded with seed + rank. A checkpoint holds every rank's streams, so a resumed
run draws what an uninterrupted one would. Data order and augmentation do not use them: they are functions of (seed,
epoch, index) alone.
"""

import os
import random

import numpy
import torch


def seed_all(seed):
    """Python's, numpy's and torch's streams (every device's) from `seed`: the same on every rank, until
    seed_this_rank."""
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_this_rank(seed, rank, devices):
    """Seed the streams that dropout and stochastic depth draw from with seed + rank (as timm does), once the model is
    built, so that ranks do not drop the same units. Under DataParallel, the replica on the k-th GPU draws from
    seed + rank + k."""
    random.seed(seed + rank)
    numpy.random.seed((seed + rank) % 2**32)  # (a researcher's np.random in a step: was not seeded, nor saved)
    torch.manual_seed(seed + rank)
    for k, device in enumerate(devices[1:], start=1):
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed + rank + k)


class RandomStreams:
    """This process's random streams: Python's, numpy's, torch's CPU one and that of each GPU it drives, in the order
    of `devices` (the first is the one DataParallel gathers on; --gpus may name others on resume)."""

    def __init__(self, devices):
        self.gpus = [device for device in devices if device.type == "cuda"]

    def state_dict(self):
        numpy_state = numpy.random.get_state()  # (its keys as a tensor: a numpy array is no weights_only data)
        return {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": [torch.from_numpy(keys.astype("int64")) if k == 1 else keys for k, keys in enumerate(numpy_state)],
            "cuda": [torch.cuda.get_rng_state(device) for device in self.gpus],
        }

    def load_state_dict(self, state):
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "numpy" in state:  # (since checkpoints had it)
            name, keys, *rest = state["numpy"]
            numpy.random.set_state((name, keys.numpy().astype("uint32"), *rest))
        for device, device_state in zip(self.gpus, state["cuda"]):  # more GPUs than saved: those keep their seeds
            torch.cuda.set_rng_state(device_state, device)


def set_determinism(deterministic):
    """--deterministic: deterministic kernels only (an error names any op that has none), cuBLAS with
    a fixed workspace, cuDNN without autotuning. Else cuDNN autotunes: fastest, not repeatable."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
