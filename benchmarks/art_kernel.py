"""GPU microbenchmark of ART's decode kernel against SGLang's triton decode kernel on the same
inputs: one layer's time (replayed from a CUDA graph), the fraction of KV tiles ART read, and its
output error against full attention.

    python -m benchmarks.art_kernel --shape qwen1.5b --batch 1,16,64 --context 4096,16384
    python -m benchmarks.art_kernel --shape smol --captured --lengths 4096 --batch 16

Two kinds of inputs. ``--shape``: random q/K/V of a model shape; softmax over random keys is
flat, so ART (almost) never stops there: these rows measure the detector's cost, `art` (the
probe on every tile, no stop) and `art-p0` (patience 0, the paper's p = inf: no probe, the tile
loop alone) against our split-KV kernel (`full`) and the decode kernels of SGLang's backends
(`vanilla@triton`, `vanilla@flashinfer`, `vanilla@fa3` on Hopper; the baseline is the fastest).
``--policy-config '{"tile_tokens": 64}'`` sets ART's parameters (both rows). ``--captured``:
every layer's decode query, keys and values of SmolLM2 (real weights) on a natural-text prompt
(sglang_ext.tools.attention_trace, fp32 on the CPU), cast to bf16 and repeated over the batch; the
layer times are summed over the model's layers, and `art` rows carry the tiles read and the
relative error of the output.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.harness import Row, RunInfo
from benchmarks.kernel_bench import Inputs, time_ms, vanilla_decoders

BENCH = "art_kernel"


def build_parser():
    parser = harness.common_parser(BENCH, __doc__)
    parser.add_argument("--batch", type=harness.int_list, default=[1, 16, 64])
    parser.add_argument("--context", type=harness.int_list, default=[4096, 16384])
    parser.add_argument("--kv-splits", type=int, default=8, help="of SGLang's kernel and ours")
    parser.add_argument("--captured", action="store_true", help="SmolLM2's real attention inputs")
    parser.add_argument("--lengths", type=harness.int_list, default=[4096], help="with --captured")
    parser.add_argument("--model-path", type=Path, default=None, help="with --captured")
    return parser


def art_runs(inputs: Inputs, args, art):
    """(run the ART kernel, its tiles read, its output) on ``inputs``."""
    from sglang_ext.kernels.art_decode import art_decode

    params = {**art.kernel_params(), "num_kv_splits": args.kv_splits}
    result = {}

    def run():
        result["out"], result["tiles"] = art_decode(
            *inputs.cache(), inputs.scale, **params, always_read=art.sink_tokens
        )

    return run, result


def layer_rows(inputs: Inputs, args, info, point, art, art_off) -> tuple[list[Row], dict]:
    from sglang_ext.kernels.split_kv_decode import split_kv_decode

    times = {name: time_ms(run) for name, run in vanilla_decoders(inputs, args.kv_splits).items()}
    times["full"] = time_ms(
        lambda: split_kv_decode(*inputs.cache(), inputs.scale, num_kv_splits=args.kv_splits)
    )
    off_run, _ = art_runs(inputs, args, art_off)
    times["art-p0"] = time_ms(off_run)
    run, result = art_runs(inputs, args, art)
    times["art"] = time_ms(run)
    run()
    full, _ = split_kv_decode(*inputs.cache(), inputs.scale, num_kv_splits=args.kv_splits)
    error = ((result["out"].float() - full.float()).norm(dim=-1) / full.float().norm(dim=-1)).mean()
    tiles = result["tiles"].sum().item()
    everything = inputs.batch * inputs.k.shape[1] * -(-inputs.context // art.tile_tokens)
    rows = [
        info.row(**point, policy=p, metric="layer_attention_ms", value=ms,
                 attention_backend=harness.named_backend(p))
        for p, ms in times.items()
    ]  # fmt: skip
    rows += [
        info.row(**point, policy="art", metric="tiles_read_frac", value=tiles / everything),
        info.row(**point, policy="art", metric="rel_error_mean", value=float(error)),
    ]
    return rows, times


def random_points(args, info, art, art_off) -> list[Row]:
    cfg = harness.shape_config(args.shape)
    rows = []
    for batch in args.batch:
        for context in args.context:
            point = dict(bench=BENCH, model_shape=args.shape, batch=batch, context=context)
            rows += layer_rows(Inputs(cfg, batch, context), args, info, point, art, art_off)[0]
            torch.cuda.empty_cache()
            print(f"{BENCH}: {args.shape} batch {batch} context {context} done", flush=True)
    return rows


class CapturedInputs(Inputs):
    """One traced layer's decode inputs, repeated over a batch, in bf16 on the GPU."""

    def __init__(self, q, k, v, sm_scale, batch):
        context = k.shape[0]
        self.scale, self.batch, self.context = sm_scale, batch, context
        self.q = q[None].repeat(batch, 1, 1).to("cuda", torch.bfloat16)
        self.k = torch.cat([k[:1], k.repeat(batch, 1, 1)]).to("cuda", torch.bfloat16)
        self.v = torch.cat([v[:1], v.repeat(batch, 1, 1)]).to("cuda", torch.bfloat16)
        dev = "cuda"
        self.req_to_token = torch.arange(batch * context, device=dev, dtype=torch.int32).view(batch, context) + 1
        self.rows = torch.arange(batch, device=dev)
        self.seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
        self.kv_bytes_per_token = 2 * k.shape[1] * k.shape[2] * 2


