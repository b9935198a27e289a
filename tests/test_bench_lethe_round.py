"""The Lethe round benchmark on a small shape: at the same cap both modes hold the same slots,
and a packed request's layers each keep their cap where the union leaves them fewer."""

import json

from benchmarks import lethe_round
from row_schema import assert_rows_schema


def test_packed_and_union_rounds_hold_alike_and_packed_layers_keep_more(tmp_path):
    lethe_round.main([
        "--shape", "smol", "--context", "256", "--requests", "1,3", "--repeats", "1",
        "--out-dir", str(tmp_path), "--results-md", str(tmp_path / "RESULTS.md"),
    ])  # fmt: skip
    (rows_path,) = tmp_path.glob("lethe_round-*.json")
    rows = json.loads(rows_path.read_text())
    # a round over synthetic lists, no attention: packed rows against the union's
    assert_rows_schema(rows, "lethe_round", kv_sources={"synthetic"}, engine=False)
    assert all(r["budget"].startswith("max_kv_ratio 0.3") for r in rows), rows[0]["budget"]
    value = {(r["policy"], r["batch"], r["metric"]): r["value"] for r in rows}
    metrics = ("held_slots", "attended_entries", "round_ms")
    for requests in (1, 3):
        packed = {m: value["lethe:pack_layers=true", requests, m] for m in metrics}
        union = {m: value["lethe:pack_layers=false", requests, m] for m in metrics}
        assert packed["held_slots"] == union["held_slots"] == 77  # ceil(0.3 x 256)
        assert packed["attended_entries"] == 77 > union["attended_entries"]
        assert packed["round_ms"] > 0 and union["round_ms"] > 0
    assert "## lethe_round · smol" in (tmp_path / "RESULTS.md").read_text()
