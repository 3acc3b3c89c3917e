"""common/pretrained.py: torchvision's weights by name, downloaded where missing and read as weights alone; what
cannot be had (no network, a server that says nothing, a file in the cache that is no weights or holds code) is one
line naming the file and where it goes."""

import socket
import threading

import pytest
import torch
import torchvision

from common import pretrained
from common.errors import UsageError
from harness.processes import within

WEIGHTS = torchvision.models.ResNet18_Weights.IMAGENET1K_V1


def test_the_offline_pretrained_line_names_the_file_and_the_folder_it_goes_in(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    line = pretrained.offline_message(WEIGHTS, OSError("no network"))
    assert line == (
        f"cannot get pretrained weights ResNet18_Weights.IMAGENET1K_V1 (no network): put "
        f"resnet18-f37072fd.pth (from https://download.pytorch.org/models/resnet18-f37072fd.pth) into "
        f"{tmp_path}/home/hub/checkpoints, or train without --pretrained"
    )


def test_a_download_from_a_server_that_says_nothing_ends_in_one_line(monkeypatch, tmp_path):
    """A proxy (https_proxy, as on many clusters) that takes the connection and never answers: one line once no byte
    came for DOWNLOAD_TIMEOUT s (was: a wait without end, on every rank)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    for name in ("https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{server.getsockname()[1]}")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(pretrained, "DOWNLOAD_TIMEOUT", 1)
    try:
        with within(60), pytest.raises(UsageError, match=r"^cannot get pretrained weights \S+ \(.*timed out"):
            pretrained.pretrained_model("resnet18", WEIGHTS, {})
    finally:
        server.close()
    assert accepted and socket.getdefaulttimeout() is None


@pytest.mark.parametrize("content", [b"", b"<html>502 Bad Gateway</html>"], ids=["empty", "an error page"])
def test_a_file_in_the_cache_that_is_no_weights_is_one_line_that_says_to_delete_it(monkeypatch, tmp_path, content):
    """A download cut short, or a proxy's error page saved under the weights' name (the offline line says to put the
    file there): one line (was: EOFError's or UnpicklingError's traceback)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    cached = tmp_path / "home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(content)
    with pytest.raises(UsageError, match=rf"^cannot read pretrained weights \S+ from {cached} \(.+\): delete it"):
        pretrained.pretrained_model("resnet18", WEIGHTS, {})


class Payload:
    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_file_in_the_cache_that_holds_code_is_refused_and_nothing_in_it_runs(monkeypatch, tmp_path):
    """torch.hub reads its cache with pickle (weights_only=False): a file put there by hand ran its code (was: the
    file opened, then a line about an unexpected key)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    cached = tmp_path / "home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    payload = Payload()
    payload.path = str(tmp_path / "ran")
    torch.save({"x": payload, **torchvision.models.resnet18().state_dict()}, cached)
    with pytest.raises(UsageError, match=r"^cannot read pretrained weights .*Weights only load failed"):
        pretrained.pretrained_model("resnet18", WEIGHTS, {})
    assert not (tmp_path / "ran").exists()


def test_another_model_s_weights_under_the_name_are_one_line_that_says_to_delete_them(monkeypatch, tmp_path):
    """Weights alone, but not this model's (a head of 10 classes): one line (was: load_state_dict's traceback)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    cached = tmp_path / "home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), cached)
    with pytest.raises(UsageError, match=r"^cannot read pretrained weights \S+ from \S+ \(Error\(s\) in loading"):
        pretrained.pretrained_model("resnet18", WEIGHTS, {})


def test_weights_in_the_cache_are_the_model_s(monkeypatch, tmp_path):
    """The file put where the offline line says (here a state dict of ours in its place): read, and the model's."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    cached = tmp_path / "home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    torch.manual_seed(0)
    saved = torchvision.models.resnet18().state_dict()
    torch.save(saved, cached)
    model = pretrained.pretrained_model("resnet18", WEIGHTS, {})
    assert all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())
