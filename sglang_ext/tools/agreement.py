"""Teacher-forced next-token agreement with full attention: one decode step at a position of a
reference text, with every layer attending as a policy's roles say, against full attention's
next-token distribution there (top-1 agreement and KL(full ‖ step)).

A passage is prefilled once under full attention (transformers, fp32, CPU), keeping every layer's
K/V and the next-token logits at the measured positions. The step at position p feeds token p at
position p through every layer, reading the prefill's K/V of tokens 0..p-1 and its own new K/V;
each layer reads what its ``reads`` say: every token (full), the last W (a window), or, for DELTA
and TidalDecode, as ``layer_roles`` assigns — a selection layer reads every token, then chooses by
the policy's own ``Selection.choose`` from the engine's token scores; a sparse layer reads the
latest choice; under Lethe each layer reads what the engine's own Lethe runtime retains after a
decode from the prompt's end to the position (``LetheReads``); under a kvpress press, what its
compressions keep (sglang_ext.tools.kvpress_reads). The context is the reference text (teacher
forcing); the step is the policy's. benchmarks/agreement.py and benchmarks/eviction_fidelity.py
report it; sglang_ext.tools.calibrate chooses layer lists by it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sglang_ext.tools import attention_trace as at
from sglang_ext.policies.base import DecodeContext
from sglang_ext.policies.runtime import EngineOps, StepRequest
from sglang_ext.policies.selection import LayerRole

ATTENTION = "sglang_ext_agreement"


class FullReads:
    """Every layer reads every token. What every reads object offers: ``tokens`` (what a layer
    reads at the step, None: all), ``advance`` (called before the step at a position) and
    ``take_kept`` (the share of KV an evicting policy held at each step since the last call)."""

    budget = ""

    def advance(self, passage: Passage, position: int) -> None:
        """Stateless reads need nothing before a step."""

    def take_kept(self) -> list[float]:
        return []  # reads that evict nothing

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        return None


@dataclasses.dataclass
class WindowReads(FullReads):
    """Every layer reads the last ``window`` tokens."""

    window: int

    @property
    def budget(self) -> str:
        return f"{self.window} tokens"

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        seq_len = logits.shape[1]
        return torch.arange(max(0, seq_len - self.window), seq_len)


class SelectionReads(FullReads):
    """A DELTA or TidalDecode step: each layer reads as its role says (``layer_roles``), the
    selections chosen by the policy's own rule from the engine's token scores."""

    def __init__(self, policy, num_layers: int):
        self.roles = policy.layer_roles(num_layers)
        self.rule = at.selection_rule(policy, num_layers)
        self.score = at.TOKEN_SCORES[policy.score]
        self.budget = policy.budget()
        self.selected: torch.Tensor | None = None

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        role = self.roles[layer]
        if role is LayerRole.SELECT:
            self.selected = at.choose_tokens(self.rule, self.score(logits), logits.shape[1])
        return self.selected if role is LayerRole.SPARSE else None


class PerKVHeadSelectionReads(SelectionReads):
    """As ``SelectionReads``, but each KV head keeps its own selection, chosen by the same rule
    from the scores of its own query group (as Quest and TidalDecode's per-head variants do under
    GQA), and a sparse layer's KV head h reads what KV head h of the selection layer chose.
    ``tokens`` then gives a [q_heads, seq_len] mask of what each query head may read."""

    def __init__(self, policy, num_layers: int, kv_heads: int):
        super().__init__(policy, num_layers)
        self.kv_heads = kv_heads

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        if self.roles[layer] is LayerRole.SELECT:
            q_heads, seq_len = logits.shape
            group = q_heads // self.kv_heads
            self.selected = torch.zeros(q_heads, seq_len, dtype=torch.bool)
            for head, head_logits in enumerate(logits.view(self.kv_heads, group, seq_len)):
                chosen = at.choose_tokens(self.rule, self.score(head_logits), seq_len)
                self.selected[head * group : (head + 1) * group, chosen] = True
        return self.selected if self.roles[layer] is LayerRole.SPARSE else None


class DecodedReads(FullReads):
    """Reads that follow a decode of the passage from ``prompt_len`` on, one step at a time:
    ``advance`` restarts at a new passage (or an earlier position) and runs the steps before the
    measured one (``_start``, ``_run_to``); each step's kept share is ``_held`` over the
    positions so far."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self._kept: list[float] = []
        self._passage: Passage | None = None
        self._next = prompt_len

    def advance(self, passage: Passage, position: int) -> None:
        if position < self.prompt_len:
            raise ValueError(f"position {position} lies in the prompt (< {self.prompt_len})")
        if passage is not self._passage or position < self._next:
            self._start(passage)
        self._run_to(position)
        self._kept.append(self._held(position) / (position + 1))

    def take_kept(self) -> list[float]:
        kept, self._kept = self._kept, []
        return kept

    def _start(self, passage: Passage) -> None:
        raise NotImplementedError

    def _run_to(self, position: int) -> None:
        """The steps before ``position``'s read, and its own up to the read."""
        raise NotImplementedError

    def _held(self, position: int) -> float:
        """The KV held at ``position``'s read (its own token included)."""
        raise NotImplementedError


