"""What every benchmark row (``benchmarks.harness.Row``, as the scripts write it to JSON) must say."""

from __future__ import annotations

import dataclasses
import re

import pytest

from benchmarks import harness

REQUIRED = (
    "bench", "policy", "model_shape", "batch", "context", "metric", "value", "baseline_value",
    "ratio", "attention_backend", "baseline_backend", "kv_source", "device", "sglang_version", "date",
)  # fmt: skip
KV_SOURCES = {"real", "synthetic"}  # prefill computed the KV, or it was filled without one


def assert_rows_schema(
    rows: list[dict],
    bench: str,
    kv_sources: set[str] = KV_SOURCES,
    engine: bool = True,
    budgets: dict[str, str] | None = None,
) -> None:
    """Each of ``bench``'s rows has the Row's fields, the required ones filled: its value (or why
    it has none), its ratio ``value / baseline_value`` where vanilla's value is known (None where
    not: ``harness.add_baseline_ratios``), a ``kv_source`` of ``kv_sources``, the attention backend
    that ran (``engine``: the row's; with a baseline, the baseline's) and, for each policy of
    ``budgets``, that budget."""
    assert rows, f"no {bench} rows"
    fields = {field.name for field in dataclasses.fields(harness.Row)}
    assert set(REQUIRED) <= fields
    for row in rows:
        assert set(row) == fields, row
        assert row["bench"] == bench and row["policy"] and row["model_shape"] and row["metric"], row
        assert isinstance(row["batch"], int) and row["batch"] >= 1, row
        assert isinstance(row["context"], int) and row["context"] >= 1, row
        assert (row["value"] is None) == bool(row["skipped"]), row  # no value, and why
        value, baseline = row["value"], row["baseline_value"]
        if value is not None and baseline:
            assert row["ratio"] == pytest.approx(value / baseline), row
        else:
            assert row["ratio"] is None, row
        if baseline is None:
            assert row["baseline_backend"] == "", row
        assert row["kv_source"] in kv_sources, row
        if engine:
            assert row["attention_backend"], row
            assert baseline is None or row["baseline_backend"], row
        assert row["device"] and row["sglang_version"], row
        assert re.match(r"\d{4}-\d{2}-\d{2}T", row["date"]), row  # RunInfo's ISO time
        if budgets is not None and row["policy"] in budgets:
            assert row["budget"] == budgets[row["policy"]], row
        if harness.is_vanilla(row["policy"]):
            assert row["budget"] == "", row
