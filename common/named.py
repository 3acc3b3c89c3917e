"""`package.module:name` on the command line: --arch, --dataset and --trainer name code of your own this way."""
import importlib

from .errors import UsageError


def import_named(text, flag):
    """The object that `package.module:name` names (None for a text without a colon: a built-in name)."""
    if ":" not in text:
        return None
    module_name, _, name = text.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"{flag} {text}: cannot import {name} from {module_name} ({error})") from None
