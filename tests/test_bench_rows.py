"""What benchmark rows say about a run: each policy's budget, which server a NAME@BACKEND starts,
and which vanilla run a policy's greedy tokens are compared with."""

from benchmarks import e2e, harness


def test_rows_name_each_policys_budget_from_its_config():
    assert harness.policy_budget("delta", None) == "64 pages"
    assert harness.policy_budget("tidal", '{"budget_tokens": 64}') == "64 tokens"
    assert harness.policy_budget("delta+art", None) == "64 pages"  # ART reads within DELTA's
    assert harness.policy_budget("lethe", None) == "max_kv_ratio 0.3, evict_threshold 1024"
    assert harness.policy_budget("full", None) == ""
    assert harness.policy_budget("vanilla@fa3", None) == ""


def test_e2e_starts_vanilla_sglang_or_the_launcher_by_the_name_before_the_backend():
    args = e2e.build_parser().parse_args(["--shape", "qwen1.5b"])
    vanilla = e2e.server_argv(args, "vanilla@triton", 30000)
    policy = e2e.server_argv(args, "delta@triton", 30000)
    assert vanilla[1:3] == ["-m", "sglang.launch_server"] and "--policy" not in vanilla
    assert policy[1:5] == ["-m", "sglang_ext.launch", "--policy", "delta"]


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
