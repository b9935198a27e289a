"""``art``: ART (Attention Run-time Termination), on its own over full attention or on top of
another policy (``--policy delta+art``, ``tidal+art``).

ART never changes what a layer may attend to, only how much of it the decode kernel reads: the
kernel walks the KV tiles in a traversal order and stops once the running output has been
stable in scale (< ``tau``) and direction (< ``phi``) for ``patience`` tiles of ``tile_tokens``
tokens (``kernels/art_decode.py``). Over full attention the order is recent-first after the first
``sink_tokens`` tokens; over DELTA or TidalDecode, a sparse layer reads its selection
importance-first: the recent pages (tokens), then the others by selection score.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from sglang_ext.kernels import art_decode as art
from sglang_ext.kernels.art_decode import TILE_TOKENS
from sglang_ext.kernels.kv_view import KVView
from sglang_ext.policies.base import (
    DecodeContext,
    DecodeFn,
    DecodeInputs,
    DecodeProgram,
    KVPolicy,
    PolicyConfigError,
)
from sglang_ext.policies.registry import register_policy


@register_policy
@dataclasses.dataclass(frozen=True)
class Art(KVPolicy):
    name = "art"
    # read by the kernel per request (a table row); {"name": "full"} is patience 0: read it all
    request_params = ("tau", "phi", "patience")
    request_opt_out = True
    tau: float = 1e-5  # scale: ||x_t - x_{t-1}|| of the probe
    phi: float = 1e-3  # direction: 1 - cos(x_t, x_{t-1})
    patience: int = 5  # consecutive stable tiles before stopping; 0: never stop (p = inf)
    sink_tokens: int = 4  # read first, always (over full attention)
    probe_stride: int = 8  # the probe: every probe_stride-th head dimension
    num_kv_splits: int = 8
    # tokens per tile: the kernel's step, and what patience counts. Large tiles keep the kernel,
    # with termination off, as fast as the plain split-KV kernel; small ones cost launches
    tile_tokens: int = 128

    def validate(self) -> None:
        for field in ("tau", "phi"):
            if not getattr(self, field) > 0:
                self._error(field, f"must be > 0, got {getattr(self, field)}")
        for field in ("patience", "sink_tokens"):
            if getattr(self, field) < 0:
                self._error(field, f"must be >= 0, got {getattr(self, field)}")
        for field in ("probe_stride", "num_kv_splits"):
            if getattr(self, field) < 1:
                self._error(field, f"must be >= 1, got {getattr(self, field)}")
        if self.tile_tokens not in TILE_TOKENS:
            self._error(
                "tile_tokens", f"must be one of {list(TILE_TOKENS)}, got {self.tile_tokens}"
            )

    def decode_program(self, ctx: DecodeContext, inputs: DecodeInputs) -> DecodeProgram:
        return DecodeProgram([self.full_decode(ctx, inputs, per_request=True)] * ctx.num_layers)

    def over(self, base: KVPolicy) -> ArtOver:
        return ArtOver(base=base, art=self)

    def reads_tiles(self) -> bool:
        return True

    def request_columns(self, chosen: Art | None) -> dict[str, int | float]:
        if chosen is None:  # opted out: patience 0 reads every tile
            return {"tau": self.tau, "phi": self.phi, "patience": 0}
        return {"tau": chosen.tau, "phi": chosen.phi, "patience": chosen.patience}

    def kernel_params(self) -> dict[str, Any]:
        return {
            "tau": self.tau, "phi": self.phi, "patience": self.patience,
            "probe_stride": self.probe_stride, "num_kv_splits": self.num_kv_splits,
            "tile_tokens": self.tile_tokens,
        }  # fmt: skip

    def scratch(self, ctx: DecodeContext) -> dict[str, Any]:
        """The kernel's scratch for one decode path, owned up front (``read``'s ``scratch``):
        its split-KV workspace and tile counts; none off CUDA, where the reference runs."""
        workspace = ctx.split_workspace(0, num_splits=self.num_kv_splits)
        if workspace is None:
            return {}
        kv_heads = ctx.kv_pool.get_key_buffer(0).shape[1]
        shape = (ctx.max_batch_size, kv_heads, self.num_kv_splits)
        tiles_read = torch.empty(shape, dtype=torch.int32, device=ctx.device)
        return {"workspace": workspace, "tiles_read": tiles_read}

    def read(
        self, q, ctx: DecodeContext, layer, forward_batch, scratch=None, tile_counts=None,
        request_table=None, **order,
    ):  # fmt: skip
        """ART's decode attention of q [batch, heads, dim] over the layer's cache (all of it
        recent-first, or ``order``/``num_order``/``order_span``/``always_read``); with
        ``request_table``, each request's own (tau, phi, patience) from its row; with
        ``scratch`` (``Art.scratch``), the kernel's buffers owned up front; the tiles it reads
        counted into ``tile_counts``."""
        attend = art.art_decode if q.is_cuda else art.art_decode_ref
        kv = KVView.of_layer(ctx.kv_pool, layer.layer_id, ctx.req_to_token, forward_batch)
        order.setdefault("always_read", self.sink_tokens)
        out, _ = attend(
            q, kv, layer.scaling, **self.kernel_params(), **order, **(scratch or {}),
            tile_counts=tile_counts,
            request_columns=None if request_table is None else request_table.columns,
        )  # fmt: skip
        return out

    def full_decode(
        self, ctx: DecodeContext, inputs: DecodeInputs, per_request: bool = False
    ) -> DecodeFn:
        """Full attention read through ART; ``per_request``: each request's own parameters."""
        scratch = self.scratch(ctx)
        table = inputs.request_table if per_request else None

        def decode(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if save_kv_cache and k is not None and v is not None:
                ctx.write_kv(layer, forward_batch, k, v)
            q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
            out = self.read(
                q, ctx, layer, forward_batch, scratch, inputs.tile_counts, table
            )
            return out.view(q.shape[0], -1)

        return decode

    def _error(self, field: str, message: str):
        raise PolicyConfigError(f"{self.name}.{field}", message)


@dataclasses.dataclass(frozen=True)
class ArtOver(KVPolicy):
    """A base policy whose attention reads go through ART: its full-attention layers read
    recent-first, its sparse layers their selection importance-first."""

    base: KVPolicy
    art: Art

    COMPOSABLE = ("full", "delta", "tidal")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.base.name}+{Art.name}"

    def validate(self) -> None:
        if self.base.name not in self.COMPOSABLE:
            raise PolicyConfigError(
                "policy", f"ART composes over {', '.join(self.COMPOSABLE)}, not {self.base.name!r}"
            )

    def for_model(self, ctx: DecodeContext) -> ArtOver:
        return dataclasses.replace(self, base=self.base.for_model(ctx))

    def decode_program(self, ctx: DecodeContext, inputs: DecodeInputs) -> DecodeProgram:
        reading = dataclasses.replace(ctx, base_decode=self.art.full_decode(ctx, inputs))
        return self.base.decode_program(reading, dataclasses.replace(inputs, art=self.art))

    def server_defaults(self) -> dict[str, str | None]:
        return self.base.server_defaults()

    def reads_tiles(self) -> bool:
        return True

    def cache_correction(self):
        return self.base.cache_correction()

    def attended_tokens(self, seq_len: int, num_layers: int) -> float:
        return self.base.attended_tokens(seq_len, num_layers)

    def budget(self) -> str:
        return self.base.budget()

    def schema(self) -> dict[str, Any]:
        return {**self.base.schema(), Art.name: self.art.schema()}

    def describe(self) -> dict[str, Any]:
        base = {k: v for k, v in self.base.describe().items() if k != "name"}
        return {"name": self.name, **base, Art.name: dataclasses.asdict(self.art)}
