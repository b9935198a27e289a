"""One policy's run of SGLang's offline one-batch benchmark, in a fresh process so that no plugin
state leaks between policies. Started by benchmarks.decode_step:

    python -m benchmarks.decode_step_child --policy NAME [--policy-config JSON] --result-json PATH
        [--prefill-slice-tokens N] -- <sglang.benchmark.one_batch flags>

``--policy vanilla`` leaves SGLang untouched. The result JSON holds one_batch's measurements, the
KV pool's capacity in tokens (to explain skipped points), the attention backend that decoded, and
what a decode step's bandwidth floor needs (benchmarks.decode_step): the weights' and a token's KV
bytes, the tokens the policy attends to at each --contexts length, and the device's copy bandwidth.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import tempfile
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import VANILLA
from sglang_ext.launch import flag_value
from sglang_ext.platform import cpu


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_step_child")
    parser.add_argument("--policy", required=True)
    parser.add_argument("--policy-config", default=None)
    parser.add_argument("--result-json", type=Path, required=True)
    parser.add_argument("--prefill-slice-tokens", type=int, default=16384)
    parser.add_argument(
        "--skip-prefill-compute",
        action="store_true",
        help="allocate the prompts' KV slots without running the prefill forward (KV keeps the "
        "pool's initial contents): decode reads the same bytes, minutes of prefill are saved",
    )
    parser.add_argument(
        "--contexts", default="", help="comma-separated lengths to report attended tokens at"
    )
    parser.add_argument(
        "--request-policies", default="",
        help="comma-separated policy names the batch's requests name in turn (a server of several)",
    )  # fmt: skip
    parser.add_argument(
        "--host-timing", type=Path, default=None,
        help="write the decode steps' host time here (benchmarks.host_timing)",
    )  # fmt: skip
    parser.add_argument("one_batch_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    one_batch_args = (
        args.one_batch_args[1:] if args.one_batch_args[:1] == ["--"] else args.one_batch_args
    )

    cpu.activate()
    if args.policy != VANILLA:
        _load_policy_plugin(args.policy, args.policy_config)

    from sglang.benchmark import one_batch

    # before the model and KV pool take the memory its buffers need
    copy_bandwidth = harness.copy_bytes_per_s(flag_value(one_batch_args, "--device", "cuda"))
    contexts = [int(c) for c in args.contexts.split(",") if c]
    names = [name for name in args.request_policies.split(",") if name]
    engine = _patch_one_batch(
        one_batch, args.prefill_slice_tokens, args.skip_prefill_compute, contexts, names
    )
    host_timer = None
    if args.host_timing is not None:
        from benchmarks.host_timing import DecodeHostTimer

        host_timer = DecodeHostTimer()
        host_timer.install(one_batch)
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "one_batch.jsonl"
        sys.argv = ["one_batch", *one_batch_args, "--result-filename", str(jsonl)]
        one_batch.cli_main()
        runs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    if host_timer is not None:
        host_timer.write(args.host_timing)

    if engine.pop("is_policy_backend") != (args.policy != VANILLA):
        raise SystemExit(f"policy {args.policy!r} decoded with {engine['attention_backend']}")
    engine["copy_bytes_per_s"] = copy_bandwidth
    args.result_json.write_text(json.dumps({**engine, "runs": runs}))


def _load_policy_plugin(name: str, config: str | None) -> None:
    from sglang.srt.plugins import load_plugins

    from sglang_ext import engine
    from sglang_ext.config import export_policy, policy_from_flags

    policy = policy_from_flags(name, config)
    export_policy(policy)
    load_plugins()
    # load_plugins() finds sglang_ext only through an installed entry point; one_batch runs the
    # model in this process, so installing directly also serves a PYTHONPATH-only checkout.
    engine.install(policy, apply=True)


def _patch_one_batch(
    one_batch, slice_tokens: int, skip_prefill_compute: bool, contexts: list[int],
    request_policies: list[str],
) -> dict:
    """Adapt one_batch to dummy-weight shapes and long contexts, its requests naming
    ``request_policies`` in turn; returns a dict that fills with the engine's KV capacity,
    attention backend and bytes read per step once the model is loaded."""
    import torch

    from sglang_ext.engine.backends import PolicyDispatchMixin

    engine: dict = {}
    load_model = one_batch.load_model

    def load_model_and_record(*args, **kwargs):
        runner, tokenizer = load_model(*args, **kwargs)
        engine["kv_capacity_tokens"] = runner.torch_runner.max_total_num_tokens
        backend = runner.torch_runner.attn_backend
        engine["attention_backend"] = type(backend).__name__
        engine["is_policy_backend"] = isinstance(backend, PolicyDispatchMixin)
        engine.update(_bytes_read(runner.torch_runner, contexts))
        return runner, tokenizer

    def extend_in_slices(self, reqs):
        """one_batch prefills the whole batch in one forward pass, whose MLP activations at
        64 x 16k tokens outgrow an 80 GB GPU. Prefill whole requests in slices of at most
        ``slice_tokens`` tokens and merge them into one decode batch, as SGLang's scheduler
        merges prefilled requests into its running batch."""
        name_requests(reqs, request_policies)
        next_ids, batch, start = [], None, 0
        while start < len(reqs):
            end, tokens = start, 0
            while end < len(reqs) and (
                end == start or tokens + len(reqs[end].origin_input_ids) <= slice_tokens
            ):
                tokens += len(reqs[end].origin_input_ids)
                end += 1
            ids, _, part = extend(reqs[start:end], self.torch_runner)
            next_ids.append(ids)
            if batch is None:
                batch = part
            else:
                batch.merge_batch(part)
            start = end
        return torch.cat(next_ids), None, batch

    def extend(reqs, runner):
        if not skip_prefill_compute:
            return one_batch.extend(reqs, runner)
        runner.forward = functools.partial(_no_prefill_forward, runner)
        try:
            return one_batch.extend(reqs, runner)
        finally:
            del runner.forward  # the class's forward again

    one_batch.load_model = load_model_and_record
    one_batch._TorchBenchRunner.extend = extend_in_slices
    # Synthetic input ids need no tokenizer, and the shape folders ship none.
    one_batch.get_tokenizer = lambda *args, **kwargs: None
    return engine


def name_requests(reqs, names: list[str]) -> None:
    """Request i names ``names[i % len]`` (``custom_params.kv_policy``), as e2e's requests do on
    a server of several policies; none named leaves every request on the server's default."""
    for i, req in enumerate(reqs if names else []):
        # one_batch gives every request the same SamplingParams object
        req.sampling_params = copy.copy(req.sampling_params)
        req.sampling_params.custom_params = {"kv_policy": {"name": names[i % len(names)]}}


