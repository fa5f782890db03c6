"""The ``"package.module:name"`` targets a config names (a model class, a ``map`` step's
function): the one place csrun imports a module by a name it did not write itself.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .problems import ConfigError, Problem, did_you_mean
from .user_code import ensure_cwd_importable, user_location, user_problem

__all__ = ["import_object", "lookup_class", "parameters_hint"]


def import_object(target: str, field: str) -> Any:
    """Import ``"package.module:name"``; the current folder is searched first, as with
    ``python -m`` (then the config file's folder: :func:`import_beside_config`).

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
    except SystemExit as exc:  # sys.exit/argparse at module level: the config names it
        raise ConfigError([user_problem(field, f"importing module {module_name!r}", exc)]
                          ) from None
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        where = user_location(exc)  # an error inside the module, not a missing one
        raise ConfigError([Problem(field, f"cannot import module {module_name!r}: "
                                   f"{type(exc).__name__}: {exc}" +
                                   (f" (at {where})" if where else ""),
                                   None if where else "is it installed, on PYTHONPATH, in "
                                   "the current folder or in the config file's folder?")]
                          ) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError([Problem(field, f"module {module_name!r} has no {attr!r}",
                                       did_you_mean(part, names))])
        obj = getattr(obj, part)
    return obj


def lookup_class(module: Any, name: str, names: list[str], field: str, what: str) -> Any:
    """``module.<name>``, one of ``names`` (e.g. a ``torch.optim`` class).

    Raises:
      ConfigError: at ``field``, with a did-you-mean or the list of names.
    """
    if name not in names:
        raise ConfigError([Problem(field, f"{name!r} is not a {what}",
                                   did_you_mean(name, names) or f"one of: {', '.join(names)}")])
    return getattr(module, name)


def parameters_hint(cls: type, skip: set) -> str | None:
    """``"Class takes: a, b"``: the hint for keyword arguments a class refused."""
    try:
        names = [n for n in inspect.signature(cls).parameters if n not in skip]
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return None
    return f"{cls.__name__} takes: {', '.join(names)}" if names else None
