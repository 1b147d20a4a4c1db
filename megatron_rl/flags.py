"""Settings dataclasses as flags and YAML: the flat namespace over grouped dataclasses
(config.py's TrainConfig, agent/settings.py's AgentConfig), declared once in their fields.

A field's flag is `--<field-name>` with '_' -> '-', prefixed by its group's `prefix` metadata or
renamed by its `flag` metadata (`walk`); its help text, "choices" and bounds come from its
metadata (`add_flags`, checked by `check_declared`). A config file (YAML, or a run's
config.json: `read_config_file`, a UTF-8 byte-order mark skipped) holds the same names with
'-' -> '_', each value coerced to the field's type (`file_settings`). `from_flags` and `build`
make the dataclass from flat values; `flag_fields` and `to_flat_dict` give the flat form back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import operator
import typing
import warnings
from typing import Any

import yaml

from megatron_rl.data.records import not_utf8
from megatron_rl.errors import ConfigError

# -- the flat namespace over the groups -------------------------------------------------------

def walk(cls, path: tuple = (), prefix: str = ""):
    """(flat name, field path, type, metadata) for every leaf field under dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from walk(kind, path + (f.name,), prefix + f.metadata.get("prefix", ""))
            continue
        name = f.metadata.get("flag", prefix + f.name)
        meta = dict(f.metadata)
        yield name, path + (f.name,), kind, meta


# The bounds a field's metadata may declare: (key, comparison, how a message says it).
_BOUNDS = (("min", operator.ge, ">="), ("gt", operator.gt, ">"),
           ("max", operator.le, "<="), ("lt", operator.lt, "<"))


def check_declared(obj, cls) -> None:
    """Raise ValueError naming the flag where a field of `obj` (a `cls`) is outside its
    declared choices or bounds, or is a float that is NaN or infinite (infinite is allowed
    where the field declares "inf": True, as --clip-high does for "no upper clip"). YAML's
    `.nan` and `.inf` and the command line's `nan` and `inf` are floats like any other, and a
    NaN passes every comparison a check might make (nan < 0 is False), so they are refused here
    rather than by each group's rules, before any model is built."""
    for name, path, _, meta in walk(cls):
        value = value_at(obj, path)
        if value is None:
            continue
        if "choices" in meta and value not in meta["choices"]:
            raise ValueError(f"{flag_name(name)} {value!r}; valid: " + ", ".join(meta["choices"]))
        for item in value if isinstance(value, list) else [value]:
            _check_number(flag_name(name), item, meta)


def _check_number(flag: str, value: Any, meta: dict) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    bounds = " and ".join(f"{says} {meta[key]}" for key, _, says in _BOUNDS if key in meta)
    if isinstance(value, float) and (math.isnan(value)
                                     or (math.isinf(value) and not meta.get("inf"))):
        allowed = " (or inf)" if meta.get("inf") else ""
        raise ValueError(f"{flag} {value}: must be a finite number" + (f" {bounds}" if bounds
                                                                         else "") + allowed)
    if not all(holds(value, meta[key]) for key, holds, _ in _BOUNDS if key in meta):
        raise ValueError(f"{flag} {value}: must be {bounds}")


def add_flags(parser: argparse.ArgumentParser, cls, only=None, top: str | None = None) -> None:
    """The fields of the settings dataclass `cls` (e.g. agent.settings.AgentConfig, or
    TrainConfig) as flags of `parser`, as `megatron-rl train` declares them (help, choices,
    default). `only`: the flat names of the fields to declare (default: all); a group of `cls`
    (TrainConfig's "rollout") is an argument group, the fields of `cls` itself one titled `top`
    (default: the class's name)."""
    groups: dict[str, Any] = {}
    defaults = cls()
    for name, path, kind, meta in walk(cls):
        if only is not None and name not in only:
            continue
        title = path[0] if len(path) > 1 else top or cls.__name__
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        groups[title].add_argument(flag_name(name), **_argparse_kwargs(name, kind, meta,
                                                                   value_at(defaults, path)))


def from_flags(cls, namespace: argparse.Namespace, **checks):
    """The `cls` that `add_flags`' flags in `namespace` give (defaults for those not given),
    checked (declared choices and bounds, then its own `validate(**checks)`): ConfigError
    naming the flag."""
    obj = build(cls, {path: getattr(namespace, name) for name, path, _, _ in walk(cls)
                       if hasattr(namespace, name)})
    try:
        check_declared(obj, cls)
        if hasattr(obj, "validate"):
            obj.validate(**checks)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return obj


def flag_fields(cls) -> dict[str, tuple[tuple[str, ...], Any]]:
    """{flat name (YAML key; flag with '_' -> '-'): (path of attributes in settings dataclass
    `cls`, e.g. TrainConfig, type)}."""
    out = {}
    for name, path, kind, _ in walk(cls):
        if name in out:
            raise TypeError(f"flag --{name} declared twice: {out[name][0]} and {path}")
        out[name] = (path, kind)
    return out


def value_at(obj, path):
    """The field of `obj` at `path` (attribute names, outermost first)."""
    for p in path:
        obj = getattr(obj, p)
    return obj


