"""Decode attention for selection layers: the output plus the scores the next layers select by.

DELTA (Δ-layers): token score s_t = max over query heads of the attention probability of token t
(max, not mean, so one head locking onto a token is enough); page score = sum of s_t over the
page's 16 tokens.

TidalDecode (token-selection layers): token score = max over query heads of the scaled logit q·k.
The paper ranks tokens by <q, K> since softmax keeps a head's order; its released code keeps a
top-k per query head. Our sparse layers share one token list across heads, so heads are merged:
max (not sum) keeps a token that any single head favours, where a sum of signed logits lets heads
cancel out.

Scores are per logical position, fp32, in ragged rows (``ScoreRows``): a request's row starts
where the one before it ends (rounded up to a page) in one buffer sized by the KV pool's tokens,
and holds its own tokens (-inf past its end within its last page) and pages, nothing more.

How: stage 1 of the split-KV kernel also stores the scaled logits ([q_heads, ragged rows], fp32);
once stage 2 has each head's exact LSE, one fused kernel turns them into probabilities
(exp(logit - LSE)), takes the max over heads and sums pages. Storing logits (4 B per token per
query head) costs far less bandwidth than re-reading K (2·head_dim B per token per KV head).

Under an evicting policy (``policies.eviction_selection``) the same pass also makes the
eviction's RASR update (``RetentionUpdate``): the selection layer's one attention serves both.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .kv_view import KVView
from .split_kv_decode import SplitKVWorkspace, attend_positions_ref, split_kv_decode

PAGE_SIZE = 16
# Tokens per scoring program (a multiple of the page size) and its warps: the fastest of
# benchmarks.kernel_bench --parts tune's scores_ms rows; short programs spend more time starting
# than reading.
SCORES_BLOCK_T, SCORES_WARPS = 256, 4


class RetentionUpdate(NamedTuple):
    """An evicting policy's RASR update made by a selection layer's scoring pass:
    scores[rows[b], j] = decay * scores[rows[b], j] + the sum over query heads of the attention
    probability token j of request b received, for j below its length (``kernels.rasr``'s
    ``accumulate``). scores [state rows, >= longest] fp32, rows [batch] int64."""

    scores: torch.Tensor
    rows: torch.Tensor
    decay: float


@triton.jit
def _scores_kernel(
    Logits,
    Lse,
    SeqLens,
    RowStart,
    TokenScores,
    PageScores,
    Retained,
    RetainedRows,
    decay,
    stride_lg_b,
    stride_lg_h,
    stride_ts_b,
    stride_ps_b,
    stride_rt_row,
    max_seq_len,
    max_pages,
    NUM_Q_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PAGE: tl.constexpr,
    USE_PROBS: tl.constexpr,
    WRITE_PAGES: tl.constexpr,
    RAGGED: tl.constexpr,
    RETAIN: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    seq_len = tl.load(SeqLens + batch)
    # the row's blocks past the request's last are left as they are: nothing reads them
    if block * BLOCK_T < seq_len:
        if RAGGED:  # the row is its own pages at RowStart[batch] of one long row (max_seq_len)
            start = tl.load(RowStart + batch)
            logits_row, token_row, page_row = start, start, start // PAGE
            page_end = tl.minimum(tl.cdiv(seq_len, PAGE), max_pages - page_row)
            token_end = page_end * PAGE
        else:
            logits_row, token_row = batch * stride_lg_b, batch * stride_ts_b
            page_row, token_end, page_end = batch * stride_ps_b, max_seq_len, max_pages
        offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        valid_t = offs_t < seq_len
        offs_h = tl.arange(0, BLOCK_HQ)
        mask_h = offs_h < NUM_Q_HEADS

        logits = tl.load(
            Logits + logits_row + offs_h[:, None] * stride_lg_h + offs_t[None, :],
            mask=mask_h[:, None] & valid_t[None, :],
            other=float("-inf"),
        )
        if USE_PROBS or RETAIN:
            lse = tl.load(Lse + batch * NUM_Q_HEADS + offs_h, mask=mask_h, other=0.0)
            probs = tl.exp(logits - lse[:, None])
            if RETAIN:
                retained = Retained + tl.load(RetainedRows + batch).to(tl.int64) * stride_rt_row
                old = tl.load(retained + offs_t, mask=valid_t, other=0.0)
                received = tl.sum(probs, 0)
                tl.store(retained + offs_t, decay * old + received, mask=valid_t)
            if USE_PROBS:
                logits = probs
        token = tl.where(valid_t, tl.max(logits, 0), float("-inf"))
        tl.store(TokenScores + token_row + offs_t, token, mask=offs_t < token_end)

        if WRITE_PAGES:
            page = tl.sum(tl.reshape(tl.where(valid_t, token, 0.0), [BLOCK_T // PAGE, PAGE]), 1)
            offs_p = block * (BLOCK_T // PAGE) + tl.arange(0, BLOCK_T // PAGE)
            page = tl.where(offs_p * PAGE < seq_len, page, float("-inf"))
            tl.store(PageScores + page_row + offs_p, page, mask=offs_p < page_end)


def score_tokens(
    logits: torch.Tensor,
    lse: torch.Tensor,
    seq_lens: torch.Tensor,
    token_scores: torch.Tensor,
    page_scores: torch.Tensor | None = None,
    *,
    use_probs: bool = True,
    row_start: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    block_t: int = SCORES_BLOCK_T,
    num_warps: int = SCORES_WARPS,
    retention: RetentionUpdate | None = None,
) -> None:
    """token_scores [batch, T] (and page_scores [batch, ceil(T / 16)] when given) from stage 1's
    logits [batch, q_heads, T] and stage 2's lse [batch, q_heads]: the max over heads of the
    probability (``use_probs``) or of the logit; -inf past each request's end up to the end of
    its last ``block_t``-token block, entries past that block left untouched (the work follows
    each request's length, not the row's: the selection reads no further).

    Ragged (``row_start`` [batch] int64, multiples of 16, as ``ScoreRows`` lays them out): logits
    is [q_heads, capacity], token_scores [capacity] and page_scores [capacity / 16]; request b's
    tokens start at column row_start[b], its pages at row_start[b] / 16, and only its own pages
    are written (-inf past its end within its last page); ``max_seq_len`` is the longest request
    (the grid). With ``retention`` the same pass makes that RASR update."""
    ragged = row_start is not None
    if ragged:
        num_q_heads, batch = logits.shape[0], row_start.shape[0]
        lg_strides, ts_stride, ps_stride = (0, logits.stride(0)), 0, 0
        token_limit = token_scores.shape[0]
    else:
        batch, num_q_heads, max_seq_len = logits.shape
        lg_strides, ts_stride = logits.stride()[:2], token_scores.stride(0)
        ps_stride = 0 if page_scores is None else page_scores.stride(0)
        token_limit = max_seq_len
    pages = token_scores if page_scores is None else page_scores  # an unwritten placeholder
    page_limit = triton.cdiv(token_limit, PAGE_SIZE) if page_scores is None else pages.shape[-1]
    # unread placeholders without one
    retained, retained_rows, decay = retention or (token_scores, seq_lens, 1.0)
    _scores_kernel[(batch, triton.cdiv(max_seq_len, block_t))](
        logits, lse, seq_lens, row_start if ragged else seq_lens, token_scores, pages,
        retained, retained_rows, decay,
        *lg_strides, ts_stride, ps_stride, retained.stride(0), token_limit, page_limit,
        NUM_Q_HEADS=num_q_heads, BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_T=block_t,
        PAGE=PAGE_SIZE, USE_PROBS=use_probs, WRITE_PAGES=page_scores is not None, RAGGED=ragged,
        RETAIN=retention is not None, num_warps=num_warps,
    )  # fmt: skip


class ScoreRows:
    """A selection layer's logits and scores for a decode batch, owned up front and laid out
    ragged: request b's row starts at token column ``row_start[b]`` of one long row (per query
    head for the logits), its length rounded up to a page, the rows in batch order. So the
    buffers follow the batch's own tokens, not batch x --context-length, and every selection
    layer of a step reuses them.

    ``capacity`` tokens hold a batch of up to ``fits_tokens`` tokens in all (the KV pool's: a
    batch without shared prefixes), every row's rounding to a page and a padded CUDA graph batch
    included. A step whose requests count more (a shared prefix counts once per request) must run
    eagerly: ``reserve`` says so on the host and grows a second set of buffers for it, which no
    CUDA graph has recorded."""

    def __init__(self, fits_tokens: int, max_batch: int, num_q_heads: int, device, pages: bool):
        self.fits_tokens, self.max_batch = fits_tokens, max_batch
        self.num_q_heads, self.device, self.with_pages = num_q_heads, torch.device(device), pages
        self.row_start = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        self._graphed = self._buffers(self._capacity(fits_tokens))
        self._grown = None
        self.logits, self.tokens, self.pages = self._graphed

    def _capacity(self, tokens: int) -> int:
        return tokens + PAGE_SIZE * self.max_batch  # each row, padding ones too, up to a page

    def _buffers(self, capacity: int):
        f32 = {"dtype": torch.float32, "device": self.device}
        pages = torch.empty(capacity // PAGE_SIZE, **f32) if self.with_pages else None
        return torch.empty(self.num_q_heads, capacity, **f32), torch.empty(capacity, **f32), pages

    def reserve(self, total_tokens: int) -> bool:
        """Before a decode step, on the host: make room for a batch of ``total_tokens`` tokens
        (the sum of its seq_lens); False when that needs the eager buffers (no CUDA graph)."""
        if total_tokens <= self.fits_tokens:
            self.logits, self.tokens, self.pages = self._graphed
            return True
        if self._grown is None or self._grown[1].shape[0] < self._capacity(total_tokens):
            self._grown = None  # freed before the larger one is made
            self._grown = self._buffers(self._capacity(max(total_tokens, 2 * self.fits_tokens)))
        self.logits, self.tokens, self.pages = self._grown
        return False

    def place(self, seq_lens: torch.Tensor) -> None:
        """On the device, once per decode step (CUDA graphs record it): each row's start."""
        rounded = (seq_lens.long() + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
        starts = self.row_start[: seq_lens.shape[0]]
        torch.cumsum(rounded, 0, out=starts)
        starts.sub_(rounded)


def ragged_selection_attention(
    q: torch.Tensor,
    kv: KVView,
    sm_scale: float,
    *,
    rows: ScoreRows,
    use_probs: bool,
    workspace: SplitKVWorkspace | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    retention: RetentionUpdate | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A selection layer's full attention with its scores in ``rows``' ragged buffers (placed for
    this batch): (out, token_scores [capacity], page_scores [capacity / 16] or None: page sums
    where ``rows`` has pages), a token's score the max over query heads of its attention
    probability (``use_probs``, DELTA's) or of its scaled logit q·k (TidalDecode's).
    ``workspace`` or ``num_kv_splits`` as for split_kv_decode; ``retention`` as for
    score_tokens."""
    out, lse = split_kv_decode(
        q, kv, sm_scale, logits=rows.logits, logits_row_start=rows.row_start,
        num_kv_splits=num_kv_splits, workspace=workspace, out=out,
    )  # fmt: skip
    pages = rows.pages
    score_tokens(
        rows.logits, lse, kv.lengths, rows.tokens, pages, use_probs=use_probs,
        row_start=rows.row_start[: q.shape[0]], max_seq_len=kv.table.shape[1], retention=retention,
    )  # fmt: skip
    return out, rows.tokens, pages


def _full_attention_ref(q: torch.Tensor, kv: KVView, sm_scale: float, with_values: bool = True):
    """Per request: (out [q_heads, dim], logits [q_heads, seq_len]) of full attention, in fp32;
    without values the out is of the keys (only the logits are wanted)."""
    rows = zip(kv.rows[: q.shape[0]].tolist(), kv.lengths[: q.shape[0]].tolist())
    values = kv.v if with_values else kv.k
    return [
        attend_positions_ref(q[b], kv.k, values, kv.table[row, :n].long(), sm_scale)
        for b, (row, n) in enumerate(rows)
    ]


def selection_attention_ref(
    q: torch.Tensor, kv: KVView, sm_scale: float, retention: RetentionUpdate | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch oracle of a Δ-layer: (out in q's dtype, token_scores [batch, kv.table.shape[1]]
    fp32 = max over query heads of the softmax probability, -inf past each request's length),
    with ``retention``'s update made in place."""
    out = torch.empty_like(q)
    token_scores = torch.full((q.shape[0], kv.table.shape[1]), float("-inf"), device=q.device)
    for b, (out_b, logits) in enumerate(_full_attention_ref(q, kv, sm_scale)):
        out[b] = out_b.to(q.dtype)
        probabilities = torch.softmax(logits, dim=-1)
        token_scores[b, : logits.shape[1]] = probabilities.amax(dim=0)
        if retention is not None:
            row = retention.scores[int(retention.rows[b]), : logits.shape[1]]
            row.mul_(retention.decay).add_(probabilities.sum(dim=0))
    return out, token_scores


def tidal_token_scores_ref(q: torch.Tensor, kv: KVView, sm_scale: float) -> torch.Tensor:
    """Torch oracle of TidalDecode's token scores: [batch, kv.table.shape[1]] fp32, max over
    query heads of sm_scale * q·k, -inf past each request's length (kv.v is not read)."""
    token_scores = torch.full((q.shape[0], kv.table.shape[1]), float("-inf"), device=q.device)
    for b, (_, logits) in enumerate(_full_attention_ref(q, kv, sm_scale, with_values=False)):
        token_scores[b, : logits.shape[1]] = logits.amax(dim=0)
    return token_scores


def page_scores_ref(token_scores: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """Torch oracle of page scores: [batch, T] -> [batch, ceil(T / page_size)], each the sum of the
    page's finite token scores, -inf for a page with none."""
    batch, num_tokens = token_scores.shape
    num_pages = -(-num_tokens // page_size)
    padded = torch.full((batch, num_pages * page_size), float("-inf"), device=token_scores.device)
    padded[:, :num_tokens] = token_scores
    pages = padded.view(batch, num_pages, page_size)
    finite = torch.isfinite(pages)
    sums = torch.where(finite, pages, 0.0).sum(dim=-1)
    return torch.where(finite.any(dim=-1), sums, float("-inf"))
