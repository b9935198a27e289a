"""The decode attention trace: what every layer's query attends to at each greedy decode step under
full attention, and which tokens DELTA's or TidalDecode's selection keeps for each sparse layer.

Capture: a transformers model on the CPU in fp32, with one attention function registered with
transformers (``TRACE_ATTENTION``). It runs SDPA, so the model decodes as usual, and at each
one-token decode step it also records every layer's query (after RoPE); the key cache of the last
step holds every step's keys. From those the trace gives each layer's exact scaled logits
sm_scale·q·k and their softmax. Prefill records nothing, so no [heads, T, T] matrix is kept.

Replay: at a policy's selection layers, the token scores its selection layers compute in the engine
(``TOKEN_SCORES``, the definitions of kernels/selection_attention.py; tests check them against its
torch references) go through the policy's own choice (``Selection.choose``: ``select_pages`` /
``select_tokens``), and each sparse layer reads the latest selection, as
``SelectionPolicy.layer_roles`` assigns roles. Every layer's query comes from the full-attention
residual stream, so what is measured downstream of a sparse layer is an oracle on hidden states;
the selection rule itself is the engine's.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sglang_ext.policies import DecodeContext
from sglang_ext.policies.selection import LayerRole, Selection, SelectionPolicy

TRACE_ATTENTION = "sglang_ext_trace"
SEED_TEXT_DIR = Path("/work/shared/seeds")  # the papers behind the project, where present

_recorded_queries: dict[int, torch.Tensor] | None = None  # layer -> [q_heads, dim], while recording
_last_keys: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, tokens, dim] of the last call
_last_values: dict[int, torch.Tensor] = {}  # likewise


def _trace_attention(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
    """SDPA, recording the decode query of each layer while a decode step is being traced.
    transformers' own signature: kvpress, once imported, wraps every registered attention
    function and passes ``dropout`` by position."""
    if _recorded_queries is not None:
        assert query.shape[0] == 1 and query.shape[2] == 1, "the trace decodes one sequence"
        _recorded_queries[module.layer_idx] = query[0, :, 0].float()
        _last_keys[module.layer_idx] = key[0]
        _last_values[module.layer_idx] = value[0]
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, **kwargs
    )


AttentionInterface.register(TRACE_ATTENTION, _trace_attention)
AttentionMaskInterface.register(TRACE_ATTENTION, sdpa_mask)


@dataclasses.dataclass
class DecodeTrace:
    """One prompt's greedy decode under full attention.

    queries [steps, layers, q_heads, dim]; keys and values [layers, tokens, kv_heads, dim] in the
    engine's KV-buffer layout; step s attends to the first seq_lens[s] tokens (itself last)."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    seq_lens: list[int]
    sm_scale: float
    prompt_len: int
    generated: list[int]

    @property
    def num_steps(self) -> int:
        return self.queries.shape[0]

    @property
    def num_layers(self) -> int:
        return self.queries.shape[1]

    def logits(self, step: int, layer: int) -> torch.Tensor:
        """[q_heads, seq_len] scaled q·k; query head h reads KV head h // group, as GQA does."""
        q = self.queries[step, layer]
        k = self.keys[layer, : self.seq_lens[step]]
        grouped = q.view(k.shape[1], -1, q.shape[-1])  # [kv_heads, group, dim]
        return torch.einsum("kgd,tkd->kgt", grouped, k).reshape(q.shape[0], -1) * self.sm_scale

    def probs(self, step: int, layer: int) -> torch.Tensor:
        """[q_heads, seq_len] attention probabilities; each head's row sums to 1."""
        return torch.softmax(self.logits(step, layer), dim=-1)


def load_model(model_path: str | Path):
    """A causal LM in fp32 on the CPU that the trace can decode."""
    return AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.float32, attn_implementation=TRACE_ATTENTION
    ).eval()


@torch.inference_mode()
def trace_decode(model, input_ids: list[int], decode_steps: int) -> DecodeTrace:
    """Prefill ``input_ids``, then decode ``decode_steps`` greedy tokens one at a time, tracing
    each step's attention."""
    global _recorded_queries
    if decode_steps < 1:
        raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
    out = model(input_ids=torch.tensor([input_ids]), use_cache=True, logits_to_keep=1)
    token = out.logits[0, -1].argmax()
    queries, generated = [], []
    for _ in range(decode_steps):
        _recorded_queries = {}
        try:
            out = model(
                input_ids=token.view(1, 1), past_key_values=out.past_key_values, use_cache=True
            )
            step_queries = _recorded_queries
        finally:
            _recorded_queries = None
        queries.append(torch.stack([step_queries[i] for i in range(len(step_queries))]))
        generated.append(int(token))
        token = out.logits[0, -1].argmax()
    # [kv_heads, tokens, dim] -> the engine's [tokens, kv_heads, dim]
    keys, values = (
        torch.stack([last[i].transpose(0, 1).float() for i in range(len(last))])
        for last in (_last_keys, _last_values)
    )
    _last_keys.clear()
    _last_values.clear()
    attention = model.model.layers[0].self_attn
    return DecodeTrace(
        queries=torch.stack(queries),
        keys=keys,
        values=values,
        seq_lens=[len(input_ids) + 1 + step for step in range(decode_steps)],
        sm_scale=attention.scaling,
        prompt_len=len(input_ids),
        generated=generated,
    )


