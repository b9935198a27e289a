import json

import pytest

from benchmarks import harness, overhead


def _row(policy, value, batch=1):
    return harness.Row(bench="b", policy=policy, model_shape="s", batch=batch, context=8, metric="m", value=value)


def test_ratios_are_against_vanilla_at_the_same_point():
    rows = [_row("vanilla", 2.0), _row("full", 3.0), _row("vanilla", 4.0, batch=2), _row("full", 2.0, batch=2)]
    harness.add_baseline_ratios(rows)
    assert [(r.baseline_value, r.ratio) for r in rows] == [(2.0, 1.0), (2.0, 1.5), (4.0, 1.0), (4.0, 0.5)]


def test_the_baseline_is_the_fastest_vanilla_backend():
    rates = [_row("vanilla@fa3", 2.0), _row("vanilla@triton", 3.0), _row("delta", 6.0)]
    times = [harness.Row(**{**vars(r), "metric": "layer_ms", "value": 6 / r.value}) for r in rates]
    over_floor = [harness.Row(**{**vars(r), "metric": "layer_floor_ratio"}) for r in times]
    for r in rates + times + over_floor:
        r.attention_backend = harness.named_backend(r.policy)
    harness.add_baseline_ratios(rates + times + over_floor)
    ratios = lambda rows: [(r.baseline_backend, r.ratio) for r in rows]  # noqa: E731
    assert ratios(rates) == [("triton", 2 / 3), ("triton", 1.0), ("triton", 2.0)]
    # a time: the fastest backend is the one with the smallest value
    assert ratios(times) == [("triton", 1.5), ("triton", 1.0), ("triton", 0.5)]
    assert ratios(over_floor) == ratios(times)  # closer to the floor is better


def test_one_backend_is_the_baseline_of_every_metric_at_a_point():
    # fa3 is the faster by throughput; triton holds more KV and has the smaller fixed cost
    rows = [
        harness.Row(
            bench="b", policy=policy, model_shape="s", batch=batch, context=8, metric=metric,
            value=value, attention_backend=harness.named_backend(policy),
        )
        for policy, batch, metric, value in [
            ("vanilla@fa3", 64, "tok_s", 10.0), ("vanilla@triton", 64, "tok_s", 7.0),
            ("delta", 64, "tok_s", 18.0),
            ("vanilla@fa3", 64, "kv_tokens", 100.0), ("vanilla@triton", 64, "kv_tokens", 120.0),
            ("delta", 64, "kv_tokens", 90.0),
            ("vanilla@fa3", 64, "fixed_ms", 2.1), ("vanilla@triton", 64, "fixed_ms", 1.9),
            ("delta", 64, "fixed_ms", 2.5),
            # a point without the speed metric: each metric's best vanilla, as without one
            ("vanilla@fa3", 1, "fixed_ms", 3.0), ("vanilla@triton", 1, "fixed_ms", 2.0),
        ]
    ]  # fmt: skip
    harness.add_baseline_ratios(rows, speed_metric="tok_s")
    at_64 = {(r.policy, r.metric): (r.baseline_backend, r.ratio) for r in rows if r.batch == 64}
    assert at_64[("delta", "tok_s")] == ("fa3", 1.8)
    assert at_64[("delta", "kv_tokens")] == ("fa3", 0.9)
    assert at_64[("delta", "fixed_ms")] == ("fa3", pytest.approx(2.5 / 2.1))
    assert at_64[("vanilla@triton", "fixed_ms")] == ("fa3", pytest.approx(1.9 / 2.1))
    assert [r.baseline_backend for r in rows if r.batch == 1] == ["triton", "triton"]


def test_overhead_pools_every_point_of_every_run(tmp_path, capsys):
    runs = []
    for i, ratios in enumerate([[1.5, 0.5], [2.0]]):
        path = tmp_path / f"run{i}.json"
        rows = [{"metric": "m", "policy": "vanilla", "ratio": 1.0}]
        rows += [{"metric": "m", "policy": "full", "ratio": r} for r in ratios]
        rows += [{"metric": "other", "policy": "full", "ratio": 9.0}]
        path.write_text(json.dumps(rows))
        runs.append(path)
    overhead.main(["--metric", "m", *map(str, runs)])
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == f"| full | m | 2 | 3 | {(1.5 * 0.5 * 2.0) ** (1 / 3):.4f} | 0.5000 | 2.0000 |"


def test_overhead_refuses_files_without_the_metric(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("[]")
    with pytest.raises(SystemExit, match="no policy rows"):
        overhead.main(["--metric", "m", str(path)])
