"""The quality benchmark's runs: ART runs are compared with their base policy's run."""

import pytest

from benchmarks import harness
from benchmarks.quality import VARIED, policy_runs


def test_art_runs_name_their_base_run_and_keep_its_budget_config():
    runs = policy_runs(["full", "art", "delta", "delta+art"], [512])
    by_label = {run.label: run for run in runs}
    assert list(by_label) == ["full", "art", "delta-512", "delta+art-512"]
    assert by_label["art"].base_label == "full" and by_label["art"].config is None
    assert by_label["delta+art-512"].base_label == "delta-512"
    assert by_label["delta+art-512"].config == by_label["delta-512"].config
    assert by_label["delta-512"].base_label is None


@pytest.mark.parametrize("policies", [["full", "tidal+art"], ["full", "lethe+art"], ["full", "nope"]])
def test_an_art_run_without_its_base_or_an_unknown_policy_is_refused(policies):
    with pytest.raises(SystemExit, match="--policies"):
        policy_runs(policies, [512])


def test_a_variant_runs_at_each_budget_with_its_parameters_over_the_budgets():
    variants = [("delta", {"full_layers": [0], "delta_layers": [1, 4, 14, 22]})]
    runs = policy_runs(["full", "delta"], [512, 1024], variants=variants)
    changed = [run for run in runs if run.params]
    assert [run.budget for run in changed] == [512, 1024]
    assert changed[1].label == 'delta[full_layers=[0],delta_layers=[1, 4, 14, 22]]-1024'
    assert changed[1].config == {"budget_pages": 64, "recent_pages": 8, "full_layers": [0],
                                 "delta_layers": [1, 4, 14, 22]}  # fmt: skip
    assert {run.label for run in runs if not run.params} == {"full", "delta-512", "delta-1024"}


def test_a_variant_of_a_policy_the_benchmark_does_not_vary_is_refused():
    with pytest.raises(SystemExit, match="--variants"):
        policy_runs(["full", "delta"], [512], variants=[("lethe", {"max_kv_ratio": 0.5})])


def test_an_art_variant_runs_once_with_its_parameters_against_full_attention():
    variants = [harness.policy_variant("art:tau=1e-3,patience=2", VARIED)]
    runs = policy_runs(["full", "delta"], [512, 1024], variants=variants)
    (art,) = [run for run in runs if run.policy == "art"]
    assert art.budget is None and art.label == "art[tau=0.001,patience=2]"
    assert art.config == {"tau": 1e-3, "patience": 2} and art.base_label == "full"


def test_art_over_a_selection_varies_art_alone_and_is_compared_with_its_base():
    variants = [harness.policy_variant('tidal+art:art={"tau":1e-3,"patience":2}', VARIED)]
    runs = policy_runs(["full", "tidal"], [1024], variants=variants)
    (composed,) = [run for run in runs if run.policy == "tidal+art"]
    assert composed.base_label == "tidal-1024" and composed.reads_tiles
    assert composed.config == {"budget_tokens": 1024, "correction_interval": 0,
                               "art": {"tau": 1e-3, "patience": 2}}  # fmt: skip


def test_art_over_a_selection_without_its_base_run_is_refused():
    variants = [harness.policy_variant('delta+art:art={"patience":1}', VARIED)]
    with pytest.raises(SystemExit, match=r"--variants.*delta-1024"):
        policy_runs(["full", "tidal"], [1024], variants=variants)
