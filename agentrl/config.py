"""Typed configs: dataclasses loaded from YAML, with `key.sub=value` overrides from the command line.

An unknown key or a value of the wrong type is an error that names the key (and the nearest valid one); so are
a key written twice in one YAML mapping, a NaN or infinite number, and a value out of the range its name
implies (RANGES: a learning rate is a learning rate in every section).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from agentrl.errors import UserError

T = TypeVar("T")


class ConfigError(UserError):
    """A config file or override that does not fit the schema."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key written twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node, deep=False):
        first_line = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then overriding a key is not a duplicate
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in first_line:
                    raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} is written twice (first on "
                                      f"line {first_line[key]}); YAML would silently keep the last")
            except TypeError:  # an unhashable key: SafeLoader's own error says so below
                continue
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _load_yaml(text: str):
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


# Ranges by field name, checked wherever a config gives the field (not its default). One vocabulary: these
# names mean the same in every section (ppo, grpo, dpo, sft, rollout, model, reward-model, the job itself).
# None stays allowed where the field's type allows it ("off" / "same as learning_rate").
RANGES: dict[str, tuple[typing.Callable[[float], bool], str]] = {
    **{name: (lambda x: x > 0, "must be > 0") for name in (
        "learning_rate", "norm_learning_rate", "value_learning_rate", "temperature")},
    **{name: (lambda x: x >= 1, "must be >= 1") for name in (
        "max_new_tokens", "keep_checkpoints", "sample_every", "lora_r", "lora_alpha", "max_context",
        "max_observation_tokens", "hidden_size", "num_layers", "num_heads", "intermediate_size",
        "max_position_embeddings", "vocab_size")},
    **{name: (lambda x: x >= 0, "must be >= 0") for name in (
        "steps", "top_k", "checkpoint_every", "samples_per_step", "max_nonfinite_steps", "step_timeout",
        "weight_decay", "warmup_steps")},
    # Negative: clip_grad_norm_ flips every gradient (ascent). 0 is "off", as in transformers' Trainer.
    "max_grad_norm": (lambda x: x >= 0, "must be >= 0 (0 or null: no clipping)"),
    "adam_eps": (lambda x: x > 0, "must be > 0"),
    **{name: (lambda x: 0 <= x < 2 ** 32, "must be in [0, 2**32)") for name in ("seed", "eval_seed")},
    # empty: the job would write, and a fresh start delete, ./checkpoints of the working directory
    "out_dir": (lambda x: bool(x.strip()), "must name a directory"),
    "top_p": (lambda x: 0 < x <= 1, "must be in (0, 1]"),
    "lora_dropout": (lambda x: 0 <= x < 1, "must be in [0, 1)"),
}


def _nearest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(sorted(options))})"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {tp}")
    if origin is Literal:
        if isinstance(value, bool) and ("yes" if value else "no") in args:
            return "yes" if value else "no"  # YAML 1.1 reads a bare no/off as False and yes/on as True
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {type(value).__name__}")
        return from_dict(tp, value, prefix=f"{where}.")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return origin(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp in _PLAIN:
        fits, wanted = _PLAIN[tp]
        if not fits(value):
            raise ConfigError(f"{where}: expected {wanted}, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):  # YAML reads .nan / .inf, and float() above "nan" / "inf"
            raise ConfigError(f"{where}: must be a finite number, got {value!r}")
        return float(value)
    return value


# Types whose values are taken as they are, once of the right type: (the check, what the error says was expected).
_PLAIN = {bool: (lambda v: isinstance(v, bool), "true or false"),
          int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),  # True is an int in Python
          str: (lambda v: isinstance(v, str), "a string")}


def from_dict(cls: type[T], data: dict, prefix: str = "") -> T:
    """Build dataclass `cls` from a (nested) mapping, checking every key and type."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"config key {prefix}{key!r}: keys are names, not {type(key).__name__}s")
        if key not in fields:
            raise ConfigError(f"unknown config key {prefix + key!r}{_nearest(key, list(fields))}")
        kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}")
        if key in RANGES and isinstance(kwargs[key], (int, float, str)) and not isinstance(kwargs[key], bool):
            within, rule = RANGES[key]
            if not within(kwargs[key]):
                raise ConfigError(f"{prefix}{key}: {rule}, got {kwargs[key]!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        # __post_init__ messages start with the field's name: "beta: must be > 0" -> "dpo.beta: must be > 0"
        raise ConfigError(f"{prefix}{e}" if prefix else f"{cls.__name__}: {e}") from e


def to_dict(config: Any) -> dict:
    return dataclasses.asdict(config)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` strings (values parsed as YAML: `3`, `1e-3`, `true`, `[q_proj, v_proj]`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        try:
            node[parts[-1]] = _load_yaml(raw) if raw else ""
        except ConfigError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: not valid YAML ({' '.join(str(e).split())})") from None
        except ValueError as e:  # an integer past int_max_str_digits
            key, problem = item.partition("=")[0], str(e).split(";")[0]
            raise ConfigError(f"override {key}=...: a value Python will not read ({problem})") from None
    return data


MAX_CONFIG_VALUES = 100_000  # a config file expands to far fewer; aliases nested 9 deep expand to a billion


def _too_many_values(data) -> bool:
    """Whether `data`, walked as the config code will copy it (aliases expanded), holds too many values: counted
    up to the bound, so the walk itself stays short."""
    count, stack = 0, [data]
    while stack:
        value = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            return True
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def _kind_of(path: Path) -> str:
    import stat

    mode = path.stat().st_mode
    return ("a directory" if stat.S_ISDIR(mode) else "a pipe" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
                command: dict | None = None, defaults: dict | None = None) -> T:
    """Load `cls` from a YAML file (or its defaults when `path` is None) and apply overrides.

    command: top-level keys the command itself sets (`agentrl grpo`: {"algo": "grpo"}); the file or an override
    giving another value is an error, not silently one or the other.
    defaults: top-level values the command uses where the file sets none (before the overrides).
    """
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        if not path.is_file():  # reading a directory fails, and a device or a pipe may never end
            raise ConfigError(f"config file {path} is {_kind_of(path)}, not a YAML file")
        try:
            data = _load_yaml(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r})") from None
        except RecursionError:
            raise ConfigError(f"{path}: a YAML alias refers to itself (a recursive structure)") from None
        except ConfigError as e:  # a duplicate key: "<file>:<line>: key ... is written twice"
            raise ConfigError(f"{path}:{str(e).removeprefix('line ')}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from e
        except ValueError as e:  # an integer past int_max_str_digits
            raise ConfigError(f"{path}: a value Python will not read ({str(e).split(';')[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of config keys")
        if _too_many_values(data):
            raise ConfigError(f"{path}: more than {MAX_CONFIG_VALUES:,} values once its YAML aliases are expanded "
                              f"(an alias bomb?)")
    data = apply_overrides({**(defaults or {}), **data}, overrides or [])
    for key, value in (command or {}).items():
        if data.get(key, value) != value:
            overridden = any(o.startswith(f"{key}=") for o in overrides or [])
            source = "an override" if overridden else f"{path or 'the config'}"
            raise ConfigError(f"{key}: {data[key]!r} (from {source}) contradicts the command, which runs {value!r}; "
                              f"drop {key}, or run `agentrl {data[key]} ...`")
        data[key] = value
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        # A value from the command line is not the file's: name the file only for what it holds.
        overridden = {o.partition("=")[0] for o in overrides or []}
        from_override = any(str(e).startswith((f"{k}:", f"{k} ")) for k in overridden)
        raise ConfigError(f"{path}: {e}" if path and not from_override else str(e)) from None
