"""What benchmark rows say about a run: each policy's budget, which server a NAME@BACKEND starts,
which vanilla run a policy's greedy tokens are compared with, a decode step's bandwidth floor, and
the instruction set a CPU run forced."""

import re
import threading
from types import SimpleNamespace

import pytest

from benchmarks import decode_profile, decode_step, e2e, harness, host_step
from row_schema import assert_rows_schema


def test_rows_name_each_policys_budget_from_its_config():
    assert harness.policy_budget("delta", None) == "64 pages"
    assert harness.policy_budget("tidal", '{"budget_tokens": 64}') == "64 tokens"
    assert harness.policy_budget("delta+art", None) == "64 pages"  # ART reads within DELTA's
    lethe = harness.policy_budget("lethe", None)
    assert lethe == (
        "max_kv_ratio 0.3, evict_threshold 1024, round_interval 64, shared_ratio 0.5 "
        "(per-layer memory)"
    )
    one_set = harness.policy_budget("lethe", '{"per_layer": false}')
    assert one_set == "max_kv_ratio 0.3, evict_threshold 1024, one set"
    union = harness.policy_budget("lethe", '{"sparse_ratio": 10.0, "pack_layers": false}')
    assert union.endswith("sparse_ratio 10.0, shared_ratio 0.5 (freed by the union)")
    assert harness.policy_budget("full", None) == ""
    assert harness.policy_budget("vanilla@fa3", None) == ""


def test_e2e_starts_vanilla_sglang_or_the_launcher_by_the_name_before_the_backend():
    args = e2e.build_parser().parse_args(["--shape", "qwen1.5b"])
    vanilla = e2e.server_argv(args, "vanilla@triton", 30000)
    policy = e2e.server_argv(args, "delta@triton", 30000)
    assert vanilla[1:3] == ["-m", "sglang.launch_server"] and "--policy" not in vanilla
    assert policy[1:5] == ["-m", "sglang_ext.launch", "--policy", "delta"]
    mix = e2e.server_argv(args, "lethe/delta@fa3", 30000)  # one server, requests in turn
    assert mix[3:5] == ["--policy", "lethe,delta"]
    assert harness.request_policies("lethe/delta@fa3") == ["lethe", "delta"]
    assert harness.request_policies("delta@fa3") == [None]
    assert harness.policy_budget("lethe/delta", None).startswith("lethe: max_kv_ratio 0.3")


def test_a_policy_config_keyed_by_the_runs_policies_gives_each_its_own():
    run = ["--shape", "qwen1.5b", "--policies", "vanilla@fa3,lethe,h2o"]
    keyed = '{"h2o": {"compression_ratio": 0.7}}'
    args = e2e.build_parser().parse_args([*run, "--policy-config", keyed])
    h2o, lethe = e2e.server_argv(args, "h2o", 30000), e2e.server_argv(args, "lethe", 30000)
    assert h2o[h2o.index("--policy-config") + 1] == '{"compression_ratio": 0.7}'
    assert "--policy-config" not in lethe  # not named: its defaults
    # keys that are not all the run's policies: a config for every policy, as given
    shared = '{"max_kv_ratio": 0.5}'
    assert harness.policy_config("lethe", shared, ["lethe", "h2o"]) == shared
    assert harness.policy_budget("h2o", harness.policy_config("h2o", keyed, ["h2o"])).startswith(
        "compression_ratio 0.7"
    )


def test_greedy_tokens_are_compared_with_vanilla_on_the_same_backend():
    def run(policy, backend, greedy):
        return e2e.PolicyRun(policy, "dev", "0.5.17", "today", 1.0, 0, [], greedy, backend)

    runs = [
        run("vanilla@fa3", "fa3", [[1, 2], [3, 4]]),
        run("vanilla@flashinfer", "flashinfer", [[1, 2], [3, 5]]),
        run("full", "flashinfer", [[1, 2], [3, 4]]),  # fa3's tokens, but flashinfer is its base
        run("delta@triton", "triton", [[1, 2], [3, 5]]),  # no vanilla on triton: no row
    ]
    args = e2e.build_parser().parse_args(["--shape", "qwen1.5b"])
    rows = e2e.greedy_match_rows(harness.RunInfo.detect(), args, runs)
    assert {r.policy: r.value for r in rows} == {"vanilla@fa3": 1.0, "vanilla@flashinfer": 1.0, "full": 0.5}


