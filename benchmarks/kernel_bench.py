"""GPU microbenchmark of the decode-attention kernels of DELTA and TidalDecode against SGLang's own
backends' decode kernels on the same inputs, and against the bandwidth floor.

    python -m benchmarks.kernel_bench --shape qwen1.5b --batch 1,16,32,64 --context 4096,16384,32768

Per (batch, context), one layer's time (replayed from a CUDA graph, as the engine decodes) of:
the decode kernels of SGLang's backends (`vanilla@triton`, `vanilla@flashinfer`, `vanilla@fa3` on
Hopper; the baseline is the fastest, and policies' full layers are timed at it); our split-KV
kernel over the whole cache (`full`); a selection layer (attention + scores + selection) of
DELTA and of Tidal; a sparse layer of each; the selection step alone with torch's top-k and
FlashInfer's (`rank_*_ms`); a sparse layer's attention by our kernel over the step's slot table
and by FlashInfer's paged decode over the same selected slots (`sparse_ours_ms`,
`sparse_flashinfer_ms`; the table's gather apart, `sparse_gather_ms`). From them, the attention
time of one decode step of the whole model under each policy (layer roles from the paper
defaults for its depth). The floor of a kernel is the K/V bytes it must read over a measured
device-to-device copy bandwidth.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from types import SimpleNamespace

import torch
from sglang_ext.kernels.kv_view import KVView
from sglang_ext.policies import DecodeContext, build_policy
from sglang_ext.policies.context import DecodeInputs
from sglang_ext.policies.selection import LayerRole

from benchmarks import harness, plot
from benchmarks.harness import Row, RunInfo

BENCH = "kernel_bench"
PAGE = 16
PARTS = ("layers", "rank", "sparse", "tune")


def build_parser():
    parser = harness.common_parser(BENCH, __doc__)
    parser.add_argument("--batch", type=harness.int_list, default=[1, 16, 32, 64])
    parser.add_argument("--context", type=harness.int_list, default=[4096, 16384, 32768])
    parser.add_argument("--budget-tokens", type=int, default=1024, help="DELTA K·16 and Tidal k")
    parser.add_argument("--kv-splits", type=int, default=8, help="of SGLang's kernel and ours")
    parser.add_argument(
        "--parts", type=harness.name_list, default=list(PARTS),
        help="which rows: layers (per-layer and per-step times, floors), rank (the selection "
        "step's top-k), sparse (our sparse kernel against FlashInfer's paged decode), tune "
        "(split-KV stage 1's tile, warps and pipeline stages; the selection scores' tile and "
        "warps)",
    )  # fmt: skip
    return parser


def time_ms(fn, reps: int = 20, replays: int = 10) -> float:
    """Median time of one call, replayed from a CUDA graph as the engine's decode runs (no launch
    or Python overhead), over ``reps`` timings of ``replays`` back-to-back replays each."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream: the kernels compile here
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return sorted(times)[len(times) // 2]


class Inputs:
    """One layer's decode inputs: a KV pool with each request's tokens in contiguous slots."""

    def __init__(self, cfg: dict, batch: int, context: int):
        q_heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        dim = cfg["hidden_size"] // q_heads
        self.scale = dim**-0.5
        dev, dtype = "cuda", torch.bfloat16
        slots = batch * context
        self.q = torch.randn(batch, q_heads, dim, device=dev, dtype=dtype)
        self.k = torch.randn(slots + 1, kv_heads, dim, device=dev, dtype=dtype)
        self.v = torch.randn(slots + 1, kv_heads, dim, device=dev, dtype=dtype)
        self.req_to_token = (
            torch.arange(slots, device=dev, dtype=torch.int32).view(batch, context) + 1
        )
        self.rows = torch.arange(batch, device=dev)
        self.seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
        self.kv_bytes_per_token = 2 * kv_heads * dim * 2  # K and V, bf16
        self.batch, self.context = batch, context

    def cache(self):
        """(q, the KV view): the leading arguments of the decode kernels."""
        return self.q, KVView(self.k, self.v, self.req_to_token, self.rows, self.seq_lens)

    def sglang_decode(self, kv_splits: int):
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

        batch, heads, dim = self.q.shape
        indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * self.context
        indices = self.req_to_token.flatten().long()
        out = torch.empty_like(self.q)
        logits = torch.empty(batch, heads, kv_splits, dim, device="cuda", dtype=torch.float32)
        lse = torch.empty(batch, heads, kv_splits, device="cuda", dtype=torch.float32)
        splits = torch.full((batch,), kv_splits, device="cuda", dtype=torch.int32)

        def run():
            decode_attention_fwd(
                self.q, self.k, self.v, out, indptr, indices, logits, lse,
                splits, kv_splits, self.scale, 1.0, 1.0,
            )  # fmt: skip
            return out

        return run

    def fa3_decode(self, page_table=None, cache_seqlens=None):
        """SGLang's fa3 decode call over this cache (page size 1: the page table is req_to_token),
        or over ``page_table``'s slots [batch, width], ``cache_seqlens`` of each row."""
        from sgl_kernel.flash_attn import flash_attn_with_kvcache

        page_table = self.req_to_token if page_table is None else page_table
        cache_seqlens = self.seq_lens if cache_seqlens is None else cache_seqlens

        batch, _, dim = self.q.shape
        kv_heads = self.k.shape[1]
        cu_seqlens_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        out = torch.empty_like(self.q)

        def run():
            flash_attn_with_kvcache(
                q=self.q, k_cache=self.k.view(-1, 1, kv_heads, dim),
                v_cache=self.v.view(-1, 1, kv_heads, dim), page_table=page_table,
                cache_seqlens=cache_seqlens, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=1,
                softmax_scale=self.scale, causal=True, out=out,
            )  # fmt: skip
            return out

        return run

    def flashinfer_decode(self):
        """FlashInfer's paged decode over this cache, as SGLang's flashinfer backend runs it."""
        batch = self.q.shape[0]
        indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * self.context
        slots = self.req_to_token.flatten()
        return flashinfer_paged_decode(self.q, self.k, self.v, indptr, slots, self.scale)


def vanilla_decoders(inputs: Inputs, kv_splits: int) -> dict:
    """``vanilla@BACKEND`` -> one layer's decode call (returning its output) by that SGLang
    backend's kernel on ``inputs``: triton (``kv_splits`` splits), flashinfer, and fa3 where it
    runs (Hopper)."""
    runs = {
        "vanilla@triton": inputs.sglang_decode(kv_splits),
        "vanilla@flashinfer": inputs.flashinfer_decode(),
    }
    if torch.cuda.get_device_capability()[0] == 9:
        runs["vanilla@fa3"] = inputs.fa3_decode()
    return runs


def flashinfer_paged_decode(q, k, v, indptr, indices, scale):
    """A call of FlashInfer's paged decode (page size 1) over ``indices``, planned once here, as
    SGLang plans once per step outside the CUDA graph."""
    import flashinfer
    from sglang.srt.layers.attention.flashinfer_backend import should_use_tensor_core

    batch, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    last_page_len = torch.ones(batch, device="cuda", dtype=torch.int32)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_cuda_graph=True,
        use_tensor_cores=should_use_tensor_core(q.dtype, q_heads, kv_heads),
        paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last_page_len,
    )  # fmt: skip
    wrapper.begin_forward(
        indptr, indices, last_page_len, q_heads, kv_heads, dim, 1,
        data_type=k.dtype, q_data_type=q.dtype,
    )  # fmt: skip
    return lambda: wrapper.forward(q, (k, v), sm_scale=scale)


