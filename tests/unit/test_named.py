"""common/named.py: `package.module:name` names code of your own on the command line (--arch, --dataset, --trainer)."""
import pytest

from common.errors import UsageError
from common.named import import_named


def test_a_name_with_a_colon_is_imported_and_one_without_is_a_built_in_name():
    from tests.tiny_models import TinyNet
    assert import_named("tests.tiny_models:TinyNet", "--arch") is TinyNet
    assert import_named("resnet18", "--arch") is None
    with pytest.raises(UsageError, match=r"^--dataset tests.nowhere:build: cannot import build from tests.nowhere \("):
        import_named("tests.nowhere:build", "--dataset")
    with pytest.raises(UsageError, match="cannot import Missing from tests.tiny_models"):
        import_named("tests.tiny_models:Missing", "--arch")