def build(cls, values: dict[tuple, Any], path: tuple = ()):
    """An instance of dataclass `cls` from {field path: value} (absent: the field's default)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        p = path + (f.name,)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], values, p)
        elif p in values:
            kwargs[f.name] = values[p]
    return cls(**kwargs)


def to_flat_dict(cfg) -> dict[str, Any]:
    """{flat name: value}: the YAML form of settings `cfg` (a TrainConfig)."""
    return {name: value_at(cfg, path) for name, (path, _) in flag_fields(type(cfg)).items()}


def flag_name(name: str) -> str:
    """The flag of flat setting `name`: `--` and '_' -> '-'."""
    return "--" + name.replace("_", "-")


def _argparse_kwargs(name: str, kind, meta: dict, default) -> dict[str, Any]:
    kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS,
                          "help": _help_text(meta, default)}
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = args[0] if args and typing.get_origin(kind) is not list else kind
    if base is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is dict:
        kw["type"] = _json_object
        kw["metavar"] = "JSON"
    elif typing.get_origin(kind) is list:
        kw["nargs"] = "+"
        if typing.get_args(kind) in ((int,), (float,)):
            kw["type"] = typing.get_args(kind)[0]
    elif base in (int, float):
        kw["type"] = base
    if "choices" in meta:
        kw["choices"] = list(meta["choices"])
    return kw


def _json_object(text: str) -> dict[str, Any]:
    """A dict-typed flag's value: a JSON object (argparse names the flag in the error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object ({{\"name\": value, ...}}) is needed, "
                                         f"not a {type(value).__name__}")
    return value


def _help_text(meta: dict, default) -> str:
    """The field's help followed by its default, escaped for argparse's %-formatting."""
    if default is None or default == "" or default == [] or default == {}:
        shown = "unset"
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    else:
        shown = str(default)
    text = meta.get("help", "")
    return (f"{text} (default: {shown})" if text else f"default: {shown}").replace("%", "%%")


def _coerce(value: Any, kind, key: str, source: str) -> Any:
    """A config file's `value` for the field `key` of type `kind`, as that type.

    YAML and JSON give numbers PyYAML reads as strings (`3e-4`, `1e-08`: YAML 1.1 floats need a
    dot) or quoted ones (`"5"`); such a string becomes the declared int or float. A lone value
    for a list field becomes a one-element list. Anything that is not the declared type raises
    ValueError naming the key and the file. null is None for an optional setting and the empty
    list for a list."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is dict:
        return _coerce_mapping(value, key, source)
    if typing.get_origin(kind) is list:
        elem = typing.get_args(kind)[0]
        items = [] if value is None else value if isinstance(value, list) else [value]
        return [_coerce(v, elem, key, source) for v in items]
    if value is None:
        if type(None) in typing.get_args(kind):
            return None
        raise ValueError(f"{source}: {key}: null, but the setting needs a value")
    base = args[0] if args else kind
    name = getattr(base, "__name__", str(base))

    def refuse() -> ValueError:
        return ValueError(f"{source}: {key}: {value!r} is not {name} (the type of {flag_name(key)})")

    if base is bool:
        if isinstance(value, bool):
            return value
        raise refuse()
    if base in (int, float):
        if isinstance(value, bool):
            raise refuse()
        if isinstance(value, str):
            try:
                value = base(value.strip())
            except ValueError:
                raise refuse() from None
        if base is float and isinstance(value, int):
            return float(value)
        if isinstance(value, float) and base is int:
            if not value.is_integer():
                raise refuse()
            return int(value)
        if not isinstance(value, base):
            raise refuse()
        return value
    if base is str and not isinstance(value, str):
        raise refuse()
    return value


def _coerce_mapping(value: Any, key: str, source: str) -> dict[str, Any]:
    """A config file's value for a mapping setting (--agent-env-args ...): a mapping with
    string keys whose values JSON can hold (the run's config.json keeps it), or a string
    holding a JSON object, as the flag takes it; null is the empty mapping."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: {key}: not valid JSON ({e}); a mapping is needed") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{source}: {key}: {value!r} is not a mapping of names to values (the "
                         f"type of {flag_name(key)})")
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {key}: a value JSON cannot hold ({e})") from None


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping of settings a --config file holds (YAML, or a run's config.json). A UTF-8
    byte-order mark at its start is skipped; a file that cannot be read, is not UTF-8 (the line
    named), is not YAML (the line and column named) or is not a mapping raises ConfigError."""
    try:
        with open(path, encoding="utf-8-sig") as fh:
            loaded = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {not_utf8(path, e)}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: not a mapping of setting names (the flags' names, '-' -> "
                          f"'_') to values, but a {type(loaded).__name__}")
    return loaded


def file_settings(path: str, cls, ignored: frozenset[str] = frozenset()) -> dict[str, Any]:
    """{flat name: value} of the settings of dataclass `cls` that config file `path` holds
    (read_config_file), each coerced to its field's type. Keys in `ignored` (no setting reads
    them) are dropped with a warning; any other key that names no setting raises ValueError
    naming the file and the valid keys."""
    fields = flag_fields(cls)
    loaded = read_config_file(path)
    dropped = sorted(set(loaded) & ignored)
    if dropped:
        warnings.warn(f"{path}: ignoring {dropped}: no setting reads them")
        loaded = {k: v for k, v in loaded.items() if k not in ignored}
    unknown = sorted(set(loaded) - set(fields))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; valid: {sorted(fields)}")
    return {k: _coerce(v, fields[k][1], k, path) for k, v in loaded.items()}
