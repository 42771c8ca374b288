"""Page service configuration: the ``page_service_pipelining`` tagged union and its limits.

TOML shapes (protocols.md §2.1):

    page_service_pipelining = { mode = "serial" }
    page_service_pipelining = { mode = "pipelined", max_batch_size = 32, batching = "scattered-lsn" }

``execution`` ("concurrent-futures" | "tasks") is accepted for neon compatibility; in trio the
three stages are always tasks of one nursery, so it changes nothing. When the key is absent the
default is pipelined, 32, scattered-lsn; when present without ``batching`` it is uniform-lsn
(neon's serde default). ``register_hooks(converter)`` teaches a cattrs converter the union so the
node config (which owns the TOML file) can embed ``PageServiceConfig``.
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypeAlias

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union
from cattrs.v import format_exception

MAX_GET_VECTORED_KEYS: Final = 32
Batching: TypeAlias = Literal["uniform-lsn", "scattered-lsn"]
Execution: TypeAlias = Literal["concurrent-futures", "tasks"]


def _positive(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


@attrs.frozen
class SerialPipelining:
    """Read one request, answer it, repeat."""


@attrs.frozen
class PipelinedPipelining:
    """Reading, Batching and Execution as three tasks; GetPages fold into batches."""

    max_batch_size: int = attrs.field(default=32, validator=_positive)
    batching: Batching = attrs.field(
        default="uniform-lsn", validator=attrs.validators.in_(("uniform-lsn", "scattered-lsn"))
    )
    execution: Execution = attrs.field(
        default="concurrent-futures",
        validator=attrs.validators.in_(("concurrent-futures", "tasks")),
    )


PagePipelining: TypeAlias = SerialPipelining | PipelinedPipelining

DEFAULT_PIPELINING: Final = PipelinedPipelining(32, "scattered-lsn")


def _check_pipelining(inst: PageServiceConfig, _a: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, PipelinedPipelining) and value.max_batch_size > inst.max_get_vectored_keys:
        raise ValueError(
            f"page_service_pipelining.max_batch_size {value.max_batch_size} exceeds "
            f"max_get_vectored_keys {inst.max_get_vectored_keys}"
        )


@attrs.frozen
class PageServiceConfig:
    """Everything the page service reads from the node config."""

    max_get_vectored_keys: int = attrs.field(default=MAX_GET_VECTORED_KEYS, validator=_positive)
    page_service_pipelining: PagePipelining = attrs.field(
        default=DEFAULT_PIPELINING, validator=_check_pipelining
    )
    wait_lsn_timeout_s: float = 300.0
    # A send that cannot finish in this long means the client stopped reading; the stream is
    # then broken. Sends are shielded from cancellation (so shutdown never leaves half a
    # message on the wire), and this bounds how long that shield can hold shutdown up.
    send_timeout_s: float = 10.0
    # Requests decoded but not yet folded (Reading -> Batching); bounded for backpressure.
    read_queue: int = attrs.field(default=16, validator=attrs.validators.ge(0))


def _tag(cls: type) -> str:
    return {SerialPipelining: "serial", PipelinedPipelining: "pipelined"}[cls]


def register_hooks(converter: cattrs.Converter) -> None:
    """Teach ``converter`` the ``mode``-tagged union (use with ``forbid_extra_keys=True``)."""
    configure_tagged_union(PagePipelining, converter, tag_generator=_tag, tag_name="mode")


def make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    register_hooks(converter)
    return converter


def structure_config(raw: dict[str, Any]) -> PageServiceConfig:
    """Structure a config table; errors name the offending key and say what is wrong."""
    converter = make_converter()
    try:
        return converter.structure(raw, PageServiceConfig)
    except cattrs.BaseValidationError as exc:
        messages = cattrs.transform_error(exc, path="page_service", format_exception=_describe)
        raise ValueError("invalid page service config: " + "; ".join(messages)) from None


def _describe(exc: BaseException, type_: type | None) -> str:
    # cattrs says only "invalid value" for a validator's ValueError; its text is the point.
    if isinstance(exc, ValueError) and str(exc):
        return f"invalid value ({exc})"
    return format_exception(exc, type_)
