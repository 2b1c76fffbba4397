"""Build a Config from defaults, a dict or a YAML file, plus ``--set section.field=value`` overrides.

The raw settings are a plain nested dict until the very end: overrides are merged into it, unknown keys are
rejected with a suggestion, and only then are the section dataclasses constructed (which type-check and
validate every field).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, Tuple, Union

import yaml

from angel_ptm.config.schema import MAPPING_FIELDS, Config, field_types, section_classes
from angel_ptm.config.sizes import show_value
from angel_ptm.errors import ConfigError, ConfigTypeError, UnknownKeyError

ConfigSource = Union[None, Mapping, str, os.PathLike, Config]


def load_config(source: ConfigSource = None, overrides: Iterable[str] = ()) -> Config:
    """Return a validated Config.

    ``source`` is None (all defaults), a nested dict, the path of a YAML file, or a Config. ``overrides`` are
    strings like ``"optimizer.lr=3e-4"`` applied in order on top of the source; values are read as YAML.
    """
    if isinstance(overrides, str):  # a lone "a.b=c" would otherwise be iterated character by character
        overrides = (overrides,)
    raw = _read_source(source)
    for override in overrides:
        _apply_override(raw, override)
    config = _build_config(raw)
    if isinstance(source, Config):  # every section is in its dict: what was spelled out is what the source says
        given = getattr(source, "given_sections", None)
        overridden = {str(o).split(".", 1)[0] for o in overrides}
        config.given_sections = None if given is None else given | overridden
    return config


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The Config as plain YAML-serialisable data (tuples become lists); ``load_config`` reads it back equal."""
    if not isinstance(cfg, Config):
        raise TypeError(f"config_to_dict expects a Config, got {type(cfg).__name__}")
    sections = {name: getattr(cfg, name) for name in section_classes()}
    return {
        name: {f.name: _plain(getattr(section, f.name)) for f in dataclasses.fields(section)}
        for name, section in sections.items()
    }


def with_absolute_paths(cfg: Config) -> Config:
    """The config with its relative paths (data.path, checkpoint.dir, memory.disk_dir, run.dir, run.resume) made
    absolute from the current directory, as they are read: a run's config.yaml then resumes from anywhere."""
    def absolute(value: Optional[str], keep: tuple = ()) -> Optional[str]:
        return value if value is None or value in keep else str(Path(value).expanduser().absolute())

    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, path=absolute(cfg.data.path)),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=absolute(cfg.checkpoint.dir)),
        memory=dataclasses.replace(cfg.memory, disk_dir=absolute(cfg.memory.disk_dir)),
        run=dataclasses.replace(cfg.run, dir=absolute(cfg.run.dir), resume=absolute(cfg.run.resume, ("auto",))))


