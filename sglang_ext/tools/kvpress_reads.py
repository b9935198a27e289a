"""NVIDIA kvpress's decode-time eviction as a reads object of the agreement measure
(sglang_ext.tools.agreement): what each layer's KV heads still hold at a decode step of a passage,
when a kvpress ScorerPress compresses the cache at prefill and again every few decoded tokens.

kvpress (requirements/kvpress.txt, an extra) is imported only here, and only when a press is built:
the package never needs it.

How a press P is driven: as kvpress 0.5.5's
``PrefillDecodingPress(prefilling_press=P, decoding_press=CompressionRatioDecodingPress(
base_press=P, target_compression_ratio=1 - kv_ratio, compression_interval=N))`` compresses one
request that prefills the passage's first ``prompt_len`` tokens and then decodes the rest one token
a step, teacher-forced (every token's hidden states, keys and values are the full-attention
prefill's):

- Prefill: every layer's cache, the prompt's keys and values, is scored by P's own ``score(module,
  hidden_states, keys, values, attentions, kwargs)``: ``hidden_states`` the layer's attention input
  over the prompt, ``attentions`` None (kvpress runs sdpa, which returns none), ``kwargs`` the
  model's RoPE ``position_embeddings`` (cos, sin) and the ``position_ids`` of the prompt's
  positions, with ``P.compression_ratio = 1 - kv_ratio``. Each KV head keeps its
  ``compute_n_kept(prompt_len, 1 - kv_ratio)`` best, ``scores.topk`` as ``ScorerPress.compress``
  takes them, in topk's order: that order is the cache's from then on, and the next compression's
  scores index it.
- Decode: the step at position p appends token p to every layer's cache and reads it at once.
  After the step that makes N steps since the last compression (the decoding press's hook runs
  after the layer's attention), every layer's cache (its kept entries, then the tokens decoded
  since, in cache order) is scored again as its hook would: ``hidden_states`` the layer inputs it
  buffered since the last compression (at most ``hidden_states_buffer_size`` of the steps before p,
  and p's), ``kwargs`` the RoPE and ``position_ids`` of step p alone, ``P.compression_ratio`` the
  ratio ``CompressionRatioDecodingPress`` finds for its target (its own ``_resolve_target_size``:
  ``int((p + 1) * kv_ratio)``, and ``_find_target_compression_ratio``); each KV head keeps its best
  as above.

Being kvpress's own inputs, they carry kvpress's decode-time behaviour: SnapKV's window queries and
TOVA's last query are rotated by p's RoPE alone, ExpectedAttention averages RoPE over the positions
after the buffer's length, and StreamingLLM and ExpectedAttention protect the first ``n_sink`` cache
entries, which after a compression are the first of topk's order, not the first positions. Entries
of equal score (SnapKV's window, all given the same top score) leave ``topk`` in an order of its
own, which SnapKV's next pooling runs over. ``plain`` drives a press without the RoPE of p alone
and with equal scores in cache order. SnapKV's window is kvpress's default shortened to fit in
what the decoding press buffers between compressions (its score asserts that the window is
shorter). Presses that need attention recompute it from hidden states (SnapKV: its window's
queries; TOVA: the last query; ExpectedAttention: query statistics); KNorm, StreamingLLM and
Random read only the cache. Random's draws come from a stream of its own, seeded per passage, so a
passage measured again keeps the same positions.

Where kvpress's own generation differs: tokens decoded after a compression see the compressed
cache in the layers below, so their hidden states, keys and values (and so the presses' later
choices) differ from full attention's above layer 0; at layer 0 the two coincide (tests compare the
two there). kvpress's hooks read ``kwargs["cache_position"]``, which transformers 5.12 no longer
passes; its own generation runs here only with ``cache_position`` given to the model by hand.

What a step reads (``tokens``): at measured position p each KV head of a layer reads its kept
positions, those decoded since the last compression and p itself; each query head reads its KV
head's, a [q_heads, p + 1] mask. ``take_kept``: per measured position, that count over p + 1,
averaged over layers and KV heads.
"""