def policy_decoders(name: str, inputs: Inputs, budget_tokens: int, num_layers: int):
    """(roles, selection-layer call, sparse-layer call) of a policy, through its real decoder."""
    params = {"budget_pages": budget_tokens // PAGE, "recent_pages": budget_tokens // PAGE // 8}
    if name == "tidal":
        params = {"budget_tokens": budget_tokens}
    k, v = inputs.k, inputs.v
    ctx = DecodeContext(
        num_layers=num_layers, base_decode=None, write_kv=None,
        kv_pool=SimpleNamespace(get_key_buffer=lambda _: k, get_value_buffer=lambda _: v),
        req_to_token=inputs.req_to_token, max_batch_size=inputs.batch, device=torch.device("cuda"),
        num_q_heads=inputs.q.shape[1], head_dim=inputs.q.shape[2],
    )  # fmt: skip
    policy = build_policy(name, params).for_model(ctx)
    program = policy.decode_program(ctx, DecodeInputs())
    fns = program.layers
    roles = policy.layer_roles(num_layers)
    _, q_heads, dim = inputs.q.shape
    layer = SimpleNamespace(
        layer_id=0, tp_q_head_num=q_heads, qk_head_dim=dim, scaling=inputs.scale
    )
    batch = SimpleNamespace(
        req_pool_indices=inputs.rows, seq_lens=inputs.seq_lens, seq_lens_cpu=None
    )
    for setup in program.step_setups:  # once: the batch stays the same
        setup(batch)
    select_fn = fns[roles.index(LayerRole.SELECT)]
    sparse_fn = fns[roles.index(LayerRole.SPARSE)]
    q = inputs.q.flatten(1)
    return (
        roles,
        lambda: select_fn(q, None, None, layer, batch, False),
        lambda: sparse_fn(q, None, None, layer, batch, False),
    )


def measure_point(cfg, batch, context, args, bandwidth, info) -> list[Row]:
    inputs = Inputs(cfg, batch, context)
    point = dict(bench=BENCH, model_shape=args.shape, batch=batch, context=context)
    rows = []
    if "layers" in args.parts:
        rows += layer_rows(cfg, inputs, args, bandwidth, point, info)
    if "rank" in args.parts:
        # score rows span the server's context (--context-length), whatever the requests' lengths
        width = max(context, args.context_length or 0)
        rows += rank_rows(inputs, args.budget_tokens, width, point, info)
    if "sparse" in args.parts:
        rows += sparse_kernel_rows(inputs, args.budget_tokens, point, info)
    if "tune" in args.parts:
        rows += stage1_tuning_rows(inputs, args.budget_tokens, point, info)
        rows += scores_tuning_rows(inputs, point, info)
    return rows


def scores_tuning_rows(inputs, point: dict, info) -> list[Row]:
    """The selection scores from stored logits (DELTA's: probabilities, pages summed) under each
    tile and warp count: ``scores_ms:t<tokens>-w<warps>``, the default marked."""
    import itertools

    from sglang_ext.kernels import selection_attention as sa

    batch, q_heads, _ = inputs.q.shape
    f32 = {"device": "cuda", "dtype": torch.float32}
    logits = torch.randn(batch, q_heads, inputs.context, **f32)
    lse = torch.logsumexp(logits, dim=-1)
    tokens = torch.empty(batch, inputs.context, **f32)
    pages = torch.empty(batch, -(-inputs.context // PAGE), **f32)
    rows = []
    for block_t, warps in itertools.product((64, 128, 256, 512, 1024), (4, 8)):
        run = functools.partial(
            sa.score_tokens, logits, lse, inputs.seq_lens, tokens, pages, block_t=block_t,
            num_warps=warps,
        )  # fmt: skip
        default = (block_t, warps) == (sa.SCORES_BLOCK_T, sa.SCORES_WARPS)
        metric = f"scores_ms:t{block_t}-w{warps}" + ("*" if default else "")
        rows.append(info.row(**point, policy="delta", metric=metric, value=time_ms(run)))
    return rows


def stage1_tuning_rows(inputs, budget_tokens: int, point: dict, info) -> list[Row]:
    """Our split-KV kernel under each stage-1 launch (``Stage1Launch``) as a selection layer runs
    it (the whole cache, logits stored), as a DELTA sparse layer does (the slot table of
    16-token pages spread over the cache) and as a Tidal sparse layer under an eviction does
    (``sparse_tokens``: a table of scattered tokens, logits stored):
    ``stage1_ms:<kind>:bn<block_n>-w<warps>-s<stages>``, the default marked."""
    import itertools

    from sglang_ext.kernels import split_kv_decode as skv
    from sglang_ext.kernels.sparse_decode import SlotTable

    batch, q_heads, dim = inputs.q.shape
    kv_heads = inputs.k.shape[1]
    pages = min(budget_tokens, inputs.context) // PAGE
    stride = inputs.context // PAGE // pages
    chosen = torch.arange(pages, device="cuda", dtype=torch.int32) * stride
    table = SlotTable(batch, pages * PAGE, "cuda")
    q, kv = cache = inputs.cache()
    selected = chosen.expand(batch, pages).contiguous()
    num_selected = torch.full((batch,), pages, device="cuda", dtype=torch.int32)
    table.gather(kv, selected, num_selected, PAGE)
    over_table = (q, kv.through(table.slots, table.rows[:batch], table.count[:batch]))
    logits = torch.empty(batch, q_heads, inputs.context, device="cuda", dtype=torch.float32)
    # Tidal's tokens (random positions, in no order) read under an eviction, which keeps each
    # entry's logits for its scores (lethe+tidal's sparse layers)
    k = min(budget_tokens, inputs.context)
    order = torch.rand(batch, inputs.context, device="cuda").argsort(dim=1)
    tokens, token_table = order[:, :k].to(torch.int32).contiguous(), SlotTable(batch, k, "cuda")
    token_table.gather(kv, tokens, torch.full((batch,), k, device="cuda", dtype=torch.int32), 1)
    over_tokens = (q, kv.through(token_table.slots, token_table.rows[:batch], token_table.count))
    token_logits = torch.empty(batch, q_heads, k, device="cuda", dtype=torch.float32)
    kinds = {
        "select": (cache, {"logits": logits}, inputs.context),
        "sparse": (over_table, {}, pages * PAGE),
        "sparse_tokens": (over_tokens, {"logits": token_logits}, k),
    }
    out = torch.empty_like(inputs.q)
    rows = []
    for kind, (args, extra, tokens) in kinds.items():
        per_sm = skv.PROGRAMS_PER_SM if kind == "select" else skv.SHORT_LIST_PROGRAMS_PER_SM
        workspace = skv.SplitKVWorkspace(
            batch, q_heads, kv_heads, dim, tokens, "cuda", programs_per_sm=per_sm
        )
        default = workspace.splits[batch]
        kind_launch = (
            skv.STAGE1_WHOLE if kind == "select" else skv.selected_launch(tokens, default)
        )
        for block_n, warps, stages in itertools.product((32, 64), (4, 8), (1, 2, 3, 4)):
            launch = replace(kind_launch, block_n=block_n, num_warps=warps, num_stages=stages)

            def run(launch=launch, args=args, extra=extra, workspace=workspace):
                skv.split_kv_decode(
                    *args, inputs.scale, **extra, workspace=workspace, out=out, launch=launch
                )

            name = f"bn{block_n}-w{warps}-s{stages}" + ("*" if launch == kind_launch else "")
            metric = f"stage1_ms:{name}"
            rows.append(info.row(**point, policy=kind, metric=metric, value=time_ms(run)))
        # the split count (the engine's choice marked), at the kind's default launch, and where
        # the last split's program may merge, with the other merge: "-merged" by that program,
        # "-launch" by stage 2's launch
        merged = kind_launch.merge_in_last_split
        other = replace(kind_launch, merge_in_last_split=not merged)
        merges = {"": kind_launch, "-launch" if merged else "-merged": other}
        for splits in sorted({1, 2, 4, 8, 16, 32, 64, default}):
            fixed = skv.SplitKVWorkspace(batch, q_heads, kv_heads, dim, tokens, "cuda", splits)
            for suffix, launch in merges.items():
                if suffix and not 1 < splits <= skv.MAX_MERGED_SPLITS:
                    continue  # the same launch as the row without the suffix

                def run(args=args, extra=extra, workspace=fixed, launch=launch):
                    skv.split_kv_decode(
                        *args, inputs.scale, **extra, workspace=workspace, out=out, launch=launch
                    )

                star = "*" if splits == default else ""
                metric = f"stage1_ms:splits{splits}{suffix}{star}"
                rows.append(info.row(**point, policy=kind, metric=metric, value=time_ms(run)))
    return rows


def layer_rows(cfg, inputs, args, bandwidth, point: dict, info) -> list[Row]:
    from sglang_ext.kernels.split_kv_decode import split_kv_decode

    batch, context = inputs.batch, inputs.context
    num_layers = cfg["num_hidden_layers"]
    full_floor_ms = batch * context * inputs.kv_bytes_per_token / bandwidth / 1e6
    sparse_floor_ms = batch * min(context, args.budget_tokens) * inputs.kv_bytes_per_token
    sparse_floor_ms /= bandwidth * 1e6
    vanilla = vanilla_decoders(inputs, args.kv_splits)
    per_layer = {name: time_ms(run) for name, run in vanilla.items()}
    # a policy's full layers decode on the engine's base backend: the fastest here
    base_ms = min(per_layer.values())
    per_layer["full"] = time_ms(
        lambda: split_kv_decode(*inputs.cache(), inputs.scale, num_kv_splits=args.kv_splits)
    )
    rows = [
        info.row(**point, policy=p, metric="layer_attention_ms", value=ms,
                 attention_backend=harness.named_backend(p))
        for p, ms in per_layer.items()
    ]  # fmt: skip
    step = {p: ms * num_layers for p, ms in per_layer.items()}
    for name in ("delta", "tidal"):
        roles, select, sparse = policy_decoders(name, inputs, args.budget_tokens, num_layers)
        select_ms, sparse_ms = time_ms(select), time_ms(sparse)
        rows += [
            info.row(**point, policy=name, metric="select_layer_ms", value=select_ms),
            info.row(**point, policy=name, metric="sparse_layer_ms", value=sparse_ms),
            info.row(**point, policy=name, metric="sparse_layer_floor_ratio",
                     value=sparse_ms / sparse_floor_ms),
        ]  # fmt: skip
        count = {role: roles.count(role) for role in LayerRole}
        step[name] = (
            count[LayerRole.FULL] * base_ms
            + count[LayerRole.SELECT] * select_ms
            + count[LayerRole.SPARSE] * sparse_ms
        )
    rows += [
        info.row(**point, policy=p, metric="layer_floor_ratio", value=ms / full_floor_ms,
                 attention_backend=harness.named_backend(p))
        for p, ms in per_layer.items()
    ]  # fmt: skip
    rows += [
        info.row(**point, policy=p, metric="step_attention_ms", value=ms,
                 attention_backend=harness.named_backend(p))
        for p, ms in step.items()
    ]  # fmt: skip
    return rows


def sparse_kernel_rows(inputs, budget_tokens: int, point: dict, info) -> list[Row]:
    """A sparse layer's attention over one selection, by our kernel over the step's slot table
    (its gather, once per selection layer, timed apart: ``sparse_gather_ms``) and by FlashInfer's
    paged decode over the selected slots (page size 1, as SGLang's pool; planned outside the graph
    as SGLang plans once per step), and on Hopper by fa3 with the table as its page table: which
    one the sparse layers should run (issue 15). DELTA's
    selection is 16-token pages, Tidal's single tokens, both spread over the whole context."""
    from sglang_ext.kernels.sparse_decode import SlotTable

    batch, q_heads, dim = inputs.q.shape
    kv_heads = inputs.k.shape[1]
    rows = []
    for policy, page in (("delta", PAGE), ("tidal", 1)):
        units = min(budget_tokens, inputs.context) // page
        stride = inputs.context // page // units
        chosen = torch.arange(units, device="cuda", dtype=torch.int32) * stride
        selected = chosen.expand(batch, units).contiguous()
        num_selected = torch.full((batch,), units, device="cuda", dtype=torch.int32)
        ours_out = torch.empty_like(inputs.q)
        # as the engine runs it: the selection layer gathers once, each sparse layer attends
        table = SlotTable(batch, units * page, "cuda", heads=(q_heads, kv_heads, dim))
        cache = inputs.cache()

        def gather(table=table, selected=selected, num_selected=num_selected, page=page):
            table.gather(cache[1], selected, num_selected, page)

        def ours(table=table):
            table.attend(*cache, inputs.scale, out=ours_out)

        gather_ms = time_ms(gather)

        positions = (selected[:, :, None].long() * page + torch.arange(page, device="cuda"))
        slots = inputs.req_to_token.gather(1, positions.flatten(1)).flatten()
        indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * (units * page)
        theirs = flashinfer_paged_decode(inputs.q, inputs.k, inputs.v, indptr, slots, inputs.scale)

        ours_ms, theirs_ms = time_ms(ours), time_ms(theirs)
        # the same attention, or the timing compares different work
        torch.testing.assert_close(ours_out, theirs(), atol=2e-2, rtol=2e-2)
        rows += [
            info.row(**point, policy=policy, metric="sparse_ours_ms", value=ours_ms),
            info.row(**point, policy=policy, metric="sparse_gather_ms", value=gather_ms),
            info.row(**point, policy=policy, metric="sparse_flashinfer_ms", value=theirs_ms),
        ]
        if torch.cuda.get_device_capability()[0] == 9:  # fa3 over the slot table as a page table
            fa3 = inputs.fa3_decode(table.slots[:batch], table.count[:batch])
            torch.testing.assert_close(ours_out, fa3(), atol=2e-2, rtol=2e-2)
            metric = "sparse_fa3_ms"
            rows.append(info.row(**point, policy=policy, metric=metric, value=time_ms(fa3)))
    return rows


def rank_rows(inputs, budget_tokens: int, row_width: int, point: dict, info) -> list[Row]:
    """The selection step alone (scores to kept slots) over a Tidal row (every token) and a DELTA
    row (every page), rows ``row_width`` tokens wide: ``select_pages`` with torch's top-k (the
    oracle), with FlashInfer's over the padded row (``flashinfer_top_ranked``) and over each row's
    candidates only (``top_k_ragged_transform``), and the fused ``select_units_fused`` that
    ``unit_chooser`` picks on CUDA where it takes the row (``rank_fused_ms``)."""
    from sglang_ext.kernels import page_select as ps

    rows = []
    widths = {"tidal": (1, budget_tokens, 1), "delta": (PAGE, budget_tokens // PAGE, 8)}
    rankers = {
        "torch": ps.torch_top_ranked,
        "flashinfer": ps.flashinfer_top_ranked,
        "flashinfer_ragged": ragged_top_ranked(inputs.batch),
    }
    for policy, (page, budget, recent) in widths.items():
        scores = torch.rand(inputs.batch, -(-row_width // page), device="cuda")
        selects = {
            f"rank_{ranker}_ms": functools.partial(
                ps.select_pages, scores, inputs.seq_lens, budget, recent, page,
                top_ranked=top_ranked,
            )  # fmt: skip
            for ranker, top_ranked in rankers.items()
        }
        if ps.fused_fits(scores.shape[1], budget, recent):
            selects["rank_fused_ms"] = functools.partial(
                ps.select_units_fused, scores, inputs.seq_lens, budget, recent, page
            )
            fused, oracle = selects["rank_fused_ms"](), selects["rank_torch_ms"]()
            assert torch.equal(fused[1], oracle[1]) and torch.equal(fused[0], oracle[0])
        for metric, select in selects.items():
            rows.append(info.row(**point, policy=policy, metric=metric, value=time_ms(select)))
    return rows


def ragged_top_ranked(max_rows: int):
    """FlashInfer's radix top-k over each row's candidates only (O(candidates), not the row).
    Candidates are a prefix of the row, so their count is the mask's sum. Its winners come
    unordered, which select_pages without row budgets or ART (what these rows time) accepts;
    a row short of k gets ineligible indices after its winners, as ``TopRanked`` asks."""
    import flashinfer

    offsets = torch.zeros(max_rows, dtype=torch.int32, device="cuda")

    def top_ranked(scores, eligible, k):
        num_candidates = eligible.sum(dim=1, dtype=torch.int32)
        top = flashinfer.top_k_ragged_transform(
            scores, offsets[: scores.shape[0]], num_candidates, k,
            tie_break=flashinfer.topk.TopKTieBreak.SMALL, dsa_graph_safe=True,
        ).long()  # fmt: skip
        return torch.where(top >= 0, top, num_candidates.long()[:, None])

    return top_ranked


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(unknown)}, choose from {', '.join(PARTS)}")
    cfg = harness.shape_config(args.shape)
    info = RunInfo.detect()
    bandwidth = harness.copy_bytes_per_s("cuda", 2 << 30) / 1e9
    print(
        f"{BENCH}: {args.shape} on {info.device}, copy bandwidth {bandwidth:.0f} GB/s", flush=True
    )
    rows: list[Row] = []
    for batch in args.batch:
        for context in args.context:
            rows += measure_point(cfg, batch, context, args, bandwidth, info)
            torch.cuda.empty_cache()
            print(f"{BENCH}: batch {batch} context {context} done", flush=True)
    rows.append(info.row(bench=BENCH, policy="device", model_shape=args.shape, batch=0, context=0,
                         metric="copy_bandwidth_gbs", value=bandwidth))  # fmt: skip
    harness.add_baseline_ratios(rows)
    json_path = harness.save_results(BENCH, args.shape, rows, info, args.out_dir, args.results_md)
    print(f"plot: {plot_step_attention(rows, json_path.with_suffix('.png'))}")


def plot_step_attention(rows: list[Row], path):
    return plot.plot_decode_step(
        rows, path, metric="step_attention_ms", to_ms=1, what="attention time of a decode step"
    )


if __name__ == "__main__":
    main()
