import dataclasses
from types import SimpleNamespace

import pytest
import torch
from sglang_ext.policies import (
    DecodeContext,
    KVPolicy,
    PolicyConfigError,
    build_policy,
    policy_class,
    policy_names,
    registry,
)
from sglang_ext.policies.build import composition_names
from sglang_ext.policies.context import DecodeInputs, DecodeProgram


@dataclasses.dataclass(frozen=True)
class BudgetPolicy(KVPolicy):
    name = "budget-test"
    budget: int = 64
    ratio: float = 0.3
    layers: list[int] = dataclasses.field(default_factory=lambda: [2])

    def validate(self):
        if self.budget < 1:
            raise PolicyConfigError(f"{self.name}.budget", f"must be >= 1, got {self.budget}")


@pytest.fixture
def with_budget_policy(monkeypatch):
    monkeypatch.setitem(registry._POLICIES, BudgetPolicy.name, BudgetPolicy)


def test_full_is_registered_and_takes_no_parameters():
    assert "full" in policy_names()
    assert build_policy("full").describe() == {"name": "full"}
    with pytest.raises(PolicyConfigError) as err:
        build_policy("full", {"budget": 1})
    assert err.value.field == "full.budget"
    assert "takes no parameters" in str(err.value)


def test_the_compositions_served_are_those_that_build():
    names = composition_names()
    composed = {"lethe+tidal", "lethe+delta", "snapkv+tidal", "tova+delta", "h2o+tidal"}
    assert composed | {"delta+art", "tidal+art", "full+art"} <= set(names)
    # one the wrong way round, a selection over a selection
    assert not {"tidal+lethe", "delta+tidal"} & set(names)
    for name in ("lethe", "snapkv"):  # a selection over per-layer lists
        with pytest.raises(PolicyConfigError) as err:
            build_policy(f"{name}+tidal", {"per_layer": True})
        assert err.value.field == f"{name}.per_layer"


def test_unknown_policy_names_the_valid_choices():
    with pytest.raises(PolicyConfigError) as err:
        build_policy("nope")
    assert err.value.field == "policy"
    assert "full" in err.value.choices
    assert "'nope'" in str(err.value)


def test_duplicate_registration_is_refused(with_budget_policy):
    other = dataclasses.make_dataclass("Other", [], bases=(KVPolicy,), frozen=True)
    other.name = BudgetPolicy.name
    with pytest.raises(ValueError, match="already registered"):
        registry.register_policy(other)


def test_parameters_are_set_and_described(with_budget_policy):
    policy = build_policy("budget-test", {"budget": 128, "ratio": 1, "layers": [2, 14]})
    assert policy.describe() == {"name": "budget-test", "budget": 128, "ratio": 1, "layers": [2, 14]}
    schema = BudgetPolicy.parameter_schema()
    assert schema["budget"] == {"type": "int", "default": 64}
    assert schema["layers"]["type"] == "list[int]"


@pytest.mark.parametrize(
    "params, field, fragment",
    [
        ({"bugdet": 1}, "budget-test.bugdet", "unknown parameter"),
        ({"budget": "8"}, "budget-test.budget", "expected int"),
        ({"budget": True}, "budget-test.budget", "expected int"),
        ({"budget": 1.5}, "budget-test.budget", "expected int"),
        ({"ratio": "x"}, "budget-test.ratio", "expected float"),
        ({"layers": [1, "2"]}, "budget-test.layers", "expected list[int]"),
        ({"budget": 0}, "budget-test.budget", "must be >= 1"),
    ],
)
def test_bad_parameters_name_the_field(with_budget_policy, params, field, fragment):
    with pytest.raises(PolicyConfigError) as err:
        build_policy("budget-test", params)
    assert err.value.field == field
    assert fragment in str(err.value)


def test_unknown_parameter_lists_the_valid_ones(with_budget_policy):
    with pytest.raises(PolicyConfigError) as err:
        build_policy("budget-test", {"bugdet": 1})
    assert err.value.choices == ["budget", "ratio", "layers"]


def test_policies_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        build_policy("full").name = "x"


def test_default_decode_dispatch_is_the_engine_decode_for_every_layer():
    def base(*args):
        return args

    context = DecodeContext(
        num_layers=3, base_decode=base, write_kv=None, kv_pool=None, req_to_token=None,
        max_batch_size=1, device="cpu",
    )  # fmt: skip
    program = build_policy("full").decode_program(context, DecodeInputs())
    assert program.layers == [base, base, base] and program.step_setups == ()


def test_optional_layer_lists_appear_in_the_schema():
    assert build_policy("tidal").parameter_schema()["selection_layers"] == {
        "type": "list[int] | None",
        "default": None,
    }


def test_selection_policies_take_a_token_budget_in_their_own_units():
    assert policy_class("delta").for_token_budget(1024) == {"budget_pages": 64, "recent_pages": 8}
    assert policy_class("delta").for_token_budget(100) == {"budget_pages": 6, "recent_pages": 1}
    assert policy_class("tidal").for_token_budget(256) == {"budget_tokens": 256}
    for name in ("delta", "tidal"):  # the smallest budget still builds a valid policy
        build_policy(name, policy_class(name).for_token_budget(16))


def test_a_decode_step_reserves_its_buffers_and_leaves_the_graph_when_one_cannot():
    from sglang_ext.policies.runtime import PolicyRuntime, RequestState, StepRequest

    context = DecodeContext(
        num_layers=2, base_decode=None, write_kv=None, kv_pool=None,
        req_to_token=torch.zeros(4, 8, dtype=torch.int32), max_batch_size=4, device="cpu",
    )  # fmt: skip
    asked = []

    class Reserving(PolicyRuntime):
        def build_program(self):
            reserve = lambda tokens: asked.append(tokens) or tokens <= 1000  # noqa: E731
            return DecodeProgram([None] * 2, reservations=(reserve,))

    runtime = Reserving(build_policy("full"), context)
    requests = [
        StepRequest(RequestState(None), f"r{n}", n, seq_len, 10, [], 0)
        for n, seq_len in enumerate([300, 600, 400])
    ]
    runtime.run_plan(runtime.plan_step(requests, decode=True), None, None)
    assert asked == [1300] and not runtime.graphable  # every request's tokens, shared or not
    runtime.run_plan(runtime.plan_step(requests[:2], decode=True), None, None)
    assert asked == [1300, 900] and runtime.graphable
    runtime.run_plan(runtime.plan_step(requests, decode=False), SimpleNamespace(), None)
    assert asked == [1300, 900]  # a prefill reserves nothing