def test_the_decode_step_line_is_fit_at_the_full_batch_without_the_prefill_interval():
    def line(running, context, step_ms):
        return (
            f"[t] Decode batch, #running-req: {running}, #token: {running * context}, token usage: "
            f"0.03, cuda graph: True, gen throughput (token/s): {running / step_ms * 1e3:.4f}, "
            "#queue-req: 0"
        )

    # step = 2 ms + 0.5 ms per 1,024 tokens at the full batch of 4; the first full line holds the
    # prefill (slow), and the batch of 3 draining at the end is off the line
    full = [line(4, c, 2.0 + 0.5 * c / 1024) for c in (2048, 3072, 4096, 5120)]
    log = "\n".join([line(4, 1024, 90.0), *full, line(3, 6144, 1.0), "Prefill batch ..."])
    fixed, slope = e2e.decode_step_curve(log)
    assert fixed == pytest.approx(2.0, abs=1e-3) and slope == pytest.approx(0.5, abs=1e-3)
    # TPOT: the median of the full batch's steps (3.0, 3.5, 4.0, 4.5 ms), the prefill's left out
    assert e2e.decode_step_ms(log) == pytest.approx(3.75, abs=1e-3)
    assert e2e.decode_step_ms("Prefill batch ...") is None
    assert e2e.decode_step_curve("\n".join(full[:3])) is None  # two lines after the first
    # every step on the line here; steps flat and noisy across contexts 0.2 ms off a 3.5 ms one
    assert e2e.decode_step_residual_frac(log) == pytest.approx(0.0, abs=1e-4)
    flat = [line(4, c, 3.5 + (0.2 if c % 2048 else -0.2)) for c in range(1024, 10 * 1024, 1024)]
    assert e2e.decode_step_residual_frac("\n".join(flat)) == pytest.approx(0.2 / 3.5, rel=0.05)
    assert e2e.decode_step_residual_frac("\n".join(full[:3])) is None

    run = e2e.PolicyRun("delta", "H100", "0.5.17", "T", 1.0, 0, [], [], step_curve=(fixed, slope),
                        step_ms=3.75, step_residual=0.01)  # fmt: skip
    args = e2e.build_parser().parse_args(["--shape", "qwen1.5b"])
    metrics = {row.metric: row.value for row in run.rows(args)}
    assert metrics["decode_step_fixed_ms"] == fixed and metrics["decode_step_slope_ms"] == slope
    assert metrics["decode_step_ms"] == 3.75 and metrics["decode_step_residual_frac"] == 0.01


def test_real_weights_serve_smollm2_on_distinct_natural_prompts_of_the_exact_length(model_path):
    args = e2e.build_parser().parse_args(
        ["--shape", "smol", "--real-weights", "--requests", "7", "--input-len", "600"]
    )
    argv = e2e.server_argv(args, "art", 30000)
    assert "--load-format" not in argv and argv[argv.index("--model-path") + 1] == str(model_path)
    prompts = e2e.real_prompts(args)
    assert [len(ids) for ids in prompts] == [600] * 7
    assert len({tuple(ids[:64]) for ids in prompts}) == 7  # each starts its own passage window


def test_real_weights_need_the_embedded_models_shape(capsys):
    with pytest.raises(SystemExit) as exit_info:
        e2e.main(["--shape", "qwen1.5b", "--real-weights"])
    assert exit_info.value.code == 2 and "--real-weights" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--profile-steps", "--profile-at-step"])
def test_a_negative_profile_step_is_refused_naming_its_flag(capsys, flag):
    with pytest.raises(SystemExit) as exit_info:
        e2e.main(["--shape", "qwen1.5b", flag, "-1"])
    assert exit_info.value.code == 2 and f"{flag} must be >= 0" in capsys.readouterr().err


def test_partial_runs_are_saved_under_plain_file_names_and_found_again(tmp_path):
    args = e2e.build_parser().parse_args(["--shape", "qwen1.5b", "--partial-dir", str(tmp_path)])
    for policy in ("vanilla@fa3", "delta+art@flashinfer", "lethe", "lethe/delta"):
        e2e.PolicyRun(policy, "dev", "0.5.17", "today", 1.0, 0, [], [], "fa3").save(e2e.partial_path(args, policy))
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", path.name) for path in tmp_path.iterdir())
    saved = [run.policy for run in e2e.saved_runs(args)]
    assert saved == ["vanilla@fa3", "delta+art@flashinfer", "lethe", "lethe/delta"]