def captured_points(args, info, art, art_off) -> list[Row]:
    from transformers import AutoTokenizer

    from sglang_ext.tools import attention_trace as at
    from sglang_ext.model import default_model_path

    model_path = args.model_path or default_model_path()
    model = at.load_model(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    shape = model_path.name.lower()
    rows = []
    for length in args.lengths:
        (ids,), _ = at.natural_text_prompts(tokenizer, [length], at.SEED_TEXT_DIR)
        trace = at.trace_decode(model, ids, 1)
        seq_len = trace.seq_lens[0]
        for batch in args.batch:
            point = dict(bench=BENCH, model_shape=shape, batch=batch, context=seq_len)
            per_layer = []
            for layer in range(trace.num_layers):
                inputs = CapturedInputs(
                    trace.queries[0, layer], trace.keys[layer, :seq_len],
                    trace.values[layer, :seq_len], trace.sm_scale, batch,
                )  # fmt: skip
                per_layer.append(layer_rows(inputs, args, info, point, art, art_off))
            for policy in per_layer[0][1]:
                rows.append(info.row(**point, policy=policy, metric="step_attention_ms",
                                     value=sum(times[policy] for _, times in per_layer),
                                     attention_backend=harness.named_backend(policy)))  # fmt: skip
            for metric in ("tiles_read_frac", "rel_error_mean"):
                values = [r.value for layer_rows_, _ in per_layer for r in layer_rows_ if r.metric == metric]
                rows.append(info.row(**point, policy="art", metric=metric, value=sum(values) / len(values)))
            print(f"{BENCH}: captured {length} tokens, batch {batch} done", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    from sglang_ext.config import parse_policy_config
    from sglang_ext.policies import build_policy

    args = build_parser().parse_args(argv)
    params = parse_policy_config(args.policy_config)  # ART's (default: its defaults)
    art = build_policy("art", params)
    art_off = build_policy("art", {**params, "patience": 0})
    info = RunInfo.detect()
    rows = captured_points(args, info, art, art_off) if args.captured else random_points(args, info, art, art_off)
    harness.add_baseline_ratios(rows)
    label = "smollm2-captured" if args.captured else args.shape
    harness.save_results(BENCH, label, rows, info, args.out_dir, args.results_md)


if __name__ == "__main__":
    main()
