"""Node configuration: TOML -> attrs classes via cattrs, with errors that name the key.

    @attrs.frozen
    class Serial: ...
    @attrs.frozen
    class Pipelined:
        max_batch_size: int = 32
        batching: Literal["uniform-lsn", "scattered-lsn"] = "uniform-lsn"
    Pipelining = Serial | Pipelined

    @attrs.frozen
    class PageserverConfig:
        listen_pg_addr: str = "127.0.0.1:64000"
        page_service_pipelining: Pipelining = Serial()

    converter = make_converter()
    register_tagged_union(converter, Pipelining, tag="mode",
                          classes={"serial": Serial, "pipelined": Pipelined})
    cfg = load_config(PageserverConfig, Path("pageserver.toml"), converter=converter)

Rules: unknown keys are refused (``forbid_extra_keys``); primitives are strict (``"12"`` is
not an int, ``1`` is not a string, ``true`` is not a number); ``Literal`` values are checked;
nested attrs classes, lists and dicts work. A key the program no longer has can be named in
``removed`` (key -> what to do instead): a file that still sets it is refused with that text
rather than a bare "unknown key", so an upgrade says why. Every problem becomes one line of
``ConfigError.errors`` shaped ``key.path: what is wrong`` (for example
``page_service_pipelining.max_batch_size: expected an integer, got 'x'``), and
``str(ConfigError)`` lists them all. ``dump_config`` writes TOML back (the CLI uses it).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import cattrs
import tomli_w
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)

T = TypeVar("T")


class ConfigError(Exception):
    """Configuration refused; ``errors`` holds one ``key.path: problem`` line per fault."""

    def __init__(self, errors: list[str], source: str = "config") -> None:
        self.errors = errors
        self.source = source
        super().__init__(f"invalid {source}: " + "; ".join(errors))


class _TagError(ValueError):
    """A tagged-union table whose tag is missing or unknown; ``key`` is the tag's name."""

    def __init__(self, key: str, msg: str) -> None:
        super().__init__(msg)
        self.key = key


def _strict(kind: type, label: str, accept: tuple[type, ...]) -> Callable[[Any, Any], Any]:
    def hook(value: Any, _: Any) -> Any:
        if isinstance(value, bool) and bool not in accept:
            raise TypeError(f"expected {label}, got {value!r}")
        if not isinstance(value, accept):
            raise TypeError(f"expected {label}, got {value!r}")
        return kind(value)

    return hook


def make_converter() -> cattrs.Converter:
    """A cattrs converter for config files: strict primitives, unknown keys refused."""
    conv = cattrs.Converter(forbid_extra_keys=True)
    strict_primitives(conv)
    return conv


def strict_primitives(conv: cattrs.Converter) -> None:
    """No silent coercion: ``"12"`` is not an int, ``1`` is not a string (also for JSON)."""
    conv.register_structure_hook(int, _strict(int, "an integer", (int,)))
    conv.register_structure_hook(float, _strict(float, "a number", (int, float)))
    conv.register_structure_hook(str, _strict(str, "a string", (str,)))
    conv.register_structure_hook(bool, _strict(bool, "a boolean", (bool,)))
    conv.register_structure_hook(Path, _strict(Path, "a path string", (str,)))
    conv.register_unstructure_hook(Path, str)


