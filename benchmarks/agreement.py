"""Teacher-forced next-token agreement with full attention, per position (issue 17): for positions
of long natural text, the next-token distribution of a decode step that follows the policy, against
full attention's, as top-1 agreement and KL(full ‖ policy), averaged over positions and passages.

    python -m benchmarks.agreement --lengths 8192 --prompts-per-length 2 --budgets 256,512,1024

How it is computed (transformers, SmolLM2's real weights, fp32, CPU): a passage is prefilled once
under full attention; its K/V per layer and its next-token logits at the measured positions
(every --stride-th from --positions-from on) are kept. Each measured position p is then decoded as
one step: token p at position p through every layer, reading the prefill's K/V of tokens 0..p-1
and its own new K/V, each layer attending as the policy's role for it says — full; a selection
layer full, then its token scores (the engine's definitions) through the policy's own
``Selection.choose``; a sparse layer only the latest selection — so the context is the reference
text (teacher forcing) and the step at p is the policy's. The selection rule is the engine's; the
attention over it is torch's (the kernels' test oracle). ``window-W`` attends to the last W tokens
at every layer (the floor to beat). ``full`` runs the same one-step path (top-1 1, KL ~1e-7: the
path itself); ``bf16`` is full attention with the model in bf16 against fp32 (the noise floor).
Lethe is not measured here: its retained set depends on the rounds of a whole decode.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from benchmarks import harness
from benchmarks.harness import Row, RunInfo
from sglang_ext import attention_trace as at
from sglang_ext.calibrate import model_slug
from sglang_ext.policies import build_policy
from sglang_ext.policies.calibration import model_fingerprint
from sglang_ext.policies.selection import LayerRole

BENCH = "agreement"
ATTENTION = "sglang_ext_agreement"
PAGE_SIZE = 16


class FullReads:
    """Every layer reads every token."""

    budget = ""

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        return None


@dataclasses.dataclass
class WindowReads:
    """Every layer reads the last ``window`` tokens."""

    window: int

    @property
    def budget(self) -> str:
        return f"{self.window} tokens"

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        seq_len = logits.shape[1]
        return torch.arange(max(0, seq_len - self.window), seq_len)


class SelectionReads:
    """A DELTA or TidalDecode step: each layer reads as its role says (``layer_roles``), the
    selections chosen by the policy's own rule from the engine's token scores."""

    def __init__(self, policy, num_layers: int):
        self.roles = policy.layer_roles(num_layers)
        self.rule = at.selection_rule(policy, num_layers)
        self.score = at.TOKEN_SCORES[policy.name]
        self.budget = policy.budget()
        self.selected: torch.Tensor | None = None

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        role = self.roles[layer]
        if role is LayerRole.SELECT:
            self.selected = at.choose_tokens(self.rule, self.score(logits), logits.shape[1])
        return self.selected if role is LayerRole.SPARSE else None


@dataclasses.dataclass
class OneStep:
    """The decode step at ``position``: the prefill's K/V before it, ``reads`` per layer."""

    keys: dict[int, torch.Tensor]  # layer -> [kv_heads, tokens, dim], from the prefill
    values: dict[int, torch.Tensor]
    position: int
    reads: object

    def attend(self, layer: int, query, key, value, scaling: float):
        p = self.position
        k = torch.cat([self.keys[layer][:, :p], key[0].float()], dim=1)  # [kv_heads, p + 1, dim]
        v = torch.cat([self.values[layer][:, :p], value[0].float()], dim=1)
        q = query[0, :, 0].float()  # [q_heads, dim]
        kv_heads, q_heads = k.shape[0], q.shape[0]
        grouped = q.view(kv_heads, q_heads // kv_heads, -1)
        logits = torch.einsum("kgd,ktd->kgt", grouped, k).reshape(q_heads, -1) * scaling
        tokens = self.reads.tokens(layer, logits)
        if tokens is not None:
            allowed = torch.full_like(logits, float("-inf"))
            allowed[:, tokens] = 0.0
            logits = logits + allowed
        probs = torch.softmax(logits, dim=-1).view(kv_heads, q_heads // kv_heads, -1)
        out = torch.einsum("kgt,ktd->kgd", probs, v).reshape(q_heads, -1)
        return out.to(query.dtype)[None, None], None  # [batch 1, token 1, q_heads, dim]


_step: OneStep | None = None  # while a one-step decode runs
_recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> prefill (keys, values)


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    if _step is not None:
        return _step.attend(module.layer_idx, query, key, value, scaling)
    _recorded[module.layer_idx] = (key[0].float(), value[0].float())
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def load_model(model_path, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=dtype, attn_implementation=ATTENTION
    ).eval()


@torch.inference_mode()
def prefill(model, ids: list[int], positions: list[int]):
    """Full attention's next-token logits at ``positions`` [n, vocab] and every layer's K/V."""
    _recorded.clear()
    out = model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=torch.tensor(positions))
    keys = {layer: kv[0] for layer, kv in _recorded.items()}
    values = {layer: kv[1] for layer, kv in _recorded.items()}
    _recorded.clear()
    return out.logits[0].float(), keys, values


@torch.inference_mode()
def step_logits(model, ids, positions, keys, values, reads) -> torch.Tensor:
    """[n, vocab]: the decode step at each position with each layer reading as ``reads`` says."""
    global _step
    rows = []
    for p in positions:
        _step = OneStep(keys, values, p, reads)
        try:
            out = model(input_ids=torch.tensor([[ids[p]]]), position_ids=torch.tensor([[p]]), use_cache=False)
        finally:
            _step = None
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def agreement(reference: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: does the argmax equal the reference's, and KL(reference ‖ logits) in nats."""
    top1 = (reference.argmax(-1) == logits.argmax(-1)).float()
    ref_log, log = torch.log_softmax(reference, -1), torch.log_softmax(logits, -1)
    kl = (ref_log.exp() * (ref_log - log)).sum(-1).clamp_min(0.0)
    return top1, kl


def readers(args, num_layers: int, fingerprint: dict) -> dict[str, object]:
    """label -> what each layer reads: full, the window, each policy at each budget (B tokens:
    DELTA B/16 pages with B/128 recent, as benchmarks.quality maps it; Tidal B tokens)."""
    ctx = at.cpu_context(num_layers, fingerprint)
    out = {"full": FullReads(), f"window-{args.window}": WindowReads(args.window)}
    for budget in args.budgets:
        configs = {
            "delta": {"budget_pages": budget // PAGE_SIZE, "recent_pages": max(1, budget // 128)},
            "tidal": {"budget_tokens": budget},
        }
        for name, config in configs.items():
            policy = build_policy(name, config).for_model(ctx)
            out[f"{name}-{budget}"] = SelectionReads(policy, num_layers)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = harness.trace_parser(BENCH, __doc__, lengths=[8192])
    parser.add_argument("--budgets", type=harness.int_list, default=[256, 512, 1024])
    parser.add_argument("--window", type=int, default=1024, help="the window baseline's tokens")
    parser.add_argument("--positions-from", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=64, help="every stride-th position measured")
    return parser


def measure(args, model_path) -> tuple[dict, str]:
    """(label, length) -> (top-1 per position, KL per position) over every passage; the source."""
    model = load_model(model_path, torch.float32)
    half = load_model(model_path, torch.bfloat16)
    reads = readers(args, model.config.num_hidden_layers, model_fingerprint(model.config))
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    results: dict[tuple[str, int], list[list[torch.Tensor]]] = {}
    source = ""
    for length in args.lengths:
        positions = list(range(args.positions_from, length, args.stride))
        passages, source = at.natural_text_prompts(
            tokenizer, [length] * args.prompts_per_length, args.text_dir
        )
        for ids in passages:
            start = time.perf_counter()
            reference, keys, values = prefill(model, ids, positions)
            measured = {"bf16": prefill(half, ids, positions)[0]}
            for label, reader in reads.items():
                measured[label] = step_logits(model, ids, positions, keys, values, reader)
            for label, logits in measured.items():
                top1, kl = agreement(reference, logits)
                entry = results.setdefault((label, length), [[], []])
                entry[0].append(top1)
                entry[1].append(kl)
            elapsed = time.perf_counter() - start
            print(f"{BENCH}: {length}-token passage, {len(positions)} positions in {elapsed:.0f} s", flush=True)
    budgets = {"bf16": "", **{label: reader.budget for label, reader in reads.items()}}
    return {key: (torch.cat(t), torch.cat(k), budgets[key[0]]) for key, (t, k) in results.items()}, source


def rows_of(info: RunInfo, shape: str, results: dict) -> list[Row]:
    rows = []
    for (label, length), (top1, kl, budget) in results.items():
        for metric, value in (("top1_agreement", top1.mean()), ("kl_nats", kl.mean())):
            rows.append(
                info.row(
                    bench=BENCH, policy=label, model_shape=shape, batch=1, context=length,
                    metric=metric, value=float(value), attention_backend="torch",
                    kv_source="real", budget=budget,
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
    info = RunInfo.detect()
    results, source = measure(args, model_path)
    shape = model_slug(model_path)
    harness.save_results(BENCH, shape, rows_of(info, shape, results), info, args.out_dir, args.results_md)
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
