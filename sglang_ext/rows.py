"""The row every benchmark (``benchmarks/``) and the eval (``sglang_ext.eval``) saves: one measured
value of one policy at one point, beside vanilla's or full attention's (tests/row_schema.py)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Row:
    bench: str
    policy: str
    model_shape: str
    batch: int
    context: int
    metric: str
    value: float | None
    baseline_value: float | None = None
    ratio: float | None = None
    device: str = ""
    sglang_version: str = ""
    date: str = ""
    skipped: str | None = None  # why there is no value
    attention_backend: str = ""  # SGLang's --attention-backend of this row's engine
    baseline_backend: str = ""  # the vanilla backend of baseline_value: the fastest measured
    kv_source: str = ""  # real (prefill computed it) or synthetic (filled without prefill)
    budget: str = ""  # the policy's KV budget (KVPolicy.budget), where it has one