def _bytes_read(model_runner, contexts: list[int]) -> dict:
    """The weights' bytes, one token's K and V bytes over all layers, and the tokens a decode step
    of one request attends to at each context (the served policy's own count; all for vanilla)."""
    pool = model_runner.token_to_kv_pool
    layers = range(pool.start_layer, pool.start_layer + pool.layer_num)
    kv_bytes = sum(
        pool.get_key_buffer(i)[0].nbytes + pool.get_value_buffer(i)[0].nbytes for i in layers
    )
    policy = getattr(model_runner.attn_backend, "kv_policy", None)
    num_layers = model_runner.model_config.num_hidden_layers
    attended = {
        str(c): policy.attended_tokens(c, num_layers) if policy is not None else float(c)
        for c in contexts
    }
    return {
        "weight_bytes": sum(p.numel() * p.element_size() for p in model_runner.model.parameters()),
        "kv_bytes_per_token": kv_bytes,
        "attended_tokens": attended,
    }


def _no_prefill_forward(runner, forward_batch, *args, **kwargs):
    """A prefill forward's output without its compute: zero logits for each request's last token."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    vocab = runner.model_config.vocab_size
    logits = torch.zeros(forward_batch.batch_size, vocab, device=runner.device)
    return ModelRunnerOutput(LogitsProcessorOutput(next_token_logits=logits), can_run_graph=False)


if __name__ == "__main__":
    main()