def save_config(cfg: Config, path: Union[str, os.PathLike]) -> None:
    """Write the Config as YAML, atomically: a reader (or a crash) sees the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.dump(config_to_dict(cfg), Dumper=_ConfigDumper, sort_keys=False)
    # The temporary file must live in the same directory: os.replace is only atomic within one filesystem.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes files private (0600); a config is meant to be read by others
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())  # data on disk before the rename makes it visible
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


class _ConfigDumper(yaml.SafeDumper):
    """Sections in block style, one field per line; short lists (betas) inline as `[0.9, 0.95]`."""


_ConfigDumper.add_representer(
    list, lambda dumper, value: dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=True)
)


# --- reading sources ------------------------------------------------------------------------------------------
def _read_source(source: ConfigSource) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Config):
        return config_to_dict(source)
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))  # overrides are merged in place; never touch the caller's dict
    if isinstance(source, (str, os.PathLike)):
        return _read_yaml_file(Path(source))
    raise ConfigTypeError(
        f"config source: expected None, a dict, a YAML path or a Config, got {show_value(source)} "
        f"({type(source).__name__})"
    )


def _read_yaml_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: invalid YAML{_yaml_location(exc)}") from None
    if data is None:  # an empty file (or only comments) means "all defaults"
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections at the top, got {type(data).__name__}")
    return data


def _yaml_location(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return where + (f": {problem}" if problem else "")


# --- overrides ------------------------------------------------------------------------------------------------
def _apply_override(raw: dict[str, Any], override: str) -> None:
    if not isinstance(override, str):
        raise ConfigTypeError(f"override: expected a string like 'optimizer.lr=3e-4', got {show_value(override)}")
    key, sep, value_text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected SECTION.FIELD=VALUE, e.g. optimizer.lr=3e-4")
    section, dot, name = key.partition(".")
    name = ALIASES.get(section, {}).get(name, name)
    if not dot:
        if section in section_classes():
            raise ConfigError(f"override {override!r}: name a field of {section}, e.g. {_field_keys(section)[0]}=...")
        raise _unknown_key(key)
    name, _, sub = name.partition(".")  # model.moe.experts: a key inside a mapping-valued field
    if section not in section_classes() or name not in field_types(section_classes()[section]):
        raise _unknown_key(key)
    if sub and field_types(section_classes()[section])[name] not in MAPPING_FIELDS:
        raise _unknown_key(key)
    try:
        value = yaml.safe_load(value_text)
    except yaml.YAMLError as exc:
        value = _patterns_list(section, name, value_text)  # `[*.bias]`: YAML reads `*` as an alias
        if value is None:
            raise ConfigError(f"override {override!r}: value is not valid YAML{_yaml_location(exc)}") from None
    if _is_text_field(section, name) and isinstance(value, (bool, int, float)):
        # `--set run.name=2024` means the text "2024", not a number YAML happened to see in it.
        value = value_text.strip()
    if sub:
        settings = _section_settings(raw, section)
        if not isinstance(settings.get(name), dict):
            settings[name] = {}
        settings[name][sub] = value
        return
    _section_settings(raw, section)[name] = value


def _patterns_list(section: str, name: str, text: str) -> list[str] | None:
    """`[*.bias, norm*]` for a field of text patterns (optimizer.no_decay), which YAML refuses (a leading `*` names
    an alias): the bracketed items as plain text, each unquoted; None for any other field or shape."""
    if field_types(section_classes()[section])[name] != Tuple[str, ...]:
        return None
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")) or any(c in text[1:-1] for c in "[]{}"):
        return None
    items = [item.strip().strip("'\"") for item in text[1:-1].split(",")]
    return [item for item in items if item]


def _is_text_field(section: str, name: str) -> bool:
    annotation = field_types(section_classes()[section])[name]
    return annotation in (str, Optional[str])


# --- building -------------------------------------------------------------------------------------------------
def _build_config(raw: Mapping[str, Any]) -> Config:
    empty = {section for section, settings in raw.items() if settings is None}  # `lr_schedule: null`, `memory:`
    # Check every key before constructing anything, so a typo is reported ahead of any value it hides.
    for section in raw:
        if section not in section_classes():
            raise _unknown_key(str(section))
        settings = _section_settings(raw, section)
        for alias, name in ALIASES.get(section, {}).items():
            if alias in settings:
                if name in settings:
                    raise ConfigError(f"{section}.{alias} and {section}.{name} are the same key: give one")
                settings[name] = settings.pop(alias)
        for name in settings:
            if name not in field_types(section_classes()[section]):
                raise _unknown_key(f"{section}.{name}")
    sections = {
        section: section_class(**_section_settings(raw, section))
        for section, section_class in section_classes().items()
        if section in raw
    }
    config = Config(**sections)
    # what the source spelled out (the engine's lr_schedule rule); `lr_schedule: null` spells out nothing
    config.given_sections = frozenset(section for section in sections if section not in empty)
    return config


# Other spellings of a key: `checkpoint.async` (the name users know from torch's async_save) is `async_save`, which
# a Python field can be named.
ALIASES = {"checkpoint": {"async": "async_save"}}


def _section_settings(raw: Any, section: str) -> dict[str, Any]:
    """The settings dict of one section, created if absent (``memory:`` with nothing under it reads as None)."""
    settings = raw.get(section)
    if settings is None:
        settings = raw[section] = {}
    if not isinstance(settings, Mapping):
        raise ConfigTypeError(
            f"{section}: expected a mapping of settings, got {show_value(settings)} ({type(settings).__name__})"
        )
    return settings


# --- unknown keys ---------------------------------------------------------------------------------------------
def _field_keys(section: str) -> list[str]:
    return [f"{section}.{name}" for name in field_types(section_classes()[section])]


def _all_keys() -> list[str]:
    return list(section_classes()) + [key for section in section_classes() for key in _field_keys(section)]


def _unknown_key(key: str) -> UnknownKeyError:
    message = f"unknown config key '{key}'"
    suggestions = _suggest(key)
    if suggestions:
        return UnknownKeyError(f"{message} (did you mean {' or '.join(suggestions)}?)")
    section = key.partition(".")[0]
    if section in section_classes():
        names = ", ".join(key.partition(".")[2] for key in _field_keys(section))
        return UnknownKeyError(f"{message} (valid keys in {section}: {names})")
    return UnknownKeyError(f"{message} (valid sections: {', '.join(section_classes())})")


def _suggest(key: str) -> list[str]:
    valid = _all_keys()
    section, _, name = key.rpartition(".")
    # A right name in the wrong place (`host_budget` at the top, `memory.lr`): point to where it belongs.
    misplaced = [candidate for candidate in valid if candidate.rpartition(".")[2] == name and candidate != key]
    if misplaced:
        return misplaced
    if section in section_classes():
        # Compare field names alone: a shared "optimizer." prefix would make any two keys look alike.
        close = difflib.get_close_matches(name, list(field_types(section_classes()[section])), n=1, cutoff=0.6)
        if close:
            return [f"{section}.{close[0]}"]
    else:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)  # `memroy`, `memroy.page_bytes`
        if close:
            return close
    # A misspelled name in the wrong place (`host_budgt` at the top): look in every section.
    field_names = sorted({candidate.rpartition(".")[2] for candidate in valid if "." in candidate})
    close_names = difflib.get_close_matches(name, field_names, n=1, cutoff=0.75)
    return [candidate for candidate in valid if "." in candidate and candidate.rpartition(".")[2] in close_names]


# --- small helpers --------------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    return [_plain(item) for item in value] if isinstance(value, (tuple, list)) else value


def _fsync_directory(directory: Path) -> None:
    """Persist the rename itself; not every platform can open a directory, and losing this is only a delay."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
