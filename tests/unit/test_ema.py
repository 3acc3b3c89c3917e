"""common/ema.py: the EMA of the weights (--model-ema), as torchvision's train.py keeps it, and its state."""
import copy

import pytest
import torch
import torch.nn as nn
import torchvision

from common.ema import ModelEma, adjusted_decay


def small_bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def train_a_step(model):
    """Move the parameters and the BatchNorm statistics, as a training step does."""
    model.train()
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.1 * parameter.grad
            parameter.grad = None


def test_an_ema_with_decay_0_equals_the_model():
    model = small_bn_net()
    ema = ModelEma(model, decay=0.0)
    for step in range(3):
        train_a_step(model)
        ema.after_step(step, epoch=0)
    ema_state, model_state = ema.module.state_dict(), model.state_dict()
    assert ema_state.keys() == model_state.keys()
    assert all(torch.equal(ema_state[name], model_state[name]) for name in model_state)  # buffers too
    assert ema.n_averaged == 3


def test_the_ema_decay_is_adjusted_as_torchvisions_train_py_does():
    # torchvision's references/classification/train.py, with its tv-v2 numbers: 8 GPUs x 128, 32 steps, 600 epochs.
    world_size, batch_size, model_ema_steps, epochs, model_ema_decay = 8, 128, 32, 600, 0.99998
    adjust = world_size * batch_size * model_ema_steps / epochs
    alpha = 1.0 - model_ema_decay
    alpha = min(1.0, alpha * adjust)
    assert adjusted_decay(0.99998, 1024, 32, 600) == 1.0 - alpha
    assert adjusted_decay(0.99998, 1024, 32, 600) == pytest.approx(1 - 2e-5 * 1024 * 32 / 600, rel=1e-12, abs=1e-12)
    assert adjusted_decay(0.9, 1024, 32, 600) == 0.0  # alpha capped at 1: the EMA is the weights


def test_the_ema_updates_at_torchvision_s_steps_and_restarts_from_the_weights_during_warmup():
    """4 steps an epoch, --model-ema-steps 3: updates after the steps whose index in the epoch is a multiple of 3,
    as torchvision's train_one_epoch (`if model_ema and i % args.model_ema_steps == 0`): global steps 0, 3, 4, 7,
    8, 11. One warmup epoch: the updates of epoch 0 copy the weights and leave n_averaged at 0, so the first of
    epoch 1 copies them too; then decay 0.5 averages."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    ema = ModelEma(model, decay=0.5, every=3, warmup_epochs=1)
    updated, counts, values, torchvision_updates = [], [], [], []
    for epoch in range(3):
        for i in range(4):  # torchvision's loop variable
            global_step = epoch * 4 + i
            with torch.no_grad():
                model.weight += 1  # the weight after step g is g + 1
            if i % 3 == 0:
                torchvision_updates.append(global_step)
            if ema.after_step(i, epoch=epoch):
                updated.append(global_step)
                counts.append(ema.n_averaged)
                values.append(ema.module.weight.item())
    assert updated == torchvision_updates == [0, 3, 4, 7, 8, 11]
    assert counts == [0, 0, 1, 2, 3, 4]
    assert values[:3] == [1.0, 4.0, 5.0] and values[3] == 0.5 * 5.0 + 0.5 * 8.0


def test_an_ema_saved_and_loaded_mid_run_goes_on_as_one_that_was_not():
    def train(model, ema, steps):
        for step in steps:
            train_a_step(model)
            ema.after_step(step, epoch=0)
    model = small_bn_net()
    uninterrupted = ModelEma(model, decay=0.7, every=2)
    torch.manual_seed(1)
    train(model, uninterrupted, range(6))
    model = small_bn_net()
    first = ModelEma(model, decay=0.7, every=2)
    torch.manual_seed(1)
    train(model, first, range(3))
    saved = copy.deepcopy(first.state_dict())
    second = ModelEma(model, decay=0.7, every=2)  # made from the weights: loading must replace them
    second.module.load_state_dict(saved["state_dict"])  # as common/checkpoint.py restores it
    second.restart(saved["n_averaged"], copy=False)
    train(model, second, range(3, 6))
    assert second.n_averaged == uninterrupted.n_averaged == 3
    for name, value in uninterrupted.module.state_dict().items():
        assert torch.equal(second.module.state_dict()[name], value), name


def test_the_ema_state_loads_with_weights_only_into_a_plain_model(tmp_path):
    model = torchvision.models.resnet18(num_classes=3)
    ema = ModelEma(model, decay=0.5)
    train_a_step(model)
    ema.after_step(0, epoch=0)
    torch.save(ema.state_dict(), tmp_path / "ema.pth")
    saved = torch.load(tmp_path / "ema.pth", weights_only=True)
    plain = torchvision.models.resnet18(num_classes=3)
    plain.load_state_dict(saved["state_dict"])  # strict: the bare model's keys
    assert saved["n_averaged"] == 1
    assert torch.equal(plain.fc.weight, model.fc.weight)  # the first update copies the weights