def test_a_split_run_is_reported_from_its_saved_runs_under_the_device_they_ran_on(tmp_path):
    partial = tmp_path / "partial"
    argv = ["--shape", "qwen1.5b", "--partial-dir", str(partial), "--out-dir", str(tmp_path)]
    args = e2e.build_parser().parse_args(argv)
    partial.mkdir()
    for policy, tok_s, date in (("vanilla@fa3", 100.0, "T1"), ("lethe", 150.0, "T2")):
        run = e2e.PolicyRun(policy, "H100", "0.5.17", date, tok_s, 0, [], [[1]], "fa3")
        run.save(e2e.partial_path(args, policy))
    e2e.main([*argv, "--report-only", "--results-md", str(tmp_path / "R.md")])
    section = (tmp_path / "R.md").read_text()
    assert "## e2e · qwen1.5b · H100 · T2" in section
    assert "| lethe | 64 | 1024 | e2e_output_tok_s | 150 | 100 (fa3) | 1.5 |" in section


def test_a_call_cut_short_keeps_the_policies_it_finished(tmp_path, monkeypatch):
    def measure(args, policy, prompts, info):
        if policy == "vanilla@flashinfer":
            raise KeyboardInterrupt  # the call's time limit, mid-run
        return e2e.PolicyRun(policy, "H100", "0.5.17", info.date, 100.0, 0, [], [[1]], "fa3")

    monkeypatch.setattr(e2e, "measure_policy", measure)
    argv = ["--shape", "qwen1.5b", "--out-dir", str(tmp_path), "--requests=2", "--input-len=4"]
    with pytest.raises(KeyboardInterrupt):
        e2e.main([*argv, "--policies", "vanilla@fa3,vanilla@flashinfer"])
    [saved] = tmp_path.glob("e2e-partial-*")  # the call's own directory, without --partial-dir
    results = tmp_path / "R.md"
    e2e.main([*argv, "--partial-dir", str(saved), "--report-only", "--results-md", str(results)])
    assert "| vanilla@fa3 | 2 | 4 | e2e_output_tok_s | 100 | 100 (fa3) | 1 |" in results.read_text()


