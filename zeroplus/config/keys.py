"""Strict key checking for DeepSpeed-style config dicts.

Pydantic's ``extra="forbid"`` says *that* a key is wrong; this pass says *where* (the dotted
path), *what was probably meant* (the nearest valid key), and separates DeepSpeed keys that
zeroplus knows but does not implement yet (collected for one warning) from true typos (errors).
It runs before pydantic validation and only reads the dict.
"""
from __future__ import annotations

import difflib
import logging
import typing
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger("zeroplus.config")


class ConfigError(ValueError):
    """A user config that cannot be accepted; the message names the key path and the value."""


def expand_dotted(data: dict[str, Any], path: str = "") -> None:
    """Read each dotted key (``"zero_optimization.reduce_bucket_size": v``, as TRL writes for its reference
    model) as the nested key it names, in place: its writer means that key, so it replaces a nested
    value already there (logged). DeepSpeed ignores such keys; a dotted key that names no valid key is
    then an unknown key like any other (``check_keys``). A dotted key whose prefix is not an object
    (``"fp16.enabled"`` beside ``"fp16": true``) is a ``ConfigError`` naming both."""
    for key in [k for k in list(data) if isinstance(k, str) and "." in k]:
        value = data.pop(key)
        *parents, leaf = key.split(".")
        node, where = data, path
        for part in parents:
            where = f"{where}.{part}" if where else part
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"config key '{(path + '.') if path else ''}{key}' (value {value!r}) names a key "
                                  f"inside '{where}', which is {child!r}, not an object")
            node = child
        full = f"{where}.{leaf}"
        if leaf in node and node[leaf] != value:
            logger.info("config key '%s' given as a dotted key (%r) replaces %r", full, value, node[leaf])
        node[leaf] = value
    for key, value in data.items():
        if isinstance(value, dict):
            expand_dotted(value, f"{path}.{key}" if path else str(key))


def allowed_keys(model: type[BaseModel]) -> dict[str, str]:
    """Map every accepted spelling (field name and alias) to the field name."""
    keys: dict[str, str] = {}
    for name, field in model.model_fields.items():
        keys[name] = name
        if field.alias:
            keys[field.alias] = name
        extras = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        aliases = extras.get("aliases")
        for extra in aliases if isinstance(aliases, list) else []:
            keys[str(extra)] = name
    return keys


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside ``X | None`` (or ``X``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def check_keys(data: dict[str, Any], model: type[BaseModel], path: str, unimplemented: list[str]) -> None:
    """Raise one ``ConfigError`` listing every unknown key under ``path`` (each with its "did you mean");
    pop known-but-unimplemented keys.

    Unimplemented DeepSpeed keys are removed from ``data`` in place and their dotted paths appended
    to ``unimplemented`` so the caller can warn once about all of them.
    """
    unknown: list[str] = []
    _check_keys(data, model, path, unimplemented, unknown)
    if len(unknown) == 1:
        raise ConfigError(unknown[0])
    if unknown:
        raise ConfigError(f"{len(unknown)} unknown config keys:\n  " + "\n  ".join(unknown))


def _check_keys(data: dict[str, Any], model: type[BaseModel], path: str, unimplemented: list[str],
                unknown: list[str]) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{path or '<root>'}' must be an object, got {type(data).__name__}: {data!r}")
    keys = allowed_keys(model)
    known_unimplemented: frozenset[str] = getattr(model, "ds_unimplemented", frozenset())
    for key in list(data):
        where = f"{path}.{key}" if path else key
        if key in keys:
            field_key = keys[key]
            alias = model.model_fields[field_key].alias or field_key
            if key not in (field_key, alias):  # an extra spelling: store it under the field's own key
                data[alias] = data.pop(key)
                key = alias
            sub = _nested_model(model.model_fields[field_key].annotation)
            if sub is not None and data[key] is not None:
                _check_keys(data[key], sub, where, unimplemented, unknown)
            continue
        if key in known_unimplemented:
            unimplemented.append(where)
            data.pop(key)
            continue
        candidates = sorted(set(keys) | set(known_unimplemented))
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        hint = f"; did you mean '{(path + '.') if path else ''}{close[0]}'?" if close else ""
        level = f"'{path}'" if path else "the top level"
        unknown.append(f"unknown config key '{where}' (value {data[key]!r}) at {level}{hint}")
