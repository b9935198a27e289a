"""The interface every KV-cache policy implements, and its parameter validation."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from sglang_ext.policies.runtime import FULL, PolicyRuntime


class PolicyConfigError(ValueError):
    """A policy name or parameter is invalid. ``field`` names the offending key."""

    def __init__(self, field: str, message: str, choices: list[str] | None = None):
        self.field = field
        self.choices = choices
        self.detail = message + (f" (valid: {', '.join(choices)})" if choices else "")
        super().__init__(f"{field}: {self.detail}")


# forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs) -> attention output
DecodeFn = Callable[..., Any]

# plans, once per decode batch on the host, which requests' K/V are re-filled (cache correction)
CorrectionPlanner = Callable[[list[Any]], Any]


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """The attention tensor-parallel ranks of this process's model, each holding some of the query
    heads. A policy whose decision reads scores over all heads combines them here, so that every
    rank decides alike; every rank must call the same combinations in the same order."""

    rank: int
    size: int
    # x -> [size, *x.shape]: every rank's x, in rank order (SGLang's group all-gather; CUDA graphs
    # capture it)
    gather: Callable[[torch.Tensor], torch.Tensor]

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(x).amax(0)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Summed in rank order on every rank, so every rank gets the same bits."""
        return self.gather(x).sum(0)

    def agree(self, x: torch.Tensor, what: str) -> None:
        """Raise when the ranks hold different ``x`` (a host sync: for rare decisions)."""
        gathered = self.gather(x)
        if not bool((gathered == gathered[:1]).all()):
            raise RuntimeError(f"sglang_ext: tensor-parallel ranks disagree on {what}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeContext:
    """What the attention backend gives a policy at start-up to build its decode functions.
    Keyword-only: a field inserted before another (the mix's ``base_decode_rows``) silently
    shifted a positional caller's fingerprint into it."""

    num_layers: int
    base_decode: DecodeFn  # the engine's own full attention (writes the new token's K/V itself)
    write_kv: Callable[..., None]  # write_kv(layer, forward_batch, k, v): store the new token's K/V
    kv_pool: Any  # SGLang's token_to_kv_pool: get_key_buffer(layer_id) -> [slots, kv_heads, dim]
    req_to_token: Any  # [request slots, max context] int32: cache slot of each request's tokens
    max_batch_size: int  # no decode batch is larger: per-batch state is allocated once this size
    device: Any  # torch.device of the KV cache
    # base_decode_rows(rows) -> the engine's full attention reading only the rows a bool
    # [max_batch_size] mask marks (written before each step's layers), the others one token,
    # their output unspecified; None where the engine's plan fixes every row's length
    base_decode_rows: Callable[[Any], DecodeFn] | None = None
    model_fingerprint: dict[str, Any] | None = None  # policies.calibration.model_fingerprint
    ranks: RankGroup | None = None  # under attention tensor parallelism; None on one rank
    # ART (policies.art.Art) when it reads for this policy (BASE+art): sparse layers read their
    # selection through it, importance-first
    art: Any = None
    # float32 [request slots, len(request_values)]: each request's own values of the policy's
    # per-request decode parameters, by req_pool_indices (sglang_ext.request_policy); None when
    # the policy has none
    request_values: Any = None
    # int64 [2] on the device: [tiles read, tiles in the traversal] of ART's reads (metrics)
    art_tile_counts: Any = None
    hole_slot: int = 0  # the slot an evicted position's req_to_token entry points at
    # Run once per decode step before its layers (PolicyRuntime.prepare_decode), each
    # f(forward_batch): decode functions add theirs when built. Recorded into CUDA graphs.
    decode_step_setups: list = dataclasses.field(default_factory=list)
    # Run on the host before each decode step (PolicyRuntime.run_plan), each f(total_tokens):
    # make room for a batch holding that many tokens in all; False when the step must then run
    # eagerly (what CUDA graphs recorded is too small for it)
    step_reservations: list = dataclasses.field(default_factory=list)
    # This rank's query heads and the head size: decode scratch is sized from them at start-up
    num_q_heads: int | None = None
    head_dim: int | None = None
    kv_pool_tokens: int | None = None  # the KV pool's token slots (None: unknown)
    # A policy mix member's share of the mix's slot tables (kernels.sparse_decode.TableShare):
    # a policy that reads a slot table takes this one and lists the layers where it reads only
    # that table, so that the mix reads its members' tables in one call there; None: its own
    slot_tables: Any = None

    def batch_tokens_bound(self) -> int:
        """The most tokens a decode batch holds in all without shared prefixes: the KV pool's,
        or every request slot at full context where the pool's size is unknown."""
        return self.kv_pool_tokens or self.max_batch_size * self.req_to_token.shape[1]

    def head_shape(self) -> tuple[int, int, int] | None:
        """(query heads, KV heads, head size) of this rank's attention, for decode scratch owned
        up front; None off CUDA (the torch references need none) or where the heads are unknown."""
        if torch.device(self.device).type != "cuda" or self.num_q_heads is None:
            return None
        return self.num_q_heads, self.kv_pool.get_key_buffer(0).shape[1], self.head_dim

    def split_workspace(self, max_tokens: int, num_splits: int | None = None):
        """Scratch of the split-KV kernel (kernels.split_kv_decode) for requests attending to up
        to ``max_tokens`` tokens (or ``num_splits`` splits at every batch size), sized for the
        largest batch; None where ``head_shape`` is (the kernel then allocates)."""
        heads = self.head_shape()
        if heads is None:
            return None
        from sglang_ext.kernels.split_kv_decode import SplitKVWorkspace

        return SplitKVWorkspace(
            self.max_batch_size, *heads, max_tokens, self.device, num_splits
        )


@dataclasses.dataclass(frozen=True)
class KVPolicy:
    """A decode-time KV policy: a small frozen dataclass of validated parameters.

    Subclasses set ``name`` and declare their parameters as dataclass fields with defaults, and
    check ranges in ``validate``. The attention backend asks ``decode_fns`` once, at start-up,
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

    def request_values(self, chosen: KVPolicy | None) -> tuple[float, ...]:
        """The values the decode kernels read per request (DecodeContext.request_values) for a
        request decoding under ``chosen`` (None: it opted out); () when they read none."""
        return ()

    def for_model(self, ctx: DecodeContext) -> KVPolicy:
        """This policy with parameters left to the model (unset layer lists) filled in."""
        return self

    def decode_fns(self, ctx: DecodeContext) -> list[DecodeFn]:
        """One decode function per layer, built once from the backend's context."""
        return [ctx.base_decode] * ctx.num_layers

    def runtime(self, ctx: DecodeContext) -> PolicyRuntime:
        """This policy's life in one attention backend (policies.runtime), built once at start-up
        from the policy ``for_model`` gave."""
        return PolicyRuntime(self, ctx)

    def evicts(self) -> bool:
        """Whether it frees KV slots during decoding: the engine then drops holes on free, keeps
        a request's prompt out of the radix cache and admits requests at ``admission_tokens``."""
        return False

    def reads_tiles(self) -> bool:
        """Whether its decode counts KV tiles read (ART) into ``ctx.art_tile_counts``."""
        return False

    def pools_layer_rows(self) -> bool:
        """Whether its runtime keeps a layer's K/V in any layer's row of a slot it holds
        (per-layer memory in SGLang's one-slot-per-token pool): the engine then allocates the
        pool's layers as one buffer, so that a row of any layer is addressable from every layer."""
        return False

    def server_defaults(self) -> dict[str, str | None]:
        """SGLang flags the launcher adds where the user gave none (None: a flag without value)."""
        return {}

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