from __future__ import annotations

import torch

from sglang_ext.tools.agreement import DecodedReads, Passage

# the presses this module builds by name: name -> kvpress's class
PRESSES = {
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "expected_attention": "ExpectedAttentionPress",
    "streaming_llm": "StreamingLLMPress",
    "knorm": "KnormPress",
    "random": "RandomPress",
}


def make_press(name: str, compression_interval: int):
    """kvpress's press ``name`` (of ``PRESSES``) with its defaults, SnapKV's window shortened
    where it would not fit in the hidden states buffered between compressions."""
    import kvpress

    cls = getattr(kvpress, PRESSES[name])
    if cls is kvpress.SnapKVPress:
        return cls(window_size=min(cls.window_size, compression_interval - 1))
    return cls()


class KvpressReads(DecodedReads):
    """Each layer's KV heads read what ``press`` keeps, driven as the module says, at ``kv_ratio``
    of the tokens seen, the first ``prompt_len`` tokens the prompt, compressed again every
    ``compression_interval`` decoded tokens. ``one_list_per_layer``: the press's scores averaged
    over a layer's KV heads before the top-k, so that every head keeps the same entries (as the
    policies on Lethe's runtime do): what per-head lists are worth, measured. ``by_position``:
    each compression leaves the cache by ascending position instead of in its top-k's order, so
    the next compression's pooling (SnapKV's) runs over neighbouring positions rather than over
    entries that ranked alike: what kvpress's cache order is worth, measured. ``plain``: without
    the two behaviours of kvpress's driving that a port need not share (the module's docstring):
    a decode compression's RoPE covers the buffered steps' own positions (SnapKV's window
    queries each at its own), and equal scores keep their cache order (a stable sort, where
    ``topk`` leaves the window's tied entries in an order of its own); what a port that agrees
    with kvpress entry for entry is compared with (tests/test_bench_eviction_fidelity.py)."""

    def __init__(
        self, model, press, kv_ratio: float, prompt_len: int, compression_interval: int,
        seed: int = 0, one_list_per_layer: bool = False, by_position: bool = False,
        plain: bool = False,
    ):  # fmt: skip
        from kvpress import CompressionRatioDecodingPress

        if not 0 < kv_ratio <= 1:
            raise ValueError(f"kv_ratio must be in (0, 1], got {kv_ratio}")
        super().__init__(prompt_len)
        self.press, self.seed = press, seed
        self.one_list_per_layer, self.by_position = one_list_per_layer, by_position
        self.plain = plain
        self.decoding = CompressionRatioDecodingPress(  # its default hidden_states_buffer_size
            base_press=press, target_compression_ratio=1 - kv_ratio,
            compression_interval=compression_interval,
        )  # fmt: skip
        self.prefill_ratio = 1 - kv_ratio
        self.budget = f"{kv_ratio:g}"
        language_model = model.model
        self.modules = [layer.self_attn for layer in language_model.layers]
        for module in self.modules:  # as BasePress.__call__ does
            module.rotary_emb = language_model.rotary_emb
        self.rotary = language_model.rotary_emb
        press.post_init_from_model(model)

    def _run_to(self, position: int) -> None:
        while self._next < position:  # the measured step's own compression follows its read
            self._next += 1  # the step at _next - 1 appended its token
            self._after_step(self._next - 1)

    def _held(self, position: int) -> float:
        held = [self.held(layer).shape[1] for layer in range(len(self.modules))]
        return sum(held) / len(held) + 1  # and the token itself

    def tokens(self, layer: int, logits: torch.Tensor) -> torch.Tensor:
        q_heads, seq_len = logits.shape
        held = self.held(layer)
        mask = torch.zeros(held.shape[0], seq_len, dtype=torch.bool)
        mask.scatter_(1, held, True)
        mask[:, seq_len - 1] = True  # the step's own token
        return mask.repeat_interleave(q_heads // held.shape[0], dim=0)

    def held(self, layer: int) -> torch.Tensor:
        """[kv_heads, n]: the positions in the layer's cache before the next step, in cache
        order (the entries kept at the last compression, then the tokens decoded since)."""
        kv_heads = self._slots[layer].shape[0]
        decoded = torch.arange(self._since, self._next).expand(kv_heads, -1)
        return torch.cat([self._slots[layer], decoded], dim=1)

    def _start(self, passage: Passage) -> None:
        if passage.hidden is None:
            raise ValueError(
                "kvpress's presses need the passage's hidden states (hidden_states=True)"
            )
        self._passage, self._since, self._next = passage, 0, self.prompt_len
        self._rng = torch.Generator().manual_seed(self.seed).get_state()
        ids = torch.arange(len(passage.ids))[None]
        self._cos, self._sin = self.rotary(passage.hidden[0][None], ids)
        kv_heads = passage.keys[0].shape[0]
        self._slots = [torch.zeros(kv_heads, 0, dtype=torch.long) for _ in self.modules]
        prompt = torch.arange(self.prompt_len)
        self._compress(0, prompt, lambda k_len, kwargs: self.prefill_ratio)

    def _after_step(self, position: int) -> None:
        """The decoding press's hook after the step at ``position``: a compression every
        ``compression_interval`` steps."""
        if position + 1 - self._since < self.decoding.compression_interval:
            return
        buffered = max(self._since, position - self.decoding.hidden_states_buffer_size)
        positions = torch.arange(buffered, position + 1) if self.plain else torch.tensor([position])
        self._compress(buffered, positions, self._decode_ratio)

    def _decode_ratio(self, k_len: int, kwargs: dict) -> float:
        target = self.decoding._resolve_target_size(kwargs)
        return self.decoding._find_target_compression_ratio(k_len, target)

    def _compress(self, buffered: int, positions: torch.Tensor, ratio_of) -> None:
        """Every layer's cache re-chosen by the press: ``buffered`` the first position whose
        hidden states the press sees, ``positions`` those of the forward it runs after (RoPE,
        position_ids), ``ratio_of(k_len, kwargs)`` the compression ratio it gets."""
        passage, last = self._passage, int(positions[-1])
        kwargs = {
            "position_embeddings": (self._cos[:, positions], self._sin[:, positions]),
            "position_ids": positions[None],
        }
        for layer, module in enumerate(self.modules):
            cache = self.held(layer)
            ratio = ratio_of(cache.shape[1], kwargs)
            if ratio > 0:  # ScorerPress.compress returns the cache as it is at 0
                hidden = passage.hidden[layer][buffered : last + 1][None]
                chosen = self._choose(module, ratio, hidden, cache, layer, kwargs)
                cache = cache.gather(1, chosen)
                if self.by_position:
                    cache = cache.sort(1).values
            self._slots[layer] = cache
        self._since = last + 1

    def _choose(self, module, ratio: float, hidden, cache, layer: int, kwargs) -> torch.Tensor:
        """[kv_heads, n_kept]: the cache entries each KV head keeps, as ScorerPress.compress
        chooses them."""
        from kvpress.utils import compute_n_kept

        index = cache[..., None].expand(-1, -1, self._passage.keys[layer].shape[-1])
        keys = self._passage.keys[layer].gather(1, index)[None]
        values = self._passage.values[layer].gather(1, index)[None]
        self.press.compression_ratio = ratio
        with torch.random.fork_rng(devices=[]):  # Random's draws, from its own stream
            torch.set_rng_state(self._rng)
            scores = self.press.score(module, hidden, keys, values, None, kwargs)
            self._rng = torch.get_rng_state()
        if self.one_list_per_layer:  # ties break alike in every head: the rows are equal
            scores = scores.mean(1, keepdim=True).expand_as(scores)
        n_kept = compute_n_kept(cache.shape[1], ratio)
        if self.plain:
            return scores.sort(dim=-1, descending=True, stable=True).indices[0, :, :n_kept]
        return scores.topk(n_kept, dim=-1).indices[0]