def register_tagged_union(
    conv: cattrs.Converter, union: Any, *, tag: str, classes: Mapping[str, type]
) -> None:
    """Structure ``union`` from tables like ``{mode = "pipelined", max_batch_size = 32}``:
    the ``tag`` key picks the class from ``classes`` and the other keys fill it. The classes
    do not declare the tag as a field; unstructuring adds it back."""
    by_class = {cls: name for name, cls in classes.items()}
    choices = ", ".join(repr(n) for n in classes)

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table with a {tag!r} key, got {value!r}")
        if tag not in value:
            raise _TagError(tag, f"missing, expected one of {choices}")
        cls = classes.get(value[tag]) if isinstance(value[tag], str) else None
        if cls is None:
            raise _TagError(tag, f"unknown {value[tag]!r}, expected one of {choices}")
        return conv.structure({k: v for k, v in value.items() if k != tag}, cls)

    def unstructure(obj: Any) -> dict[str, Any]:
        body = conv.unstructure(obj, unstructure_as=type(obj))
        return {tag: by_class[type(obj)], **body}

    conv.register_structure_hook_func(lambda t: t == union, structure)
    conv.register_unstructure_hook_func(lambda t: t == union, unstructure)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return "required key missing"
    text = str(exc)
    if "not in literal" in text:
        value, _, allowed = text.partition(" not in literal ")
        return f"invalid value {value!r}, expected one of {allowed.removeprefix('typing.')}"
    if isinstance(exc, ValueError | TypeError) and text:
        return text
    return f"invalid value ({type(exc).__name__}: {text})"


def _flatten(exc: BaseException, path: str) -> list[str]:
    if isinstance(exc, ForbiddenExtraKeysError):
        return [f"{_join(path, k)}: unknown key" for k in sorted(exc.extra_fields)]
    if isinstance(exc, _TagError):
        return [f"{_join(path, exc.key)}: {exc}"]
    if isinstance(exc, ClassValidationError | IterableValidationError):
        out: list[str] = []
        for sub in exc.exceptions:
            sub_path = path
            for note in getattr(sub, "__notes__", ()):
                if isinstance(note, AttributeValidationNote):
                    sub_path = _join(path, note.name)
                elif isinstance(note, IterableValidationNote):
                    sub_path = f"{path}[{note.index}]"
            out += _flatten(sub, sub_path)
        return out
    if isinstance(exc, BaseExceptionGroup):
        return [m for sub in exc.exceptions for m in _flatten(sub, path)]
    return [f"{path or '<root>'}: {_describe(exc)}"]


def structure_config(
    cls: type[T], data: Mapping[str, Any], *, converter: cattrs.Converter | None = None,
    source: str = "config", removed: Mapping[str, str] | None = None,
) -> T:
    """Build ``cls`` from a parsed TOML table, or raise ``ConfigError``. ``removed``: top-level
    keys that no longer exist, each with the line that tells the user what to do; a table
    that sets one is refused (with its other faults, if any)."""
    conv = converter or make_converter()
    gone = [k for k in (removed or {}) if k in data]
    errors = [f"{k}: {(removed or {})[k]}" for k in sorted(gone)]
    if gone:
        data = {k: v for k, v in data.items() if k not in gone}
    try:
        out = conv.structure(data, cls)
    except (cattrs.BaseValidationError, _TagError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(errors + _flatten(exc, ""), source) from None
    if errors:
        raise ConfigError(errors, source)
    return out


def load_config(
    cls: type[T], source: Path | str, *, converter: cattrs.Converter | None = None,
    removed: Mapping[str, str] | None = None,
) -> T:
    """Load ``cls`` from a TOML file (``Path``) or TOML text (``str``)."""
    if isinstance(source, Path):
        name = str(source)
        try:
            text = source.read_text()
        except OSError as exc:
            raise ConfigError([f"cannot read: {exc.strerror}"], name) from None
        except UnicodeDecodeError as exc:
            raise ConfigError([f"not UTF-8 text: {exc.reason} at byte {exc.start}"], name) from None
    else:
        name, text = "config", source
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"TOML syntax: {exc}"], name) from None
    return structure_config(cls, data, converter=converter, source=name, removed=removed)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def dump_config(obj: object, *, converter: cattrs.Converter | None = None) -> str:
    """TOML text for a config object (None values omitted: TOML has no null)."""
    conv = converter or make_converter()
    data = _drop_none(conv.unstructure(obj))
    return tomli_w.dumps(data)