def test_a_parallel_run_compares_each_policys_greedy_tokens_with_its_one_gpu_run(tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    base = ["--shape", "qwen1.5b", "--partial-dir", str(partial), "--out-dir", str(tmp_path)]
    one_gpu, tp2 = (e2e.build_parser().parse_args(argv) for argv in (base, [*base, "--tp", "2"]))
    for policy, greedy_one, greedy_tp2 in (
        ("vanilla@fa3", [[1], [2]], [[1], [2]]),
        ("lethe", [[3, 1, 2], [4, 4]], [[3, 1, 9], [4, 4]]),
        ("delta", [[6]], None),  # not run in parallel
    ):
        e2e.PolicyRun(policy, "H100", "0.5.17", "T", 1.0, 0, [], greedy_one, "fa3").save(
            e2e.partial_path(one_gpu, policy)
        )
        if greedy_tp2 is not None:
            e2e.PolicyRun(policy, "H100", "0.5.17", "T", 1.0, 0, [], greedy_tp2, "fa3").save(
                e2e.partial_path(tp2, policy)
            )
    assert [run.policy for run in e2e.saved_runs(tp2)] == ["vanilla@fa3", "lethe"]
    info = e2e.RunInfo("H100", "0.5.17", "", "T", "")
    rows = e2e.single_gpu_match_rows(info, tp2, e2e.saved_runs(tp2))
    by_metric = {(row.metric, row.policy): row.value for row in rows}
    identical = "greedy_64_tokens_identical_to_one_gpu_frac"
    prefix = "greedy_64_tokens_common_prefix_with_one_gpu"
    assert by_metric == {
        (identical, "vanilla@fa3"): 1.0, (identical, "lethe"): 0.5,
        (prefix, "vanilla@fa3"): 1.0, (prefix, "lethe"): 2.0,  # 2 of [3, 1, 2], both of [4, 4]
    }  # fmt: skip
    assert not e2e.single_gpu_match_rows(info, one_gpu, e2e.saved_runs(one_gpu))


def test_parallel_sizes_name_the_run_and_reach_the_engine():
    args = e2e.build_parser().parse_args(["--shape", "qwen1.5b", "--tp", "2", "--dp", "2"])
    assert harness.run_label(args) == "qwen1.5b-tp2-dp2"
    argv = e2e.server_argv(args, "lethe", 1)
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--dp-size") + 1] == "2"
    one_gpu = e2e.build_parser().parse_args(["--shape", "smol"])
    assert "--dp-size" not in e2e.server_argv(one_gpu, "lethe", 1)


def test_report_only_refuses_saved_runs_of_two_devices(tmp_path):
    argv = ["--shape", "qwen1.5b", "--partial-dir", str(tmp_path), "--out-dir", str(tmp_path)]
    args = e2e.build_parser().parse_args(argv)
    for policy, device in (("vanilla@fa3", "H100"), ("lethe", "H200")):
        e2e.PolicyRun(policy, device, "0.5.17", "T", 1.0, 0, [], [], "fa3").save(e2e.partial_path(args, policy))
    with pytest.raises(SystemExit, match="not one device"):
        e2e.main([*argv, "--report-only"])


def test_a_decode_steps_floor_reads_the_weights_once_and_each_attended_tokens_kv_once():
    result = {"weight_bytes": 3e9, "kv_bytes_per_token": 28672, "attended_tokens": {"32768": 4096.0}}
    floor = decode_step.floor_latency_s(result, 32, 32768, copy_bytes_per_s=2e12)
    assert floor == pytest.approx((3e9 + 32 * 4096 * 28672) / 2e12)


def test_each_measured_decode_step_point_is_judged_against_its_floor():
    args = decode_step.build_parser().parse_args(
        ["--shape", "qwen1.5b", "--batch", "2", "--context", "100,5000"]
    )
    result = {
        "runs": [{"batch_size": 2, "input_len": 100, "median_decode_latency": 0.01}],
        "kv_capacity_tokens": 1000, "backend_flag": "flashinfer", "weight_bytes": 1e9,
        "kv_bytes_per_token": 1000, "attended_tokens": {"100": 100.0, "5000": 1100.0},
    }  # fmt: skip
    rows = decode_step.policy_rows(args, harness.RunInfo.detect(), "delta", result, 1e12)
    found = {(r.context, r.metric): r for r in rows}
    floor = found[100, "decode_step_floor_latency_s"].value
    assert floor == pytest.approx((1e9 + 2 * 100 * 1000) / 1e12)
    assert found[100, "decode_step_latency_over_floor"].value == pytest.approx(0.01 / floor)
    # a point that did not fit is skipped, with no floor to compare against
    assert found[5000, "decode_step_latency_s"].skipped and (5000, "decode_step_floor_latency_s") not in found


def test_a_decode_steps_ideal_is_the_fastest_vanillas_step_less_the_kv_a_policy_skips():
    def rows(policy, batch, latency, floor):
        return [
            harness.Row("decode_step", policy, "qwen1.5b", batch, 32768, metric, value)
            for metric, value in (("decode_step_latency_s", latency),
                                  ("decode_step_floor_latency_s", floor))
        ]  # fmt: skip

    measured = [
        *rows("vanilla@fa3", 32, 12.8, 11.2),  # 1.6 beyond its bytes
        *rows("vanilla@triton", 32, 14.5, 11.2),  # slower: not the reference
        *rows("delta", 32, 5.6, 3.2),
        *rows("delta", 64, 8.0, 5.3),  # no vanilla at this point: no ideal
        harness.Row("decode_step", "tidal", "qwen1.5b", 32, 32768, "decode_step_latency_s", None),
    ]
    ideal = decode_step.ideal_rows(measured)
    harness.add_baseline_ratios(ideal)
    found = {(r.policy, r.batch): r for r in ideal}
    assert set(found) == {("vanilla@fa3", 32), ("vanilla@triton", 32), ("delta", 32)}
    assert found["vanilla@fa3", 32].value == pytest.approx(12.8)
    assert found["delta", 32].value == pytest.approx(12.8 - 11.2 + 3.2)
    assert found["delta", 32].ratio == pytest.approx(4.8 / 12.8)  # within reach: 2.67x
    assert all(r.metric == decode_step.IDEAL_METRIC for r in ideal)


def test_a_decode_step_run_split_over_calls_reports_every_saved_policy_against_vanilla(
    tmp_path, monkeypatch
):
    import json

    latency = {"vanilla@fa3": 0.012, "vanilla@triton": 0.016, "delta": 0.004}

    def measured(args, policy, log_path):
        return {
            "runs": [{"batch_size": 2, "input_len": 100, "median_decode_latency": latency[policy]}],
            "kv_capacity_tokens": 1000, "backend_flag": "fa3", "attention_backend": "B", "weight_bytes": 1e9,
            "kv_bytes_per_token": 1000, "attended_tokens": {"100": 100.0}, "copy_bytes_per_s": 1e12,
        }  # fmt: skip

    monkeypatch.setattr(decode_step, "run_policy", measured)
    common = ["--shape", "qwen1.5b", "--batch", "2", "--context", "100",
              "--partial-dir", str(tmp_path / "partial"), "--results-md", str(tmp_path / "R.md")]  # fmt: skip
    decode_step.main([*common, "--policies", "vanilla@fa3,vanilla@triton", "--out-dir", str(tmp_path / "a")])
    # other points are another run: not reported with this one
    decode_step.main([*common[:4], "--context", "200", *common[6:], "--policies", "delta",
                      "--out-dir", str(tmp_path / "other")])  # fmt: skip
    decode_step.main([*common, "--policies", "delta", "--out-dir", str(tmp_path / "b")])

    (rows_file,) = (tmp_path / "b").glob("decode_step-*.json")
    every_row = json.loads(rows_file.read_text())
    budgets = {policy: harness.policy_budget(policy, None) for policy in latency}
    assert_rows_schema(every_row, "decode_step", kv_sources={"real"}, budgets=budgets)
    assert budgets["delta"] == "64 pages"
    rows = [r for r in every_row if r["metric"] == "decode_step_latency_s"]
    by_policy = {r["policy"]: r for r in rows}
    assert set(by_policy) == {"vanilla@fa3", "vanilla@triton", "delta"}
    assert by_policy["delta"]["baseline_value"] == 0.012
    assert by_policy["delta"]["ratio"] == pytest.approx(0.004 / 0.012)


def test_a_profile_gives_each_kernels_time_per_step_and_sums_the_rest(tmp_path):
    import gzip
    import json

    # two steps (listed out of order): 2 + 3 µs idle inside the first, 1 inside the second, and
    # 200 µs of host work between them
    events = [
        {"cat": "kernel", "name": "_stage1", "ts": 220.5, "dur": 7.0, "args": {"grid": [1, 2, 64]}},
        {"cat": "kernel", "name": "void flashinfer::BatchDecodeKernel<128u>(float*)", "ts": 0,
         "dur": 10.0},
        {"cat": "kernel", "name": "_stage1", "ts": 12, "dur": 5.0, "args": {"grid": [1, 2, 64]}},
        {"cat": "kernel", "name": "_stage1", "ts": 20, "dur": 0.5, "args": {"grid": [1, 2, 8]}},
        {"cat": "kernel", "name": "_scores_kernel", "ts": 228.5, "dur": 1.0,
         "args": {"grid": [1, 128, 1]}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 30, "dur": 99.0},  # host time is not GPU's
    ]  # fmt: skip
    trace = tmp_path / "p_batch1_input32768_output8_decode.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    kernels = decode_profile.kernel_events(trace)
    times = decode_profile.kernel_times_us(kernels)
    # one kernel under two grids (whole cache, selected pages) is split by grid
    split = {"_stage1[1,2,64]", "_stage1[1,2,8]"}
    assert set(times) == {"BatchDecodeKernel", "_scores_kernel", *split}
    point = dict(bench="decode_profile", policy="delta", model_shape="s", batch=1, context=32768)
    info = harness.RunInfo("GPU", "0.5.17", "2.11", "2026-11-24", "cmd")
    rows = {r.metric: r.value for r in decode_profile.profile_rows(point, kernels, 2, 1, info)}
    assert rows == pytest.approx({
        "kernel_ms:_stage1[1,2,64]": 0.006, "kernel_ms:(other)": 0.00575,
        "kernels_per_step": 2.5, "gpu_busy_ms": 0.01175, "gpu_idle_in_step_ms": 0.003,
        "host_gap_ms": 0.2,
    })  # fmt: skip


def test_a_running_servers_profile_counts_only_its_whole_graph_steps(tmp_path, monkeypatch):
    import gzip
    import json

    def kernel(name, ts, dur, correlation):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": correlation}}  # fmt: skip

    def replay(correlation):
        return {"cat": "cuda_runtime", "name": "cudaGraphLaunch",
                "args": {"correlation": correlation}}  # fmt: skip

    # started mid-step (the tail of a replay, 1) and stopped mid-step (replay 3 cut short);
    # each step: a planning kernel launched eagerly (0, 10, 20: not in a graph), then its graph
    events = [
        kernel("attn", 0.0, 4.0, 1), kernel("plan", 100.0, 2.0, 90), replay(2), replay(3),
        kernel("attn", 110.0, 5.0, 2), kernel("mlp", 116.0, 3.0, 2),
        kernel("plan", 200.0, 2.0, 91), kernel("attn", 210.0, 5.0, 3),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 120.0, "dur": 50.0},
    ]  # fmt: skip
    traces = tmp_path / "traces"
    traces.mkdir()
    with gzip.open(traces / "e2e-1.5-TP-0.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    kernels, steps = decode_profile.whole_graph_steps(decode_profile.trace_events(
        traces / "e2e-1.5-TP-0.trace.json.gz"
    ))  # fmt: skip
    # one whole period: from replay 2's first kernel to replay 3's, the next step's plan inside
    assert steps == 1 and [k["ts"] for k in kernels] == [110.0, 116.0, 200.0]
    posted = []
    response = SimpleNamespace(raise_for_status=lambda: None)
    monkeypatch.setattr(
        e2e.requests, "post", lambda url, json, timeout: posted.append((url, json)) or response
    )
    profiler = e2e.StepProfiler("http://s", at_step=8, steps=4, trace_dir=traces)
    assert profiler.result(top=2) == {}  # not started
    for decode_steps, running in ((3, 5), (9, 7), (12, 7)):
        profiler(e2e.KvSample(0.0, 0, running, decode_steps, 0))
    assert [(url, body["num_steps"]) for url, body in posted] == [("http://s/start_profile", 4)]
    assert posted[0][1]["with_stack"] is False  # Python stacks only when asked
    # a trace still being written is read once it is whole
    written = (traces / "e2e-1.5-TP-0.trace.json.gz").read_bytes()
    (traces / "e2e-1.5-TP-0.trace.json.gz").write_bytes(written[: len(written) // 2])

    waits = []

    def finish_writing(seconds):  # the writer finishes during the second wait
        waits.append(seconds)
        if len(waits) == 2:
            (traces / "e2e-1.5-TP-0.trace.json.gz").write_bytes(written)

    monkeypatch.setattr(e2e.time, "sleep", finish_writing)
    metrics = profiler.result(top=1)
    assert metrics == pytest.approx({
        "kernel_ms:attn": 0.005, "kernel_ms:(other)": 0.005, "kernels_per_step": 3.0,
        "gpu_busy_ms": 0.010, "gpu_idle_in_step_ms": 0.001, "host_gap_ms": 0.081,
        "profiled_steps": 1.0, "profiled_running": 7.0,
    })  # fmt: skip


def test_host_step_times_the_adapters_work_for_each_policy_and_batch(tmp_path):
    out = tmp_path / "out"
    host_step.main([
        "--policies", "full,delta,tidal", "--batch", "1,3", "--steps", "2",
        "--out-dir", str(out), "--results-md", str(tmp_path / "RESULTS.md"),
    ])  # fmt: skip
    import json

    (rows_file,) = out.glob("host_step-*.json")
    rows = json.loads(rows_file.read_text())
    assert sorted((r["policy"], r["batch"]) for r in rows) == [
        (p, b) for p in ("delta", "full", "tidal") for b in (1, 3)
    ]
    # host work alone: no engine, no KV, no vanilla to compare with
    budgets = {"delta": "64 pages", "tidal": harness.policy_budget("tidal", None), "full": ""}
    assert_rows_schema(rows, "host_step", kv_sources={"synthetic"}, engine=False, budgets=budgets)
    assert all(r["baseline_value"] is None and r["attention_backend"] == "" for r in rows)
    assert all(r["metric"] == "host_step_ms" and r["value"] > 0 for r in rows)
    assert {(r["model_shape"], r["context"]) for r in rows} == {("qwen1.5b", host_step.CONTEXT)}


def test_a_mixed_decode_step_batch_names_the_members_in_turn():
    from benchmarks.decode_step_child import name_requests

    shared = SimpleNamespace(custom_params=None)  # one_batch's requests share one object
    reqs = [SimpleNamespace(sampling_params=shared) for _ in range(5)]
    name_requests(reqs, ["lethe", "delta"])
    names = [r.sampling_params.custom_params["kv_policy"]["name"] for r in reqs]
    assert names == ["lethe", "delta", "lethe", "delta", "lethe"]
    alone = [SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None))]
    name_requests(alone, [])
    assert alone[0].sampling_params.custom_params is None


