"""Eviction fidelity at equal KV (issue 56): NVIDIA kvpress's decode-time eviction presses beside
this project's evicting policies (Lethe), in one run on the same passages and positions by the
same measure: how close each keeps the model's next-token distribution to full attention's, and
how much KV it held for it.

    python -m benchmarks.eviction_fidelity --lengths 4096 --prompts-per-length 3 --kv-ratios 0.2,0.3,0.5

Each (passage, method) pair is measured on its own, so ``--processes N --threads 1`` spreads
them over N cores: a sweep of rules over 18 passages fits a many-core host's few minutes.

The measure is benchmarks.agreement's (sglang_ext.tools.agreement): a passage of natural text is
prefilled once under full attention (transformers, SmolLM2's real weights, fp32, CPU); at every
--stride-th position from --positions-from on, one decode step runs with each layer reading only
what a method holds there, and is compared with full attention's next-token distribution (top-1
agreement, KL(full ‖ method)). The first --positions-from tokens are the prompt; the rest are
decoded teacher-forced (every token's context is the reference text's).

Methods, each at every kv ratio R of --kv-ratios (a row's ``budget``):

- ``kvpress-NAME`` for each of --presses: kvpress's press NAME as its
  ``PrefillDecodingPress(P, CompressionRatioDecodingPress(P, 1 - R, --compression-interval))``
  would evict: the prompt compressed at prefill to R of it, then every --compression-interval
  decoded tokens the cache re-compressed to R of the tokens seen, each KV head keeping its own
  top scores (sglang_ext.tools.kvpress_reads says exactly how its presses are driven).
  ``--kvpress-lists layer`` (or ``both``) also measures each press with one list per layer
  (``kvpress-NAME/layer``: its scores averaged over the layer's KV heads, as on Lethe's runtime).
  ``--kvpress-order position`` (or ``both``) also measures each with its cache left by position
  after each compression (``…/position``), not in its top-k's order, which SnapKV's pooling
  runs over at the next compression. ``--kvpress-driving plain`` (or ``both``) also measures
  each without kvpress's decode-time RoPE of the last step alone and top-k's order of tied
  scores (``…/plain``; ``kvpress_reads.KvpressReads``'s ``plain``).
- each of --policies (``NAME`` or ``NAME:{json}``, ';'-separated), any registered policy that
  evicts or a selection composed over one (``lethe+tidal``: ``agreement.EvictedSelectionReads``),
  or a selection alone (``tidal``: ``agreement.SelectionReads``, once, at its budget),
  decoded through the engine's own runtime (``agreement.LetheReads``): at each ratio with
  ``max_kv_ratio`` R (and --evict-threshold) where the policy takes those parameters and the JSON
  does not set them; otherwise once, as the JSON says (its budget then the policy's own).
- ``full`` (the one-step path itself) and, with --window W, ``window-W``.

``top1_minus_reference`` and ``kl_minus_reference`` (and their ``_ci95``): each method's top-1
agreement and KL minus the first press's (its run whose KV kept is nearest the method's, same
context) on the same positions, and the 95 % half-width of that paired mean over passages
(Student's t over each passage's mean difference: a passage's positions share its text, so they
are not independent samples). Passages: ``attention_trace.natural_text_prompts``, the seed texts'
starts first, then whole windows further into them.

``--missed-attention FILE``: per method, passage, position and layer, the share of the step's
full attention (mean over query heads) on the tokens the method does not read (``MissedAttention``),
beside its KL: which layers' choices cost a method the attention the next steps pay.

``kv_kept_fraction``: per measured position, the share of the positions so far whose KV the method
held there (mean over layers and KV heads for kvpress), averaged over positions. Compare methods at
equal kept fractions, not equal R: a kvpress press sits at R right after each compression and
grows by the tokens decoded since; Lethe holds more than its cap between its rounds.

kvpress is an extra (requirements/kvpress.txt, installed --no-deps by scripts/setup.sh);
``--presses ''`` runs without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import time
from pathlib import Path

import torch
from scipy import stats
from transformers import AutoTokenizer

from benchmarks import harness, worker_pool
from benchmarks.harness import Row, RunInfo
from sglang_ext.policies import PolicyConfigError, build_policy, policy_class
from sglang_ext.tools import agreement as ag
from sglang_ext.tools import attention_trace as at
from sglang_ext.policies.calibration import model_fingerprint
from sglang_ext.policies.selection import SelectionPolicy
from sglang_ext.tools.calibrate import model_slug

BENCH = "eviction_fidelity"
KVPRESS_PRESSES = ("snapkv", "tova", "expected_attention", "streaming_llm", "knorm", "random")
METRICS = ("top1_agreement", "kl_nats", "kv_kept_fraction")


def policy_spec(text: str) -> tuple[str, dict]:
    """``NAME`` or ``NAME:{json}`` -> (a registered policy that evicts or selects, its
    parameters)."""
    name, _, params_text = text.partition(":")
    try:
        params = json.loads(params_text) if params_text else {}
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{name}: {params_text!r} is not JSON") from err
    if not isinstance(params, dict):
        raise argparse.ArgumentTypeError(f"{name}: expected a JSON object, got {params_text!r}")
    try:
        policy = build_policy(name, params)
    except PolicyConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    if not policy.evicts() and not isinstance(policy, SelectionPolicy):
        raise argparse.ArgumentTypeError(f"{name} neither evicts nor selects: nothing to measure")
    return name, params


def policy_list(text: str) -> list[tuple[str, dict]]:
    return [policy_spec(part.strip()) for part in text.split(";") if part.strip()]


def press_list(text: str) -> list[str]:
    names = harness.name_list(text)
    unknown = [name for name in names if name not in KVPRESS_PRESSES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown presses {unknown} (known: {KVPRESS_PRESSES})")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = harness.trace_parser(BENCH, __doc__, lengths=[4096])
    parser.set_defaults(prompts_per_length=3)
    parser.add_argument("--kv-ratios", type=harness.float_list, default=[0.2, 0.3, 0.5])
    parser.add_argument("--positions-from", type=int, default=1024, help="the prompt's tokens")
    parser.add_argument("--stride", type=int, default=64, help="every stride-th position measured")
    parser.add_argument(
        "--presses", type=press_list, default=list(KVPRESS_PRESSES),
        help="kvpress presses to measure (none: an empty string)",
    )  # fmt: skip
    parser.add_argument(
        "--compression-interval", type=int, default=64,
        help="decoded tokens between kvpress's compressions",
    )  # fmt: skip
    parser.add_argument(
        "--kvpress-lists", choices=("head", "layer", "both"), default="head",
        help="kvpress's own lists per KV head, one per layer (scores averaged over heads), or both",
    )  # fmt: skip
    parser.add_argument(
        "--kvpress-order", choices=("topk", "position", "both"), default="topk",
        help="kvpress's cache after a compression in its top-k's order (its own), by position, "
        "or both",
    )  # fmt: skip
    parser.add_argument(
        "--kvpress-driving", choices=("own", "plain", "both"), default="own",
        help="kvpress's presses as kvpress drives them, without its decode-time RoPE of the last "
        "step alone and top-k's order of tied scores (plain), or both",
    )  # fmt: skip
    parser.add_argument(
        "--policies", type=policy_list, default=[("lethe", {})],
        help="';'-separated NAME or NAME:{json}: registered policies that evict or select",
    )  # fmt: skip
    parser.add_argument(
        "--evict-threshold", type=int, default=1024,
        help="evict_threshold of the policies that take one (Lethe's first round)",
    )  # fmt: skip
    parser.add_argument("--window", type=int, default=None, help="also the last W tokens")
    parser.add_argument(
        "--missed-attention", type=Path, default=None,
        help="also write, per method, passage, position and layer, the share of the step's full "
        "attention (mean over query heads) that falls on tokens the method does not read (json)",
    )  # fmt: skip
    parser.add_argument(
        "--processes", type=int, default=1,
        help="worker processes the passages are spread over, --threads threads each",
    )  # fmt: skip
    parser.add_argument(
        "--per-position", type=Path, default=None,
        help="also write each method's top-1 and KL per passage and position (json) here",
    )  # fmt: skip
    return parser


def policy_readers(args, num_layers: int, fingerprint: dict) -> dict[tuple[str, str], object]:
    """(label, budget) -> reads, for each of --policies (see the module's docstring)."""
    out = {}
    ctx = at.cpu_context(num_layers, fingerprint)  # a composition's selection layers, as served
    for name, params in args.policies:
        evicting = name.partition("+")[0]  # a composition's: its first policy's parameters
        fields = {field.name for field in dataclasses.fields(policy_class(evicting))}
        changes = ",".join(f"{key}={json.dumps(value)}" for key, value in params.items())
        label = f"{name}[{changes}]" if changes else name
        if "max_kv_ratio" in fields and "max_kv_ratio" not in params:
            configs = [(f"{ratio:g}", {"max_kv_ratio": ratio}) for ratio in args.kv_ratios]
        else:
            configs = [(None, {})]
        for budget, config in configs:
            if "evict_threshold" in fields:
                config["evict_threshold"] = args.evict_threshold
            policy = build_policy(name, {**config, **params}).for_model(ctx)
            ratio = getattr(policy, "max_kv_ratio", None)
            budget = budget or (f"{ratio:g}" if ratio is not None else policy.budget())
            if policy.evicts():
                out[label, budget] = ag.decoded_reads(policy, num_layers, args.positions_from)
            else:  # a selection alone, beside one composed over an eviction
                out[label, policy.budget()] = ag.SelectionReads(policy, num_layers)
    return out


def readers(args, model) -> dict[tuple[str, str], object]:
    """(label, budget) -> what each layer reads: full, the window, kvpress's presses and the
    policies, at each kv ratio."""
    out: dict[tuple[str, str], object] = {("full", ""): ag.FullReads()}
    if args.window:
        out[f"window-{args.window}", f"{args.window} tokens"] = ag.WindowReads(args.window)
    if args.presses:
        from sglang_ext.tools import kvpress_reads as kr

        per_layer = {"head": [False], "layer": [True], "both": [False, True]}[args.kvpress_lists]
        by_position = {"topk": [False], "position": [True], "both": [False, True]}
        plain = {"own": [False], "plain": [True], "both": [False, True]}[args.kvpress_driving]
        variants = itertools.product(per_layer, by_position[args.kvpress_order], plain)
        for ratio, name, (one_list, positional, plainly) in itertools.product(
            args.kv_ratios, args.presses, list(variants)
        ):
            press = kr.make_press(name, args.compression_interval)
            reads = kr.KvpressReads(
                model, press, ratio, args.positions_from, args.compression_interval,
                one_list_per_layer=one_list, by_position=positional, plain=plainly,
            )  # fmt: skip
            label = f"kvpress-{name}" + "/layer" * one_list + "/position" * positional
            label += "/plain" * plainly
            out[label, reads.budget] = reads
    fingerprint = model_fingerprint(model.config)
    return {**out, **policy_readers(args, model.config.num_hidden_layers, fingerprint)}


def passages(args, model_path) -> tuple[dict[int, list[list[int]]], str]:
    """--prompts-per-length passages of each of --lengths, and where they come from."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    by_length, source = {}, ""
    for length in args.lengths:
        prompts = [length] * args.prompts_per_length
        by_length[length], source = at.natural_text_prompts(tokenizer, prompts, args.text_dir)
    return by_length, source


def measured_positions(args, length: int) -> list[int]:
    """The positions of a ``length``-token passage whose next token is measured."""
    return list(range(args.positions_from, length, args.stride))


def measure(args, model_path, texts_by_length: dict[int, list[list[int]]]) -> tuple[dict, dict]:
    """(label, budget, length) -> (top-1 [passages, positions], KL [passages, positions], share
    of KV kept per position or []), and with --missed-attention (label, budget, length) -> the
    missed attention [passages, positions, layers] (``MissedAttention``). With --processes N > 1
    each (passage, method) pair is a task for one of N worker processes of --threads threads
    each, every worker building the same model and reads (the measure of a method on a passage
    does not depend on what ran before it), and the values are gathered in passage order."""
    model = ag.load_model(model_path, torch.float32)
    keys = list(readers(args, model))
    passages = [(length, ids) for length, texts in texts_by_length.items() for ids in texts]
    tasks = [(number, key) for number in range(len(passages)) for key in keys]
    if args.processes > 1:
        del model
        workers = min(args.processes, len(tasks))
        with worker_pool.pool(workers, _start_worker, (args, model_path, passages)) as pool:
            measured = list(pool.map(_measure_in_worker, tasks))
    else:
        _start_worker(args, model_path, passages, model)
        measured = [_measure_in_worker(task) for task in tasks]
    results: dict[tuple[str, str, int], list[list]] = {}
    missed: dict[tuple[str, str, int], list[torch.Tensor]] = {}
    for (number, (label, budget)), (top1, kl, kept, attention) in zip(tasks, measured, strict=True):
        key = (label, budget, passages[number][0])
        entry = results.setdefault(key, [[], [], []])
        entry[0].append(top1)
        entry[1].append(kl)
        entry[2] += kept
        if attention is not None:
            missed.setdefault(key, []).append(attention)
    stacked = {key: (torch.stack(t), torch.stack(k), kept) for key, (t, k, kept) in results.items()}
    return stacked, {key: torch.stack(values) for key, values in missed.items()}


_worker: dict = {}  # this process's args, passages, model, reads and last prefilled passage


def _start_worker(args, model_path, passages, model=None) -> None:
    torch.set_num_threads(args.threads)
    model = model or ag.load_model(model_path, torch.float32)
    _worker.update(args=args, passages=passages, model=model, reads=readers(args, model))
    _worker["prefilled"] = (None, None)


def _measure_in_worker(task: tuple[int, tuple[str, str]]) -> tuple:
    """One method on one passage: (top-1, KL, kept per position, missed attention or None)."""
    number, key = task
    args, model = _worker["args"], _worker["model"]
    length, ids = _worker["passages"][number]
    began = time.perf_counter()
    if _worker["prefilled"][0] != number:  # tasks come passage by passage: mostly prefilled
        positions = measured_positions(args, length)
        passage = ag.Passage.prefill(model, ids, positions, hidden_states=bool(args.presses))
        _worker["prefilled"] = (number, passage)
    reads = _worker["reads"][key]
    watched = MissedAttention(reads) if args.missed_attention else None
    top1, kl = _worker["prefilled"][1].measure(model, watched or reads)
    kept = reads.take_kept()
    elapsed = time.perf_counter() - began
    print(f"{BENCH}: passage {number}, {' '.join(key).strip()} in {elapsed:.0f} s", flush=True)
    return top1, kl, kept, watched and watched.per_position()


class MissedAttention:
    """Reads as ``reads`` do, and records at each step and layer the share of full attention
    (softmax over every token, mean over query heads) on the tokens those reads leave out: where
    a method loses the model, which layers' choices cost it the attention the step pays."""

    def __init__(self, reads):
        self.reads = reads
        self.steps: list[dict[int, float]] = []

    def advance(self, passage, position: int) -> None:
        self.reads.advance(passage, position)
        self.steps.append({})

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        tokens = self.reads.tokens(layer, logits)
        read = torch.ones_like(logits, dtype=torch.bool)
        if tokens is not None and tokens.dtype == torch.bool:
            read = tokens
        elif tokens is not None:
            read = torch.zeros_like(read)
            read[:, tokens] = True
        probs = torch.softmax(logits, dim=-1)
        self.steps[-1][layer] = float(1 - (probs * read).sum(-1).mean())
        return tokens

    def per_position(self) -> torch.Tensor:
        """[positions, layers]."""
        return torch.tensor([[step[layer] for layer in sorted(step)] for step in self.steps])


def means(results: dict, reference: str | None = None) -> dict[tuple[str, str, int], dict]:
    """Per (label, budget, length): each metric's mean over positions and passages (no
    kv_kept_fraction for reads that evict nothing), and, where ``reference`` (a label) was
    measured at that length, the top-1 and KL differences against its run nearest in KV kept
    (``paired``)."""
    kept_mean = {key: sum(kept) / len(kept) for key, (_, _, kept) in results.items() if kept}
    references = [key for key in kept_mean if key[0] == reference]
    out = {}
    for key, (top1, kl, _) in results.items():
        out[key] = {"top1_agreement": float(top1.mean()), "kl_nats": float(kl.mean())}
        if key not in kept_mean:
            continue
        out[key]["kv_kept_fraction"] = kept_mean[key]
        runs = [run for run in references if run[2] == key[2]]
        if key[0] != reference and runs:
            nearest = min(runs, key=lambda run: abs(kept_mean[run] - kept_mean[key]))
            for name, ours, theirs in (("top1", top1, results[nearest][0]),
                                       ("kl", kl, results[nearest][1])):  # fmt: skip
                mean, half_width = paired(ours, theirs)
                out[key][f"{name}_minus_reference"] = mean
                if half_width is not None:
                    out[key][f"{name}_minus_reference_ci95"] = half_width
    return out


def per_position(args, results: dict) -> dict:
    """Each method's top-1 and KL per passage and measured position, by length, to find where
    two methods differ (a mean over passages is carried by a few positions)."""
    out: dict = {}
    for (label, budget, length), (top1, kl, _) in results.items():
        entry = out.setdefault(
            str(length), {"positions": measured_positions(args, length), "methods": {}}
        )
        name = f"{label} {budget}".strip()
        entry["methods"][name] = {"top1": top1.tolist(), "kl": kl.tolist()}
    return out


def missed_attention(args, results: dict, missed: dict) -> dict:
    """Each method's missed attention (``MissedAttention``) per passage, position and layer,
    by length, beside its KL there."""
    out: dict = {}
    for (label, budget, length), attention in missed.items():
        entry = out.setdefault(
            str(length), {"positions": measured_positions(args, length), "methods": {}}
        )
        kl = results[label, budget, length][1].tolist()
        entry["methods"][f"{label} {budget}".strip()] = {"missed": attention.tolist(), "kl": kl}
    return out


def paired(values: torch.Tensor, reference: torch.Tensor) -> tuple[float, float | None]:
    """``values`` minus ``reference`` ([passages, positions], the same positions): the mean and
    the 95 % half-width of the mean over passages (Student's t; None from one passage)."""
    per_passage = (values.double() - reference.double()).mean(dim=1)
    count = per_passage.numel()
    if count < 2:
        return float(per_passage.mean()), None
    quantile = float(stats.t.ppf(0.975, count - 1))
    return float(per_passage.mean()), quantile * float(per_passage.std()) / count**0.5


def rows_of(info: RunInfo, shape: str, values: dict) -> list[Row]:
    rows = []
    for (label, budget, length), metrics in values.items():
        for metric, value in metrics.items():
            row = info.row(
                bench=BENCH, policy=label, model_shape=shape, batch=1, context=length,
                metric=metric, value=value, attention_backend="torch", kv_source="real",
                budget=budget,
            )  # fmt: skip
            rows.append(row)
    return rows


def _ratio_order(budget: str) -> tuple:
    try:
        return (0, float(budget))
    except ValueError:
        return (1, budget)


def markdown(values: dict) -> str:
    """One table: each method at each kv ratio asked, grouped by context and ratio."""
    lines = [
        "| context | kv ratio asked | method | top-1 agreement | top-1 − first press (95 % CI) "
        "| KL (nats) | KL − first press (95 % CI) | KV kept fraction |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    order = sorted(values, key=lambda key: (key[2], _ratio_order(key[1])))
    for label, budget, length in order:
        metric = values[label, budget, length]
        kept = metric.get("kv_kept_fraction")
        top1, kl = (_difference(metric, name) for name in ("top1", "kl"))
        lines.append(
            f"| {length} | {budget or 'all'} | {label} | {metric['top1_agreement']:.4f} "
            f"| {top1} | {metric['kl_nats']:.4g} | {kl} "
            f"| {'–' if kept is None else f'{kept:.4f}'} |"
        )
    return "\n".join(lines)


def _difference(metric: dict, name: str) -> str:
    if f"{name}_minus_reference" not in metric:
        return "–"
    half_width = metric.get(f"{name}_minus_reference_ci95")
    spread = "" if half_width is None else f" ± {half_width:.3f}"
    return f"{metric[f'{name}_minus_reference']:+.3f}{spread}"


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not all(0 <= args.positions_from < length for length in args.lengths):
        parser.error(f"--positions-from {args.positions_from} must lie inside each of --lengths")
    if not all(0 < ratio <= 1 for ratio in args.kv_ratios):
        parser.error(f"--kv-ratios {args.kv_ratios}: each must be in (0, 1]")
    if args.processes < 1:
        parser.error(f"--processes {args.processes}: must be >= 1")
    if args.presses and args.compression_interval < 2:
        parser.error("--compression-interval must be >= 2 (SnapKV's window is shorter than it)")
    if args.presses and importlib.util.find_spec("kvpress") is None:
        parser.error(
            "kvpress is not installed: pip install --no-deps -r requirements/kvpress.txt "
            "(scripts/setup.sh does), or --presses ''"
        )
    torch.set_num_threads(args.threads)
    from sglang_ext.model import default_model_path

    model_path = args.model_path or default_model_path()
    try:
        texts_by_length, source = passages(args, model_path)
    except ValueError as error:
        parser.error(f"--prompts-per-length {args.prompts_per_length}: {error}")
    info = RunInfo.detect(on_cpu=True)
    results, missed = measure(args, model_path, texts_by_length)
    values = means(results, f"kvpress-{args.presses[0]}" if args.presses else None)
    if args.per_position is not None:
        args.per_position.write_text(json.dumps(per_position(args, results)))
    if args.missed_attention is not None:
        args.missed_attention.write_text(json.dumps(missed_attention(args, results, missed)))
    shape = model_slug(model_path)
    harness.save_results(
        BENCH, shape, rows_of(info, shape, values), info, args.out_dir, args.results_md
    )
    table = markdown(values)
    print(f"\n{table}\n", flush=True)
    positions = f"every {args.stride}th position from {args.positions_from}"
    with open(args.results_md, "a") as md:
        md.write(
            f"{table}\n\n- {model_path.name} (real weights), fp32 on the CPU; "
            f"{args.prompts_per_length} passage(s) per length, {positions}; kvpress compressing "
            f"every {args.compression_interval} decoded tokens; passages: {source}. Values are "
            "means over positions and passages; `full` runs the methods' one-step path.\n\n"
        )


if __name__ == "__main__":
    main()