def cpu_context(num_layers: int, fingerprint: dict | None = None) -> DecodeContext:
    """A decode context for replaying selections: building one reads only its device, and
    ``for_model`` its depth and fingerprint (for the calibration file), as in the engine."""
    return DecodeContext(
        num_layers=num_layers, base_decode=None, write_kv=None, kv_pool=None, req_to_token=None,
        max_batch_size=1, device=torch.device("cpu"), model_fingerprint=fingerprint,
    )  # fmt: skip


# A selection layer's token score from its [q_heads, seq_len] logits, by the policy's ``score``.
TOKEN_SCORES = {
    "probability": lambda logits: torch.softmax(logits, dim=-1).amax(dim=0),  # max-head probability
    "qk": lambda logits: logits.amax(dim=0),  # max-head sm_scale·q·k
}


def selection_rule(policy: SelectionPolicy, num_layers: int) -> Selection:
    return policy.selection(cpu_context(num_layers))


def choose_tokens(rule: Selection, token_scores: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The token positions [n] that ``rule`` keeps given a selection layer's token scores."""
    selected, num_selected = rule.choose(token_scores[None], None, torch.tensor([seq_len]))
    units = selected[0, : int(num_selected[0])].long()
    tokens = (units[:, None] * rule.page_size + torch.arange(rule.page_size)).flatten()
    return tokens[tokens < seq_len]


def selection_sources(policy: SelectionPolicy, num_layers: int) -> dict[int, int]:
    """Sparse layer -> the selection layer whose choice it reads (the latest before it)."""
    sources, latest = {}, None
    for layer, role in enumerate(policy.layer_roles(num_layers)):
        if role is LayerRole.SELECT:
            latest = layer
        elif role is LayerRole.SPARSE:
            sources[layer] = latest
    return sources


def replay(trace: DecodeTrace, policy: SelectionPolicy) -> list[dict[int, torch.Tensor]]:
    """Per decode step: sparse layer -> the token positions the policy lets it read, chosen by the
    policy's own selection at its selection layers (``policy`` has its layer lists set)."""
    rule, score = selection_rule(policy, trace.num_layers), TOKEN_SCORES[policy.score]
    sources = selection_sources(policy, trace.num_layers)
    steps = []
    for step in range(trace.num_steps):
        seq_len = trace.seq_lens[step]
        chosen = {
            layer: choose_tokens(rule, score(trace.logits(step, layer)), seq_len)
            for layer in set(sources.values())
        }
        steps.append({layer: chosen[source] for layer, source in sources.items()})
    return steps


def attention_recall(probs: torch.Tensor, tokens: torch.Tensor) -> float:
    """DELTA's Eq. 9: the attention mass of ``tokens`` (probs [heads, seq_len]), mean over heads."""
    return float(probs[:, tokens].sum(dim=-1).mean())


def text_files(text_dir: Path = SEED_TEXT_DIR) -> tuple[list[Path], str]:
    """The text files prompts are cut from, and what they are."""
    files = sorted(text_dir.glob("*.txt")) if text_dir.is_dir() else []
    if files:
        return files, f"the text files in {text_dir}"
    # No seed texts on this machine: the standard library's source is plenty of English.
    stdlib = Path(inspect.getsourcefile(os)).parent
    files = [stdlib / name for name in ("argparse.py", "inspect.py", "typing.py", "pathlib.py")]
    return files, f"Python standard-library source ({', '.join(f.name for f in files)})"


def natural_text_prompts(
    tokenizer, lengths: list[int], text_dir: Path = SEED_TEXT_DIR, first_file: int = 0
):
    """One prompt of natural text per length, exactly that many tokens, and where the text comes
    from. Prompt i is the i-th of ``passage_starts`` at its length: the first prompts start
    at the text files' beginnings in turn from the ``first_file``-th on (so a calibration can
    read other text than a benchmark), the next ones further into the files, none repeating
    another's text at the same length."""
    files, source = text_files(text_dir)
    texts = [tokenizer(f.read_text(), add_special_tokens=False)["input_ids"] for f in files]
    sizes = [len(text) for text in texts]
    prompts = []
    for i, length in enumerate(lengths):
        starts = passage_starts(sizes, length, first_file)
        if i >= len(starts):
            raise ValueError(
                f"{i + 1} prompts of {length} tokens from {source} would repeat a passage: "
                f"they give {len(starts)} distinct ones"
            )
        file, offset = starts[i]
        ids: list[int] = []
        for j in range(len(texts)):  # a file shorter than the prompt runs on into the next
            ids += texts[(file + j) % len(texts)][offset if j == 0 else 0 :]
        if len(ids) < length:
            raise ValueError(f"{source} hold {len(ids)} tokens, fewer than {length}")
        prompts.append(ids[:length])
    names = [f.name for f in files]
    description = (
        f"{source}: prompt i reads {names} in turn from the ({first_file} + i)-th, cut to its "
        "length, and past one per file, whole windows further into the files"
    )
    return prompts, description


def passage_starts(sizes: list[int], length: int, first_file: int = 0) -> list[tuple[int, int]]:
    """(file, token offset) of each distinct ``length``-token passage of texts of ``sizes``
    tokens, in the order prompts take them: every file's start from ``first_file`` on, then the
    windows at offsets length, 2 * length, … of each file that hold wholly inside it."""
    order = [(first_file + i) % len(sizes) for i in range(len(sizes))]
    starts = [(file, 0) for file in order]
    for k in range(1, max(sizes, default=0) // max(length, 1)):
        starts += [(file, k * length) for file in order if (k + 1) * length <= sizes[file]]
    return starts
