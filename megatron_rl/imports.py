"""Objects named by a flag as an import path `module:attribute` (a user's rollout function,
policy loss, environment, tool ...): imported, and every failure a ValueError naming the flag;
and the settings a flag passes to such an object as keyword arguments, checked against its
signature.

Pure standard library, so that the RL maths (loss.py) may use it.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Iterable, Mapping


def is_import_path(value: str) -> bool:
    """Whether `value` has the form `module:attribute` (both parts non-empty)."""
    module_name, sep, attr = value.partition(":")
    return bool(sep and module_name and attr)


def import_object(path: str, flag: str, kind: str, built_ins: Iterable[str],
                  form: str = "function") -> Any:
    """The object that `path` = `module:attribute` names (the attribute may be an attribute
    path: `module:Class.method`), imported. `flag` (e.g. "--policy-loss 'x'") starts every
    error; `kind` and `built_ins` name what else the flag takes, for the error of a value that
    is not an import path; `form` what the attribute is to be ("function", "class or
    function"). Raises ValueError when `path` is not `module:attribute`, does not import or
    lacks the attribute."""
    if not is_import_path(path):
        raise ValueError(f"{flag}: neither a built-in {kind} (" + ", ".join(built_ins)
                         + f") nor an import path `module:{form.split()[0]}`")
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # the module is the user's: any error in it is a configuration one
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0]:
            hint = ("; is the directory that holds it on PYTHONPATH? (`megatron-rl` does not "
                    "search the working directory)")
        raise ValueError(f"{flag}: cannot import module {module_name!r} ({type(e).__name__}: "
                         f"{e}){hint}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{flag}: {getattr(obj, '__name__', module_name)!r} has no "
                             f"attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def import_callable(path: str, flag: str, kind: str, built_ins: Iterable[str],
                    form: str = "function") -> Any:
    """import_object's callable: also a ValueError where `path` names something not
    callable."""
    obj = import_object(path, flag, kind, built_ins, form)
    if not callable(obj):
        module_name, _, attr = path.partition(":")
        raise ValueError(f"{flag}: {attr!r} in {module_name!r} is a {type(obj).__name__}, not "
                         f"a {form}")
    return obj


def check_arguments(fn: Callable[..., Any], args: Mapping[str, Any], flag: str,
                    what: str) -> None:
    """Raise ValueError, naming `flag` and the parameter, unless `fn(**args)` binds to `fn`'s
    signature (every key a parameter it takes by keyword, every required parameter given).
    `what` names `fn` in the message. A callable without a signature Python can read (some
    built-ins) is not checked."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = signature.parameters.values()
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    listed = f"(its keyword parameters: {', '.join(takes) or 'none'})"
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = [key for key in args if key not in takes]
        if unknown:
            raise ValueError(f"{flag}: {what} has no parameter "
                             + ", ".join(map(repr, unknown)) + f" {listed}")
    try:
        signature.bind(**args)
    except TypeError as e:
        raise ValueError(f"{flag}: {what} cannot take these settings: {e} {listed}") from None
