"""The interface every KV-cache policy implements, and its parameter validation."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from sglang_ext.policies.context import (  # noqa: F401  (the interface's types, one import away)
    DecodeContext,
    DecodeFn,
    DecodeInputs,
    DecodeProgram,
    RankGroup,
)
from sglang_ext.policies.runtime import FULL, PolicyRuntime


class PolicyConfigError(ValueError):
    """A policy name or parameter is invalid. ``field`` names the offending key."""

    def __init__(self, field: str, message: str, choices: list[str] | None = None):
        self.field = field
        self.choices = choices
        self.detail = message + (f" (valid: {', '.join(choices)})" if choices else "")
        super().__init__(f"{field}: {self.detail}")


# plans, once per decode batch on the host, which requests' K/V are re-filled (cache correction)
CorrectionPlanner = Callable[[list[Any]], Any]


@dataclasses.dataclass(frozen=True)
class KVPolicy:
    """A decode-time KV policy: a small frozen dataclass of validated parameters.

    Subclasses set ``name`` and declare their parameters as dataclass fields with defaults, and
    check ranges in ``validate``. The attention backend asks ``decode_program`` once, at start-up,
    for one decode function per layer, so the per-layer cost of dispatch is a list lookup. A
    parameter the model contradicts (a layer past its depth) raises PolicyConfigError there.
    """

    name: ClassVar[str]
    # What a request may choose for itself (sglang_ext.request_policy): these parameters, and
    # full attention instead of this policy when ``request_opt_out``. Parameters the decode
    # kernels or their static buffers read for the whole batch stay server-wide.
    request_params: ClassVar[tuple[str, ...]] = ()
    request_opt_out: ClassVar[bool] = False

    def __post_init__(self):
        self._check_types()
        self.validate()

    def validate(self) -> None:
        """Raise PolicyConfigError(field, ...) for an out-of-range parameter."""

    def validate_request(self, chosen: KVPolicy) -> None:
        """Raise PolicyConfigError(field, ...) where a request's own parameters (``chosen``:
        this policy with them) do not fit what the server set up for this one."""

    def request_choices(self) -> dict[str, KVPolicy | None]:
        """The policies a request may name (``custom_params.kv_policy.name``), the first the one a
        request naming none decodes under: this one, and full attention (None) where it allows
        opting out."""
        if self.request_opt_out and self.name != FULL:
            return {self.name: self, FULL: None}
        return {self.name: self}

    def request_columns(self, chosen: KVPolicy | None) -> dict[str, int | float]:
        """The values its decode reads per request (``DecodeInputs.request_table``), by column,
        for a request decoding under ``chosen`` (None: it opted out); empty when it reads none.
        An int stays an int column (policies.request_table)."""
        return {}

    def for_model(self, ctx: DecodeContext) -> KVPolicy:
        """This policy with parameters left to the model (unset layer lists) filled in."""
        return self

    def decode_program(self, ctx: DecodeContext, inputs: DecodeInputs) -> DecodeProgram:
        """Its decode, built once from the engine's view and what its runtime owns."""
        return DecodeProgram([ctx.base_decode] * ctx.num_layers)

    def over(self, base: KVPolicy) -> KVPolicy:
        """This policy reading what ``base`` keeps or selects (``BASE+THIS``); PolicyConfigError
        where it does not compose over it."""
        raise PolicyConfigError("policy", f"{self.name} does not compose over {base.name}")

    def runtime(self, ctx: DecodeContext, shared: DecodeInputs | None = None) -> PolicyRuntime:
        """This policy's life in one attention backend (policies.runtime), built once at start-up
        from the policy ``for_model`` gave; ``shared``: what a policy mix shares with its
        members (their slot tables, ART's tile counters)."""
        return PolicyRuntime(self, ctx, shared)

    def evicts(self) -> bool:
        """Whether it frees KV slots during decoding: the engine then drops holes on free, keeps
        a request's prompt out of the radix cache and admits requests at ``admission_tokens``."""
        return False

    def reads_tiles(self) -> bool:
        """Whether its decode counts KV tiles read (ART) into ``DecodeInputs.tile_counts``."""
        return False

    def pools_layer_rows(self) -> bool:
        """Whether its runtime keeps a layer's K/V in any layer's row of a slot it holds
        (per-layer memory in SGLang's one-slot-per-token pool): the engine then allocates the
        pool's layers as one buffer, so that a row of any layer is addressable from every layer."""
        return False

    def server_defaults(self) -> dict[str, str | None]:
        """SGLang flags the launcher adds where the user gave none (None: a flag without value)."""
        return {}

    def request_state_bytes(
        self, num_layers: int, num_q_heads: int, num_kv_heads: int, context_len: int
    ) -> int:
        """Device bytes its runtime owns per SGLang request slot at ``context_len`` positions (0:
        none that grow with the slots). The engine takes them out of the KV pool's budget and
        sizes the request pool so that they fit (``sglang_ext.engine.memory``)."""
        return 0

    def cache_correction(self) -> CorrectionPlanner | None:
        """Plans, once per decode batch on the host, which requests get their sparsely decoded
        tokens' K/V re-filled with full attention (policies.tidal.cache_correction); None: never."""
        return None

    def budget(self) -> str:
        """Its KV budget in a few words, for reports (a benchmark row's ``budget``); empty for a
        policy without one."""
        return ""

    def attended_tokens(self, seq_len: int, num_layers: int) -> float:
        """Tokens a decode step of a request of ``seq_len`` tokens attends to, averaged over the
        layers (before any early stop of ART); for metrics. Needs for_model's layer lists."""
        return float(seq_len)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **dataclasses.asdict(self)}

    def schema(self) -> dict[str, Any]:
        """This policy's parameters: name -> {"type", "default"}."""
        return type(self).parameter_schema()

    @classmethod
    def parameter_schema(cls) -> dict[str, Any]:
        hints = typing.get_type_hints(cls)
        return {
            f.name: {"type": _type_name(hints[f.name]), "default": _default(f)}
            for f in dataclasses.fields(cls)
        }

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = hints[f.name]
            if not _is_instance(value, expected):
                raise PolicyConfigError(
                    f"{self.name}.{f.name}",
                    f"expected {_type_name(expected)}, got {type(value).__name__} {value!r}",
                )


def _default(field: dataclasses.Field) -> Any:
    # list defaults come from a factory (a dataclass refuses a shared mutable default)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _is_instance(value: Any, expected: Any) -> bool:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, option) for option in typing.get_args(expected))
    if origin in (list, tuple):
        (item_type, *_) = typing.get_args(expected) or (object,)
        return isinstance(value, (list, tuple)) and all(_is_instance(v, item_type) for v in value)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _type_name(expected: Any) -> str:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(option) for option in typing.get_args(expected))
    if expected is type(None):
        return "None"
    if origin in (list, tuple):
        (item_type, *_) = typing.get_args(expected) or (object,)
        return f"list[{_type_name(item_type)}]"
    return getattr(expected, "__name__", str(expected))