def test_host_timing_splits_a_step_at_its_graph_launch_and_profiles_the_other_steps(tmp_path):
    import json
    import time

    from benchmarks import decode_host
    from benchmarks.host_timing import WARMUP_CALLS, DecodeHostTimer

    class GraphRunner:
        def load_batch(self):
            time.sleep(0.002)  # host work before the launch

    class BenchRunner:
        def decode(self, next_token_ids, batch):
            GraphRunner().load_batch()
            time.sleep(0.001)  # after the launch
            return next_token_ids, None

    gpu = []
    timer = DecodeHostTimer()
    one_batch = SimpleNamespace(_TorchBenchRunner=BenchRunner)
    timer.install(one_batch, GraphRunner, synchronize=lambda: (time.sleep(0.003), gpu.append(1)))
    batch = SimpleNamespace(reqs=[SimpleNamespace(origin_input_ids=[0] * 7)] * 2)
    steps = 6
    for _ in range(WARMUP_CALLS + steps):
        assert one_batch._TorchBenchRunner().decode(5, batch) == (5, None)
    timer.write(tmp_path / "timing.json")

    point = json.loads((tmp_path / "timing.json").read_text())["2,7"]
    assert len(gpu) == steps // 2  # only the timed steps wait for the GPU
    assert 2 <= point["host_to_launch_ms"] < point["host_call_ms"] < point["step_ms"]
    assert point["step_ms"] - point["host_call_ms"] >= 3
    functions = dict(point["functions"])
    assert 2 <= functions["tests/test_bench_rows.load_batch"] < functions["tests/test_bench_rows.decode"]
    assert "load_batch" in (tmp_path / "timing-b2-c7.txt").read_text()

    info = harness.RunInfo.detect()
    rows = decode_host.point_rows(dict(bench="decode_host", policy="delta", model_shape="s",
                                       batch=2, context=7), point, 1, info)  # fmt: skip
    assert [r.metric for r in rows] == [
        "host_latency_to_launch_ms", "host_latency_call_ms", "decode_step_latency_ms",
        "host_ms:tests/test_bench_rows.decode",
    ]  # fmt: skip


