"""Check and convert one config value against its dataclass field annotation.

YAML and ``--set`` overrides hand us loosely typed values (``3`` for a float, ``[0.9, 0.95]`` for a tuple,
``"3e-4"`` because PyYAML reads exponents without a dot as strings). This module is the single place that
decides which of those are acceptable, so the schema can stay plain dataclasses.
"""

from __future__ import annotations

import math
import os
import typing
from typing import Annotated, Any, Literal, Union

from angel_ptm.config.sizes import show_value
from angel_ptm.errors import ConfigTypeError, ConfigValueError


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Return ``value`` converted to ``annotation``, or raise ConfigTypeError / ConfigValueError naming ``key``."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        # Annotated[T, parser]: the field has its own reader (byte sizes, budgets); see sizes.py.
        _, parser = typing.get_args(annotation)[:2]
        return parser(value, key)
    if origin is Union:
        arms = [arm for arm in typing.get_args(annotation) if arm is not type(None)]
        if len(arms) != 1:
            raise TypeError(f"{key}: unsupported config annotation {annotation!r}")  # a schema bug, not user error
        if value is None:
            return None
        try:
            return coerce(value, arms[0], key)
        except ConfigTypeError:
            raise _type_error(value, annotation, key) from None
    if origin is Literal:
        return _coerce_choice(value, annotation, key)
    if origin is tuple:
        return _coerce_tuple(value, annotation, key)
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        converted = _as_int(value)
        if converted is not None:
            return converted
    elif annotation is float:
        converted = _as_float(value)
        if converted is not None:
            if not math.isfinite(converted):
                raise ConfigValueError(f"{key}: must be a finite number, got {show_value(value)}")
            return converted
    elif annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):  # so callers can pass pathlib.Path for directories
            path = os.fspath(value)
            if isinstance(path, str):
                return path
    else:
        raise TypeError(f"{key}: unsupported config annotation {annotation!r}")
    raise _type_error(value, annotation, key)


def describe(annotation: Any) -> str:
    """How an annotation reads in an error message: ``int``, ``float or null``, ``list of 2 floats``..."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Union:
        arms = [describe(arm) for arm in args if arm is not type(None)]
        return " or ".join(arms) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(_show_choice(choice) for choice in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {describe(args[0])}s"
        if len(set(args)) == 1:
            return f"list of {len(args)} {describe(args[0])}s"
        return "list of [" + ", ".join(describe(arg) for arg in args) + "]"
    if origin is Annotated:
        return describe(args[0])
    return getattr(annotation, "__name__", str(annotation))


def _type_error(value: Any, annotation: Any, key: str) -> ConfigTypeError:
    return ConfigTypeError(
        f"{key}: expected {describe(annotation)}, got {show_value(value)} ({type(value).__name__})"
    )


def _as_int(value: Any) -> int | None:
    """An int, a whole float (3.0) or a string that reads cleanly as one ("12", "1e3"); else None."""
    if isinstance(value, bool):  # bool is an int subclass, but `steps: true` is a mistake
        return None
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            number = _as_float(value)
            return int(number) if number is not None and number.is_integer() else None
    return None


def _as_float(value: Any) -> float | None:
    """A float, an int, or a string that reads cleanly as a number ("3e-4", which YAML leaves a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _coerce_choice(value: Any, annotation: Any, key: str) -> Any:
    # Convert to the choices' own type first, so `staleness: 1.0` matches Literal[0, 1] and a wrong *type*
    # is reported as a type error rather than as "not one of".
    choices = typing.get_args(annotation)
    choice_type = type(choices[0])
    try:
        converted = coerce(value, choice_type, key) if choice_type in (int, float, str) else value
    except ConfigTypeError:
        raise _type_error(value, annotation, key) from None
    if converted not in choices or type(converted) is not choice_type:
        allowed = ", ".join(_show_choice(choice) for choice in choices)
        raise ConfigValueError(f"{key}: must be one of {allowed}, got {show_value(value)}")
    return converted


def _coerce_tuple(value: Any, annotation: Any, key: str) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise _type_error(value, annotation, key)
    args = typing.get_args(annotation)
    if len(args) == 2 and args[1] is Ellipsis:
        item_types = [args[0]] * len(value)
    elif len(value) == len(args):
        item_types = list(args)
    else:
        raise _type_error(value, annotation, key)
    return tuple(coerce(item, item_type, f"{key}[{i}]") for i, (item, item_type) in enumerate(zip(value, item_types)))


def _show_choice(choice: Any) -> str:
    return f'"{choice}"' if isinstance(choice, str) else repr(choice)
