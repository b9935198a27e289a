"""What this project keeps on SGLang's scheduler ``Req``: one ``RequestState``, under one
attribute, made by the runtime at each prefill of the request; and the per-step view of a batch's
requests (``StepRequest``) that the runtime, the metrics and the report share."""

from __future__ import annotations

from sglang_ext.engine import targets
from sglang_ext.engine.backends import process_runtime
from sglang_ext.policies import KVPolicy, PolicyConfigError
from sglang_ext.policies.runtime import PolicyRuntime, RequestState, StepRequest
from sglang_ext.request_policy import request_policy

_STATE = "sglang_ext_state"  # on a Req: its RequestState
_OWN = "sglang_ext_own_policy"  # on a Req: (served policy, its own), parsed once
_SKIPS_RADIX = "sglang_ext_skips_radix_insert"  # on a Req: we set its skip_radix_cache_insert


def state_of(req) -> RequestState | None:
    return getattr(req, _STATE, None)


def own_policy(served: KVPolicy, req) -> KVPolicy | None:
    """The policy a scheduler Req asked for (``custom_params.kv_policy``), parsed once in this
    process, when the scheduler queues it (``refuse_unusable``). Raises PolicyConfigError."""
    cached = getattr(req, _OWN, None)
    if cached is not None and cached[0] is served:
        return cached[1]
    own = request_policy(served, req.sampling_params.custom_params)
    setattr(req, _OWN, (served, own))
    return own


def refuse_unusable(scheduler, req, *args, **kwargs):
    """Before the scheduler queues a request: a ``kv_policy`` it cannot serve (one that got past
    the HTTP process's check: an engine used without it, or a spec made for another server) ends
    the request with a 400 naming the field, as SGLang's own checks there do."""
    runtime = process_runtime()
    if runtime is None or getattr(req, "to_finish", None) is not None:
        return None
    try:
        own_policy(runtime.policy, req)
    except PolicyConfigError as err:
        req.set_finish_with_abort(f"sglang_ext: {err}")
        # its one-token prefill, which SGLang runs to finish it, decodes nothing
        setattr(req, _OWN, (runtime.policy, next(iter(runtime.policy.request_choices().values()))))
    return None


def register(hooks) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    hooks.register(targets.QUEUE_REQUEST, refuse_unusable, HookType.BEFORE)


def begin_prefill(runtime: PolicyRuntime, req) -> None:
    """A request being prefilled (new, next chunk, or retracted and re-run) holds every slot."""
    previous = state_of(req)
    if getattr(req, _SKIPS_RADIX, False):
        req.skip_radix_cache_insert = False
        setattr(req, _SKIPS_RADIX, False)
    setattr(req, _STATE, runtime.new_request(own_policy(runtime.policy, req), previous))


def mark_evicted(req) -> None:
    """A request that lost slots is not inserted into the radix cache at its end: its row has
    holes. One that lost none is inserted as usual."""
    state = state_of(req)
    if state is not None and state.evicted and not getattr(req, "skip_radix_cache_insert", False):
        req.skip_radix_cache_insert = True
        setattr(req, _SKIPS_RADIX, True)


def step_requests(runtime: PolicyRuntime, reqs, seq_lens: list[int]) -> list[StepRequest]:
    """The batch's requests as the runtime sees them this step, one per request, in order."""
    out = []
    for index, (req, seq_len) in enumerate(zip(reqs, seq_lens, strict=True)):
        state = getattr(req, _STATE, None)
        if state is None:  # every request is prefilled under the policy; never here
            begin_prefill(runtime, req)
            state = state_of(req)
        out.append(
            StepRequest(
                state=state, rid=req.rid, row=req.req_pool_idx, seq_len=seq_len,
                prompt_len=len(req.origin_input_ids), output_ids=req.output_ids,
                protected_len=req.cache_protected_len, index=index,
            )
        )  # fmt: skip
    return out


def held_by_running(reqs) -> int:
    """Slots evicted from the running requests that still hold KV (SGLang counts them held)."""
    return sum(
        state.evicted for req in reqs if req.kv is not None and (state := state_of(req)) is not None
    )
