"""Teacher-forced next-token agreement with full attention, per position (issue 17): for positions
of long natural text, the next-token distribution of a decode step that follows the policy, against
full attention's, as top-1 agreement and KL(full ‖ policy), averaged over positions and passages.

    python -m benchmarks.agreement --lengths 8192 --prompts-per-length 2 --budgets 256,512,1024

How (sglang_ext.tools.agreement): a passage of natural text is prefilled once under full attention
(transformers, SmolLM2's real weights, fp32, CPU); each measured position (every --stride-th
from --positions-from on) is then decoded as one step whose layers attend as the policy's roles
say, selections by the policy's own rule from the engine's token scores, over the prefill's K/V
(teacher forcing: the context is the reference text, the step is the policy's). The attention
over a selection is torch's (the kernels' test oracle). ``window-W`` attends to the last W tokens
at every layer (the floor to beat). ``full`` runs the same one-step path (top-1 1, KL ~1e-7: the
path itself); ``bf16`` is full attention with the model in bf16 against fp32 (the noise floor).
``lethe-R`` (``--lethe-ratios``: its ``max_kv_ratio``) decodes the passage from --positions-from
on through the engine's own Lethe runtime, the first --positions-from tokens its prompt, every
step's query the prefill's; each measured step reads what each layer retains then
(``sglang_ext.tools.agreement.LetheReads``), and ``kv_kept_fraction`` is the share of the positions
whose KV it still holds there. ``--variants tidal:sink_tokens=0`` measures a policy with other
parameters beside its defaults, DELTA and Tidal at each budget (``tidal[sink_tokens=0]-1024``),
Lethe once, with --lethe-threshold unless the variant sets it (``lethe[max_kv_ratio=0.9]``).
``--per-kv-head`` adds DELTA and Tidal selecting per KV head (``PerKVHeadSelectionReads``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer

from benchmarks import harness
from benchmarks.harness import Row, RunInfo
from sglang_ext.tools import agreement as ag
from sglang_ext.tools import attention_trace as at
from sglang_ext.tools.calibrate import model_slug
from sglang_ext.policies import build_policy, policy_class
from sglang_ext.policies.calibration import model_fingerprint

BENCH = "agreement"


def readers(args, num_layers: int, fingerprint: dict, kv_heads: int) -> dict[str, object]:
    """label -> what each layer reads: full, the window, each policy at each budget of B tokens
    (``for_token_budget``: DELTA B/16 pages, B/128 of them recent; Tidal B tokens), with its
    defaults and as each of ``--variants`` changes them."""
    ctx = at.cpu_context(num_layers, fingerprint)
    out = {"full": ag.FullReads(), f"window-{args.window}": ag.WindowReads(args.window)}
    configs, lethe_configs = [(name, {}, name) for name in ("delta", "tidal")], {}
    for name, params in args.variants:
        changes = ",".join(f"{key}={json.dumps(value)}" for key, value in params.items())
        if name == "lethe":
            lethe_configs[f"lethe[{changes}]"] = params
        else:
            configs.append((name, params, f"{name}[{changes}]"))
    for budget in args.budgets:
        for name, params, label in configs:
            config = {**policy_class(name).for_token_budget(budget), **params}
            policy = build_policy(name, config).for_model(ctx)
            out[f"{label}-{budget}"] = ag.SelectionReads(policy, num_layers)
            if args.per_kv_head:
                reads = ag.PerKVHeadSelectionReads(policy, num_layers, kv_heads)
                out[f"{label}-per-kv-head-{budget}"] = reads
    for ratio in args.lethe_ratios:
        lethe_configs[f"lethe-{ratio:g}"] = {"max_kv_ratio": ratio}
    for label, params in lethe_configs.items():
        lethe = build_policy("lethe", {"evict_threshold": args.lethe_threshold, **params})
        out[label] = ag.LetheReads(lethe, num_layers, args.positions_from)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = harness.trace_parser(BENCH, __doc__, lengths=[8192])
    parser.add_argument("--budgets", type=harness.int_list, default=[256, 512, 1024])
    parser.add_argument("--window", type=int, default=1024, help="the window baseline's tokens")
    parser.add_argument("--positions-from", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=64, help="every stride-th position measured")
    parser.add_argument(
        "--lethe-ratios", type=harness.float_list, default=[0.3],
        help="Lethe's max_kv_ratio values to measure (none: an empty string)",
    )  # fmt: skip
    parser.add_argument("--lethe-threshold", type=int, default=1024, help="Lethe's evict_threshold")
    parser.add_argument(
        "--variants", type=harness.variant_list,
        default=[], help="';'-separated NAME:KEY=VALUE,... (e.g. tidal:sink_tokens=0): each "
        "policy with those parameters, measured beside its defaults (DELTA and Tidal at each "
        "budget, Lethe once)",
    )  # fmt: skip
    parser.add_argument(
        "--per-kv-head", action="store_true",
        help="DELTA and Tidal also with a selection per KV head (label NAME-per-kv-head-BUDGET)",
    )  # fmt: skip
    return parser


def measure(args, model_path) -> tuple[dict, str]:
    """(label, length) -> (top-1 per position, KL per position, budget, share of KV kept per
    position or []) over every passage; the source."""
    model = ag.load_model(model_path, torch.float32)
    half = ag.load_model(model_path, torch.bfloat16)
    config = model.config
    reads = readers(
        args, config.num_hidden_layers, model_fingerprint(config), config.num_key_value_heads
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    results: dict[tuple[str, int], list[list]] = {}
    source = ""
    for length in args.lengths:
        positions = list(range(args.positions_from, length, args.stride))
        texts, source = at.natural_text_prompts(
            tokenizer, [length] * args.prompts_per_length, args.text_dir
        )
        for ids in texts:
            start = time.perf_counter()
            passage = ag.Passage.prefill(model, ids, positions)
            bf16 = ag.agreement(passage.reference, ag.prefill(half, ids, positions)[0])
            measured = {
                "bf16": (*bf16, []),
                **{
                    label: (*passage.measure(model, r), r.take_kept()) for label, r in reads.items()
                },
            }
            for label, (top1, kl, kept) in measured.items():
                entry = results.setdefault((label, length), [[], [], []])
                entry[0].append(top1)
                entry[1].append(kl)
                entry[2] += kept
            elapsed = time.perf_counter() - start
            print(
                f"{BENCH}: {length}-token passage, {len(positions)} positions in {elapsed:.0f} s",
                flush=True,
            )
    budgets = {"bf16": "", **{label: reader.budget for label, reader in reads.items()}}
    return {
        key: (torch.cat(t), torch.cat(k), budgets[key[0]], kept)
        for key, (t, k, kept) in results.items()
    }, source


def rows_of(info: RunInfo, shape: str, results: dict) -> list[Row]:
    rows = []
    for (label, length), (top1, kl, budget, kept) in results.items():
        metrics = [("top1_agreement", top1.mean()), ("kl_nats", kl.mean())]
        if kept:
            metrics.append(("kv_kept_fraction", sum(kept) / len(kept)))
        for metric, value in metrics:
            rows.append(
                info.row(
                    bench=BENCH,
                    policy=label,
                    model_shape=shape,
                    batch=1,
                    context=length,
                    metric=metric,
                    value=float(value),
                    attention_backend="torch",
                    kv_source="real",
                    budget=budget,
                )  # fmt: skip
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not all(0 <= args.positions_from < length for length in args.lengths):
        parser.error(f"--positions-from {args.positions_from} must lie inside each of --lengths")
    torch.set_num_threads(args.threads)
    from sglang_ext.model import default_model_path

    model_path = args.model_path or default_model_path()
    info = RunInfo.detect(on_cpu=True)
    results, source = measure(args, model_path)
    shape = model_slug(model_path)
    harness.save_results(
        BENCH, shape, rows_of(info, shape, results), info, args.out_dir, args.results_md
    )
    positions = f"every {args.stride}th position from {args.positions_from}"
    with open(args.results_md, "a") as md:
        md.write(
            f"- {model_path.name} (real weights), fp32 on the CPU; {args.prompts_per_length} "
            f"passage(s) per length, {positions}; passages: {source}. Values are means over "
            "positions and passages; `full` runs the policies' one-step path, `bf16` is the "
            "model in bf16 against fp32 (noise floor).\n\n"
        )


if __name__ == "__main__":
    main()
