"""Teacher-forced next-token agreement with full attention: one decode step at a position of a
reference text, with every layer attending as a policy's roles say, against full attention's
next-token distribution there (top-1 agreement and KL(full ‖ step)).

A passage is prefilled once under full attention (transformers, fp32, CPU), keeping every layer's
K/V and the next-token logits at the measured positions. The step at position p feeds token p at
position p through every layer, reading the prefill's K/V of tokens 0..p-1 and its own new K/V;
each layer reads what its ``reads`` say: every token (full), the last W (a window), or, for DELTA
and TidalDecode, as ``layer_roles`` assigns — a selection layer reads every token, then chooses by
the policy's own ``Selection.choose`` from the engine's token scores; a sparse layer reads the
latest choice. The context is the reference text (teacher forcing); the step is the policy's.
benchmarks/agreement.py reports it; sglang_ext.calibrate chooses layer lists by it.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sglang_ext import attention_trace as at
from sglang_ext.policies.selection import LayerRole

ATTENTION = "sglang_ext_agreement"


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
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, **kwargs
    )


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def load_model(model_path, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=dtype, attn_implementation=ATTENTION
    ).eval()


@torch.inference_mode()
def prefill(model, ids: list[int], positions: list[int]):
    """Full attention's next-token logits at ``positions`` [n, vocab] and every layer's K/V."""
    _recorded.clear()
    out = model(
        input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=torch.tensor(positions)
    )
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
            out = model(
                input_ids=torch.tensor([[ids[p]]]),
                position_ids=torch.tensor([[p]]),
                use_cache=False,
            )
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


@dataclasses.dataclass
class Passage:
    """A prefilled reference text: its ids, the measured positions, full attention's logits at
    them and every layer's K/V."""

    ids: list[int]
    positions: list[int]
    reference: torch.Tensor
    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]

    @classmethod
    def prefill(cls, model, ids: list[int], positions: list[int]) -> Passage:
        return cls(ids, positions, *prefill(model, ids, positions))

    def measure(self, model, reads) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position: top-1 agreement and KL of the step that ``reads`` describe."""
        logits = step_logits(model, self.ids, self.positions, self.keys, self.values, reads)
        return agreement(self.reference, logits)


def mean_kl(model, passages: list[Passage], reads) -> float:
    return float(torch.cat([passage.measure(model, reads)[1] for passage in passages]).mean())


def greedy_layers(model, passages: list[Passage], make_policy, first: list[int], count: int):
    """Selection layers chosen one at a time after ``first``: each the layer whose addition gives
    the lowest mean KL (the lowest layer on a tie). ``make_policy(layers)`` builds the policy
    with those selection layers. Returns the layers and every candidate's KL, by its layer list."""
    num_layers = model.config.num_hidden_layers
    chosen, tried = list(first), {}
    while len(chosen) < count:
        candidates = [layer for layer in range(max(first) + 1, num_layers) if layer not in chosen]
        if not candidates:
            raise ValueError(f"{count} selection layers do not fit in {num_layers} layers")
        for layer in candidates:
            layers = sorted([*chosen, layer])
            reads = SelectionReads(make_policy(layers), num_layers)
            tried[str(layers)] = mean_kl(model, passages, reads)
        chosen = min(
            (sorted([*chosen, layer]) for layer in candidates),
            key=lambda layers: (tried[str(layers)], layers),
        )
    return chosen, tried
