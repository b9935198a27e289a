"""How much of the KV cache ART reads on a real model's attention, and the error it leaves: per
prompt length and per (tau, patience), the fraction of KV tiles read (full attention reads all:
the baseline, 1) and the attention output's error against full attention. CPU, real weights.

    python -m benchmarks.art_skip --lengths 1024,4096 --decode-steps 4

Each prompt (natural text, exactly the given length) is decoded greedily under full attention
(sglang_ext.tools.attention_trace, which records every layer's query, keys and values); each decode
step's attention of every layer is then run through ART's torch reference (kernels/art_decode.py,
the engine's CPU path and the Triton kernel's oracle, which the kernel tests hold it to), over
full attention's recent-first order, as one request. The error is the relative L2 error of the
layer's output, ||o_art - o_full|| / ||o_full||, per query head, mean and max over heads, layers,
steps and prompts.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import harness
from benchmarks.harness import RunInfo
from sglang_ext.tools import attention_trace as at
from sglang_ext.kernels.art_decode import art_decode_ref
from sglang_ext.kernels.kv_view import KVView
from sglang_ext.policies import build_policy

BENCH = "art_skip"


def build_parser() -> argparse.ArgumentParser:
    parser = harness.trace_parser(BENCH, __doc__, lengths=[1024, 4096], decode_steps=4)
    floats = lambda text: [float(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--taus", type=floats, default=[1e-5, 1e-4, 1e-3])
    parser.add_argument("--patience", type=harness.int_list, default=[5, 2])
    return parser


def layer_cache(trace: at.DecodeTrace, step: int, layer: int):
    """(q, KV view): one layer's decode at ``step`` as a one-request batch in the engine's
    layout."""
    seq_len = trace.seq_lens[step]
    q = trace.queries[step, layer][None]  # [1, q_heads, dim]
    k = trace.keys[layer, :seq_len]
    v = trace.values[layer, :seq_len]
    req_to_token = torch.arange(seq_len, dtype=torch.int32)[None]
    rows, seq_lens = torch.zeros(1, dtype=torch.int64), torch.tensor([seq_len], dtype=torch.int32)
    return q, KVView(k, v, req_to_token, rows, seq_lens)


def measure_trace(trace: at.DecodeTrace, configs: dict) -> dict:
    """config -> (tiles read, tiles in all, relative errors per head)."""
    found = {key: [0, 0, []] for key in configs}
    for step in range(trace.num_steps):
        for layer in range(trace.num_layers):
            cache = layer_cache(trace, step, layer)
            full, _ = art_decode_ref(*cache, trace.sm_scale, tau=1.0, phi=1.0, patience=0)
            norm = full[0].norm(dim=-1).clamp_min(1e-12)
            seq_len, kv_heads = int(cache[1].lengths[0]), cache[1].k.shape[1]
            for key, art in configs.items():
                out, tiles = art_decode_ref(
                    *cache, trace.sm_scale, **art.kernel_params(), always_read=art.sink_tokens
                )
                found[key][0] += int(tiles.sum())
                found[key][1] += kv_heads * -(-seq_len // art.tile_tokens)
                found[key][2] += ((out[0] - full[0]).norm(dim=-1) / norm).tolist()
    return found


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_ext.model import default_model_path

    model_path = args.model_path or default_model_path()
    model = at.load_model(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    configs = {
        (tau, patience): build_policy("art", {"tau": tau, "phi": max(1e-3, 100 * tau), "patience": patience})
        for tau in args.taus
        for patience in args.patience
    }
    info, shape = RunInfo.detect(on_cpu=True), model_path.name.lower()
    rows, prompt_source = [], ""
    for length in args.lengths:
        prompts, prompt_source = at.natural_text_prompts(
            tokenizer, [length] * args.prompts_per_length, args.text_dir
        )
        totals = {key: [0, 0, []] for key in configs}
        for ids in prompts:
            start = time.perf_counter()
            trace = at.trace_decode(model, ids, args.decode_steps)
            for key, (read, everything, errors) in measure_trace(trace, configs).items():
                totals[key][0] += read
                totals[key][1] += everything
                totals[key][2] += errors
            print(f"{BENCH}: {length}-token prompt in {time.perf_counter() - start:.0f} s", flush=True)
        for (tau, patience), (read, everything, errors) in totals.items():
            policy = f"art-tau{tau:g}-p{patience}"
            point = dict(bench=BENCH, policy=policy, model_shape=shape, batch=1, context=length)
            rows += [
                info.row(**point, metric="tiles_read_frac", value=read / everything),
                info.row(**point, metric="rel_error_mean", value=sum(errors) / len(errors)),
                info.row(**point, metric="rel_error_max", value=max(errors)),
            ]
    harness.save_results(BENCH, shape, rows, info, args.out_dir, args.results_md)
    note = (
        f"- {args.prompts_per_length} prompt(s) per length from {prompt_source}, {args.decode_steps} "
        f"decode steps, every layer; phi = max(1e-3, 100 tau) (1e-3 at the default "
        f"tau 1e-5); full attention reads every tile (fraction 1) with error 0.\n\n"
    )
    with open(args.results_md, "a") as md:
        md.write(note)


if __name__ == "__main__":
    main()
