"""The ``"package.module:name"`` targets a config names (a model class, a ``map`` step's
function): the one place csrun imports a module by a name it did not write itself.
"""

from __future__ import annotations

import importlib
from typing import Any

from .problems import ConfigError, Problem, did_you_mean
from .user_code import ensure_cwd_importable, user_location

__all__ = ["import_object"]


def import_object(target: str, field: str) -> Any:
    """Import ``"package.module:name"``; the current folder is searched first, as with
    ``python -m``.

    Raises:
      ConfigError: at ``field``, with what failed (format, module, attribute).
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError([Problem(field, f"{target!r} is not 'package.module:name'",
                                   "e.g. mypackage.models:Net")])
    ensure_cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        where = user_location(exc)  # an error inside the module, not a missing one
        raise ConfigError([Problem(field, f"cannot import module {module_name!r}: "
                                   f"{type(exc).__name__}: {exc}" +
                                   (f" (at {where})" if where else ""),
                                   None if where else "is it installed, on PYTHONPATH, or "
                                   "in the current folder?")]) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError([Problem(field, f"module {module_name!r} has no {attr!r}",
                                       did_you_mean(part, names))])
        obj = getattr(obj, part)
    return obj
