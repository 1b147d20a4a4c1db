"""Objects named by a flag as an import path `module:attribute` (a user's rollout function,
policy loss, ...): imported, and every failure a ValueError naming the flag.

Pure standard library, so that the RL maths (loss.py) may use it.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable


def import_callable(path: str, flag: str, kind: str, built_ins: Iterable[str],
                    form: str = "function") -> Any:
    """The callable that `path` = `module:function` names (the function may be an attribute
    path: `module:Class.method`), imported. `flag` (e.g. "--policy-loss 'x'") starts every
    error; `kind` and `built_ins` name what else the flag takes, for the error of a value that
    is not an import path; `form` what the attribute is to be ("function", "class or
    function"). Raises ValueError when `path` is not `module:attribute`, does not import,
    lacks the attribute or names something not callable."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{flag}: neither a built-in {kind} (" + ", ".join(built_ins)
                         + f") nor an import path `module:{form.split()[0]}`")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # the module is the user's: any error in it is a configuration one
        raise ValueError(f"{flag}: cannot import module {module_name!r} ({type(e).__name__}: "
                         f"{e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{flag}: {getattr(obj, '__name__', module_name)!r} has no "
                             f"attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{flag}: {attr!r} in {module_name!r} is a {type(obj).__name__}, not "
                         f"a {form}")
    return obj
