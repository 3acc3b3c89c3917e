"""common/presets.py: the dataset presets and --preset's layers, in their precedence, and the header line that says
which preset set what."""
import pytest

from common.presets import RECIPE_DEFAULTS, layers
from common.presets import describe_preset
from conftest import parse

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables


def test_the_layers_come_lowest_precedence_first_and_the_demo_set_keeps_its_own_scale():
    names = [name for name, _ in layers("imagenet", "imagenet", "tv-v2", {"lr": 0.3, "epochs": None}, 0.2)]
    assert names == ["", "the imagenet preset's lr", "", "--preset tv-v2's lr", "LR", "--lr"]
    assert layers("imagenet", "imagenet", None, {}, None)[0][1] is RECIPE_DEFAULTS
    assert layers("demo", "demo", "tv-v2", {}, None)[3][1] == {}  # on the demo set, no ImageNet scale
    assert layers("imagenet", "imagenet", "tv-v2", {"lr": 0.3, "epochs": None}, None)[4][1] == {"lr": 0.3}


def test_the_header_names_what_the_dataset_preset_set():
    assert describe_preset(parse("-b", "32", "--epochs", "2")) == [
        "preset: demo (the built-in demo set) sets lr 0.04, 32 px crops, val resize 36, val crop 32, cosine schedule; "
        "flags, the environment and --preset override it"]
    assert describe_preset(parse("--dummy", "-b", "8", "--epochs", "1", "--lr", "0.1", "--lr-schedule", "step",
                                 "--train-crop-size", "16", "--val-resize-size", "16", "--val-crop-size", "16")) == []