def test_decode_step_rounds_alternate_the_order_and_report_the_median_and_spread(
    tmp_path, monkeypatch
):
    import json

    order, latency = [], {"vanilla@fa3": [0.012, 0.013, 0.011], "delta": [0.005, 0.004, 0.006]}

    def measured(args, policy, log_path):
        order.append(policy)
        return {
            "runs": [{"batch_size": 2, "input_len": 100,
                      "median_decode_latency": latency[policy][order.count(policy) - 1]}],
            "kv_capacity_tokens": 1000, "backend_flag": "fa3", "attention_backend": "B",
            "weight_bytes": 1e9, "kv_bytes_per_token": 1000, "attended_tokens": {"100": 100.0},
            "copy_bytes_per_s": 1e12 * order.count(policy),
        }  # fmt: skip

    monkeypatch.setattr(decode_step, "run_policy", measured)
    decode_step.main(["--shape", "qwen1.5b", "--batch", "2", "--context", "100", "--rounds", "3",
                      "--policies", "vanilla@fa3,delta", "--out-dir", str(tmp_path),
                      "--results-md", str(tmp_path / "R.md")])  # fmt: skip
    assert order == ["vanilla@fa3", "delta", "delta", "vanilla@fa3", "vanilla@fa3", "delta"]
    (rows_file,) = tmp_path.glob("decode_step-*.json")
    rows = json.loads(rows_file.read_text())
    budgets = {policy: harness.policy_budget(policy, None) for policy in latency}
    assert_rows_schema(rows, "decode_step", kv_sources={"real"}, budgets=budgets)
    found = {(r["policy"], r["metric"]): r for r in rows}
    assert found["delta", "decode_step_latency_s"]["value"] == 0.005  # the median round
    assert found["delta", "decode_step_latency_s"]["ratio"] == pytest.approx(0.005 / 0.012)
    assert found["delta", "decode_step_rounds_max_over_min"]["value"] == pytest.approx(1.5)
    # the floor at the best bandwidth any process measured
    floor = found["delta", "decode_step_floor_latency_s"]["value"]
    assert floor == pytest.approx((1e9 + 2 * 100 * 1000) / 3e12)