class LetheReads(DecodedReads):
    """A Lethe step: each layer reads the tokens it retains, as the engine's own Lethe runtime
    (``sglang_ext.policies.lethe.runtime.LetheRuntime``, its CPU path) keeps them over a decode of the passage
    from ``prompt_len`` on: the prompt's last queries seed the scores, every step appends its token
    and adds its attention (RASR), and rounds run whenever the runtime's plan says. Teacher
    forcing: every step's query is the full prefill's (the measured step alone is the policy's
    own forward). ``take_kept``: per measured position, the share of the positions so far whose
    KV the request still holds."""

    ROW = 1  # the request's row in the runtime's one-request table (row 0 left unused)

    def __init__(self, policy, num_layers: int, prompt_len: int):
        super().__init__(prompt_len)
        self.policy, self.num_layers = policy, num_layers
        self.budget = policy.budget()

    def _run_to(self, position: int) -> None:
        while self._next <= position:
            self._begin_step(self._next)
            if self._next < position:  # the measured step's own update follows its measurement
                self._update_scores(self._next)
            self._next += 1
        self._pending = position

    def _held(self, position: int) -> float:
        return position + 1 - self._request.state.evicted

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        """A layer's retained positions; with lists per KV head a [q_heads, seq_len] mask, each
        query head reading its KV head's list."""
        runtime, heads = self._runtime, self._runtime.lists_per_layer
        lists = [
            runtime.positions[i, self.ROW, : runtime.count[i, self.ROW]].long()
            for i in range(layer * heads, (layer + 1) * heads)
        ]
        if heads == 1:
            return lists[0]
        q_heads, seq_len = logits.shape
        group = q_heads // heads
        mask = torch.zeros(q_heads, seq_len, dtype=torch.bool)
        for head, positions in enumerate(lists):
            mask[head * group : (head + 1) * group, positions] = True
        return mask

    def _start(self, passage: Passage) -> None:
        self._passage, self._next, self._pending = passage, self.prompt_len, None
        n = len(passage.ids)
        # the layers in one buffer each, as the engine allocates them for per-layer memory
        layers = range(self.num_layers)
        by_slot = torch.stack([passage.keys[layer].transpose(0, 1) for layer in layers]).unbind(0)
        values = torch.stack([passage.values[layer].transpose(0, 1) for layer in layers]).unbind(0)
        ctx = DecodeContext(
            num_layers=self.num_layers, base_decode=None, write_kv=None,
            kv_pool=SimpleNamespace(
                get_key_buffer=by_slot.__getitem__, get_value_buffer=values.__getitem__
            ),
            req_to_token=torch.arange(n, dtype=torch.int32).repeat(self.ROW + 1, 1),
            max_batch_size=1, device=torch.device("cpu"),
        )  # fmt: skip
        self._runtime = self.policy.runtime(ctx)
        # the freed slots go nowhere: the passage's K/V stay where the prefill put them
        self._engine = EngineOps(lambda slots: None, lambda: 0, rerun_extend=None)
        state = self._runtime.new_request(self.policy, None)
        prompt = self.prompt_len
        self._request = StepRequest(state, "passage", self.ROW, prompt, prompt, [], 0)
        prefill = self._batch(self.prompt_len, extend_seq_lens_cpu=[self.prompt_len])
        self._runtime.run_plan(
            self._runtime.plan_step([self._request], False), prefill, self._engine
        )
        for layer in range(self.num_layers):
            queries = passage.queries[layer][:, : self.prompt_len].transpose(0, 1)
            self._runtime.after_extend(queries, self._layer(layer), prefill)

    def _begin_step(self, position: int) -> None:
        """The step's plan (rounds) and its token joining every layer's list, as in the engine."""
        if self._pending is not None:
            self._update_scores(self._pending)
            self._pending = None
        self._request.seq_len = position + 1
        batch = self._batch(position + 1)
        plan = self._runtime.plan_step([self._request], True)
        self._runtime.run_plan(plan, batch, self._engine)  # a round counts its frees in the state
        self._runtime.prepare_decode(batch)

    def _update_scores(self, position: int) -> None:
        """The step's attention over each layer's list, with the prefill's query: RASR scores."""
        batch = self._batch(position + 1)
        for layer, decode in enumerate(self._runtime.decode_fns):
            query = self._passage.queries[layer][:, position].reshape(1, -1)
            decode(query, None, None, self._layer(layer), batch, False)

    def _batch(self, seq_len: int, **extra):
        rows, lens = torch.tensor([self.ROW]), torch.tensor([seq_len])
        return SimpleNamespace(
            req_pool_indices=rows, seq_lens=lens, seq_lens_cpu=lens,
            out_cache_loc=lens - 1,  # the decoded token's slot: slots are positions here
            **extra,
        )  # fmt: skip

    def _layer(self, layer: int):
        heads, _, dim = self._passage.queries[layer].shape
        return SimpleNamespace(
            layer_id=layer, tp_q_head_num=heads, qk_head_dim=dim, scaling=self._passage.scaling
        )


