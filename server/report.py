"""What each request's policy did, reported with its answer.

Native ``/generate``: ``meta_info`` carries, per output token (SGLang's ``customized_info``
channel: one entry per token, accumulated over a stream), ``kv_policy`` (the policy that decoded
it: the served one, or ``full`` for a request that opted out), ``kv_retained_tokens`` (KV tokens
the request held after that step), ``kv_evicted_tokens`` (freed by eviction so far) and
``kv_attended_tokens`` (tokens attended at that step, mean over layers, before ART's early stop).
The last entries are the request's state at its end.

OpenAI ``/v1/chat/completions`` and ``/v1/completions``: the response's ``sglext`` object (SGLang's
place for extension fields) gets ``kv_policy``: {name, retained_kv_tokens, evicted_tokens,
mean_attended_tokens}, of the first choice; a stream gets it in a last chunk of its own (no
choices, as SGLang's own ``sglext`` chunk) before ``[DONE]``.

The entries come from the runtime (``PolicyRuntime.report``) after each step; the engine adapter
(``sglang_ext.engine.steps`` and ``.http``) carries them into SGLang's responses.
"""

from __future__ import annotations

from statistics import fmean

from sglang_ext.policies.runtime import RequestReport

KEYS = ("kv_policy", "kv_retained_tokens", "kv_evicted_tokens", "kv_attended_tokens")


def step_entries(reports: list[RequestReport]) -> dict[str, list]:
    """One entry per request of a batch for each of KEYS."""
    return {
        "kv_policy": [r.policy for r in reports],
        "kv_retained_tokens": [r.held for r in reports],
        "kv_evicted_tokens": [r.evicted for r in reports],
        "kv_attended_tokens": [round(r.attended, 1) for r in reports],
    }


def summary(meta_info: dict) -> dict | None:
    """A request's report in one object, from its meta_info's per-token entries."""
    if not meta_info.get("kv_policy"):
        return None
    attended = [a for a in meta_info["kv_attended_tokens"] if a is not None]
    return {
        "name": meta_info["kv_policy"][-1],
        "retained_kv_tokens": meta_info["kv_retained_tokens"][-1],
        "evicted_tokens": meta_info["kv_evicted_tokens"][-1],
        "mean_attended_tokens": round(fmean(attended), 1) if attended else None,
    }