def test_decode_step_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        decode_step.build_parser().parse_args(["--shape", "qwen1.5b", "--rounds", "0"])
    with pytest.raises(SystemExit):  # the benchmarks that run each policy once do not take it
        decode_profile.build_parser().parse_args(["--shape", "qwen1.5b", "--rounds", "2"])


def test_e2e_warms_up_with_several_reversed_prompts_at_once_before_the_clock(monkeypatch):
    prompts = [[i, i + 1, i + 2] for i in range(0, 30, 3)]
    together = threading.Barrier(e2e.WARMUP_REQUESTS, timeout=10)  # broken if sent one by one
    sent = []

    def generate(url, ids, output_len, kv_policy=None):
        if output_len == 4:
            together.wait()
        sent.append((ids, output_len))
        return e2e.Generated([0] * output_len, [float(len(ids))] * output_len)

    class NoSampler:
        samples = []

        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(e2e, "generate", generate)
    monkeypatch.setattr(e2e, "KvSampler", NoSampler)
    _, _, attended = e2e.measure("http://x", prompts, 8, 0.05)
    assert attended == 3.0  # the measured requests' steps only, not the warm-up's
    warmup, measured = sent[: e2e.WARMUP_REQUESTS], sent[e2e.WARMUP_REQUESTS :]
    assert sorted(ids for ids, _ in warmup) == sorted(p[::-1] for p in prompts[:4])
    assert {n for _, n in warmup} == {4} and sorted(ids for ids, _ in measured) == prompts