class EvictedSelectionReads(LetheReads):
    """``EVICTION+SELECTION`` (``lethe+tidal``): every layer reads Lethe's retained set, as
    ``LetheReads`` keeps it, but the selection's sparse layers, which read what its latest
    selection layer chose among that set by the policy's own rule (``SelectionReads``, over the
    step's scores of the retained tokens). The decode between measured steps is the composed
    runtime's own (``policies.eviction_selection``). ``policy`` has its layer lists set."""

    def __init__(self, policy, num_layers: int, prompt_len: int):
        super().__init__(policy, num_layers, prompt_len)
        self.selection = SelectionReads(policy.selection, num_layers)

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        retained = super().tokens(layer, logits)  # one set: the same at every layer
        chosen = self.selection.tokens(layer, logits[:, retained])  # entries of the set
        return retained if chosen is None else retained[chosen]


def decoded_reads(policy, num_layers: int, prompt_len: int) -> LetheReads:
    """The reads of an evicting policy, or of a selection composed over one."""
    composed = getattr(policy, "selection", None) is not None
    reads = EvictedSelectionReads if composed else LetheReads
    return reads(policy, num_layers, prompt_len)


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
        if tokens is not None and tokens.dtype == torch.bool:  # a mask per query head
            logits = logits.masked_fill(~tokens, float("-inf"))
        elif tokens is not None:  # positions every head reads
            allowed = torch.full_like(logits, float("-inf"))
            allowed[:, tokens] = 0.0
            logits = logits + allowed
        probs = torch.softmax(logits, dim=-1).view(kv_heads, q_heads // kv_heads, -1)
        out = torch.einsum("kgt,ktd->kgd", probs, v).reshape(q_heads, -1)
        return out.to(query.dtype)[None, None], None  # [batch 1, token 1, q_heads, dim]


_step: OneStep | None = None  # while a one-step decode runs
# layer -> the prefill's (queries, keys, values, scaling)
_recorded: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    # transformers' own signature: a wrapper that passes dropout by position (kvpress's, applied
    # to every registered attention function when kvpress is imported) calls it right
    if _step is not None:
        return _step.attend(module.layer_idx, query, key, value, scaling)
    _recorded[module.layer_idx] = (query[0].float(), key[0].float(), value[0].float(), scaling)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


@contextlib.contextmanager
def _attention_inputs(model, into: dict[int, torch.Tensor]):
    """While it lasts, each layer's attention input (its hidden states, [tokens, hidden]) goes
    into ``into``, by layer."""

    def record(module, args, kwargs):
        into[module.layer_idx] = kwargs["hidden_states"][0].float()

    hooks = [
        layer.self_attn.register_forward_pre_hook(record, with_kwargs=True)
        for layer in model.model.layers
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def load_model(model_path, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=dtype, attn_implementation=ATTENTION
    ).eval()


@torch.inference_mode()
def prefill(model, ids: list[int], positions: list[int]):
    """Full attention's next-token logits at ``positions`` [n, vocab], every layer's K/V and
    queries ([heads, tokens, dim] each), and the attention's scaling."""
    _recorded.clear()
    out = model(
        input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=torch.tensor(positions)
    )
    queries, keys, values = ({layer: r[i] for layer, r in _recorded.items()} for i in range(3))
    scaling = next(iter(_recorded.values()))[3]
    _recorded.clear()
    return out.logits[0].float(), keys, values, queries, scaling


@torch.inference_mode()
def step_logits(model, passage: Passage, reads) -> torch.Tensor:
    """[n, vocab]: the decode step at each of the passage's positions, each layer reading as
    ``reads`` says."""
    global _step
    rows = []
    ids = passage.ids
    for p in passage.positions:
        reads.advance(passage, p)
        _step = OneStep(passage.keys, passage.values, p, reads)
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
    them, every layer's K/V and queries, the attention's scaling and, where asked for, every
    layer's attention input (``hidden``)."""

    ids: list[int]
    positions: list[int]
    reference: torch.Tensor
    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    queries: dict[int, torch.Tensor]
    scaling: float
    hidden: dict[int, torch.Tensor] | None = None  # layer -> [tokens, hidden]

    @classmethod
    def prefill(
        cls, model, ids: list[int], positions: list[int], hidden_states: bool = False
    ) -> Passage:
        """``hidden_states``: also keep each layer's attention input, for reads that recompute
        queries from it (kvpress's presses: sglang_ext.tools.kvpress_reads)."""
        hidden: dict[int, torch.Tensor] = {}
        with _attention_inputs(model, hidden) if hidden_states else contextlib.nullcontext():
            recorded = prefill(model, ids, positions)
        return cls(ids, positions, *recorded, hidden=hidden or None)

    def measure(self, model, reads) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position: top-1 agreement and KL of the step that ``reads`` describe."""
        logits = step_logits(model, self, reads)
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