def test_generate_reads_what_the_policy_attended_at_each_step(monkeypatch):
    class Response:
        def __init__(self, meta_info):
            self.meta_info = meta_info

        def raise_for_status(self):
            pass

        def json(self):
            return {"output_ids": [5, 6, 7], "meta_info": self.meta_info}

    served = {"kv_attended_tokens": [None, 1024.0, 1040.5]}  # the prefill's entry has none
    monkeypatch.setattr(e2e.requests, "post", lambda *a, **k: Response(served))
    out = e2e.generate("http://x", [1, 2], 3, "delta")
    assert out == e2e.Generated([5, 6, 7], [1024.0, 1040.5])
    monkeypatch.setattr(e2e.requests, "post", lambda *a, **k: Response({}))  # vanilla SGLang
    assert e2e.generate("http://x", [1, 2], 3).attended == []


def test_the_ideal_step_is_each_run_on_the_fastest_vanillas_line_at_what_it_attends():
    argv = ["--shape", "qwen1.5b", "--requests", "4", "--input-len", "1024", "--output-len", "2049"]
    args = e2e.build_parser().parse_args(argv)

    def run(policy, tok_s, curve=None, full_batch=4, attended=None):
        samples = [e2e.KvSample(1.0, 0, full_batch, 1, 1)]  # the most requests running at once
        return e2e.PolicyRun(
            policy, "H100", "0.5.17", "T", tok_s, 0, samples, [], "fa3",
            step_curve=curve, mean_attended=attended,
        )  # fmt: skip

    runs = [
        run("vanilla@fa3", 100.0, (2.0, 0.5)),
        run("vanilla@triton", 50.0, (4.0, 1.0)),  # slower: not the line
        run("delta", 180.0, (2.5, 0.1), attended=512.0),
        run("tidal", 170.0, (2.5, 0.1), attended=None),  # no reports: no row
        run("lethe", 150.0, (2.0, 0.2), full_batch=3, attended=256.0),  # not all at once
    ]
    rows = e2e.ideal_step_rows(args, runs)
    harness.add_baseline_ratios(rows)
    ideal = {row.policy: row for row in rows}
    assert set(ideal) == {"vanilla@fa3", "vanilla@triton", "delta"}
    # vanilla attends 1024 + 1024 tokens on average: 2 + 0.5 * 2 = 3 ms; DELTA 2 + 0.5 / 2
    assert ideal["vanilla@fa3"].value == pytest.approx(3.0)
    assert ideal["delta"].value == pytest.approx(2.25)
    assert ideal["delta"].ratio == pytest.approx(2.25 / 3.0)  # 1 / the speed-up it could reach
    # a vanilla that did not decode the whole batch at once gives no line
    runs[0].samples = runs[1].samples = [e2e.KvSample(1.0, 0, 2, 1, 1)]
    assert e2e.ideal_step_rows(args, runs) == []


def test_a_trace_benchmark_on_a_gpu_host_names_the_cpu_it_computed_on(monkeypatch):
    # a GPU host cannot be had here: its two probes stand in for one
    monkeypatch.setattr(harness.cpu, "is_cuda_host", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda index: "NVIDIA H200")
    assert harness.RunInfo.detect().device == "NVIDIA H200"
    assert re.fullmatch(r"CPU .+ \(\d+ cores\)", harness.RunInfo.detect(on_cpu=True).device)


def test_a_cpu_run_that_forces_an_instruction_set_says_so_in_its_device(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("MKL_CBWR", raising=False)
    left_alone = harness.device_name(on_cpu=True)
    assert "MKL_CBWR" not in left_alone
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    forced = harness.device_name(on_cpu=True)
    assert forced == f"{left_alone} MKL_CBWR=AVX2"
