"""ART's decode kernel against its torch oracle, plain attention, and the truncation bound.

Without CUDA the kernel runs under Triton's interpreter on CPU tensors (conftest.py).
"""

import math

import pytest
import torch
from kernel_cases import DEVICE, OUT_TOL, make_batch
from sglang_ext.kernels.art_decode import TILE, art_decode, art_decode_ref, traversal_positions
from sglang_ext.kernels.selection_attention import selection_attention_ref
from sglang_ext.kernels.sparse_decode import sparse_decode_attention_ref
from sglang_ext.kernels.split_kv_decode import attend_positions_ref

SEQ_LENS = (1000, 700, 37)
MAX_CONTEXT = 1024
SPLITS = 4
ART = {"tau": 1e-5, "phi": 1e-3, "num_kv_splits": SPLITS}
# fp32 inputs: exact dots under the interpreter, TF32 dots (10-bit mantissa) compiled on CUDA
FP32_NOISE = 1e-5 if DEVICE == "cpu" else 2e-3


def cache(dtype=torch.float16):
    return make_batch(dtype, seq_lens=SEQ_LENS, group=2, head_dim=32, max_context=MAX_CONTEXT)


def run_both(batch, sm_scale, **params):
    out, tiles = art_decode(**batch, sm_scale=sm_scale, **ART, **params)
    out_ref, tiles_ref = art_decode_ref(**batch, sm_scale=sm_scale, **ART, **params)
    return (out, tiles.cpu()), (out_ref, tiles_ref)


def all_tiles(seq_len: int) -> list[int]:
    """Tiles each split holds when nothing stops it."""
    tiles = math.ceil(seq_len / TILE)
    return [len(range(s, tiles, SPLITS)) for s in range(SPLITS)]


def heavy_head_tile(batch, always_read: int = 4, boost: float = 60.0):
    """Keys of every request's head tile (its sinks and most recent tokens) aligned with its
    queries, so the rest of the cache carries next to no attention mass."""
    q, kv = batch["q"], batch["kv"]
    k_buffer = kv.k
    num_kv_heads = k_buffer.shape[1]
    for b, (row, seq_len) in enumerate(zip(kv.rows, kv.lengths.tolist())):
        head = traversal_positions(seq_len, always_read)[:TILE]
        slots = kv.table[row, head.to(DEVICE)].long()
        for g in range(num_kv_heads):
            direction = q[b].view(num_kv_heads, -1, q.shape[-1])[g].float().mean(0)
            k_buffer[slots, g] = (boost * direction / direction.norm()).to(k_buffer.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_termination_off_is_plain_attention(dtype):
    batch, sm_scale = cache(dtype)
    (out, tiles), (_, tiles_ref) = run_both(batch, sm_scale, patience=0, always_read=4)
    full, _ = selection_attention_ref(**batch, sm_scale=sm_scale)
    torch.testing.assert_close(out, full, **OUT_TOL[dtype])
    for b, seq_len in enumerate(SEQ_LENS):
        assert tiles[b].tolist() == [all_tiles(seq_len)] * 2 == tiles_ref[b].tolist()


def test_stops_early_where_later_tiles_carry_no_mass():
    batch, sm_scale = cache()
    heavy_head_tile(batch)
    (out, tiles), (out_ref, tiles_ref) = run_both(batch, sm_scale, patience=3, always_read=4)
    assert torch.equal(tiles, tiles_ref)
    # every split stops after 1 + patience tiles: all 4 over the 32 tiles of 1000 tokens, 2 over
    # the 22 of 700 (each split's share at least twice the 4 tiles a stop needs: 8 of 22 read),
    # and the 2 tiles of 37 tokens, too few to stop, in one split
    assert tiles[0].tolist() == [[4] * SPLITS] * 2 and tiles[1].tolist() == [[4, 4, 0, 0]] * 2
    assert tiles[2].tolist() == [[2, 0, 0, 0]] * 2
    torch.testing.assert_close(out, out_ref, **OUT_TOL[torch.float16])
    full, _ = selection_attention_ref(**batch, sm_scale=sm_scale)
    torch.testing.assert_close(out, full, **OUT_TOL[torch.float16])


def test_a_request_shorter_than_all_splits_stop_needs_can_stop():
    """8 splits at patience 5 need 8 × 6 tiles (1536 tokens) before each could stop; a request of
    1000 tokens (32 tiles) is read by 2 splits of 16 tiles instead, which stop after 6."""
    batch, sm_scale = cache()
    heavy_head_tile(batch)
    params = {**ART, "num_kv_splits": 8, "patience": 5, "always_read": 4}
    out, tiles = art_decode(**batch, sm_scale=sm_scale, **params)
    out_ref, tiles_ref = art_decode_ref(**batch, sm_scale=sm_scale, **params)
    assert torch.equal(tiles.cpu(), tiles_ref)
    assert tiles[0].tolist() == [[6, 6, 0, 0, 0, 0, 0, 0]] * 2  # 12 of 32 tiles read
    torch.testing.assert_close(out, out_ref, **OUT_TOL[torch.float16])
    full, _ = selection_attention_ref(**batch, sm_scale=sm_scale)
    torch.testing.assert_close(out, full, **OUT_TOL[torch.float16])


def test_error_stays_within_the_truncation_bound():
    """Where later tiles keep a little mass: ||o_T - o_t*|| <= 2 C_v * (mass not read / total),
    the sum Theorem 2 bounds by 2 mu C_v ln(T / t*)."""
    batch, sm_scale = cache(torch.float32)
    heavy_head_tile(batch, boost=18.0)  # the rest keeps ~e^-12 of the mass per token
    out, tiles = art_decode(**batch, sm_scale=sm_scale, **ART, patience=2, always_read=4)
    _, tiles_ref = art_decode_ref(**batch, sm_scale=sm_scale, **ART, patience=2, always_read=4)
    assert torch.equal(tiles.cpu(), tiles_ref)
    assert int(tiles[:2].sum()) < sum(2 * sum(all_tiles(n)) for n in SEQ_LENS[:2])
    full, _ = selection_attention_ref(**batch, sm_scale=sm_scale)
    kv = batch["kv"]
    c_v = kv.v.float().norm(dim=-1).max()
    for b, (row, seq_len) in enumerate(zip(kv.rows, SEQ_LENS)):
        slots = kv.table[row, :seq_len].long()
        _, logits = attend_positions_ref(batch["q"][b], kv.k, kv.v, slots, sm_scale)
        order = traversal_positions(seq_len, 4).split(TILE)
        for g in range(2):
            shares = [range(s, len(order), SPLITS)[: tiles[b, g, s]] for s in range(SPLITS)]
            read = torch.cat([order[t] for share in shares for t in share]).to(DEVICE)
            skipped = torch.ones(seq_len, dtype=torch.bool, device=DEVICE)
            skipped[read] = False
            for h in (2 * g, 2 * g + 1):
                unread = torch.softmax(logits[h], dim=-1)[skipped].sum()
                assert (out[b, h] - full[b, h]).norm() <= 2 * c_v * unread + FP32_NOISE


def test_sinks_are_read_before_any_stop():
    batch, sm_scale = cache()
    heavy_head_tile(batch, always_read=16 * TILE)
    (_, tiles), (_, tiles_ref) = run_both(batch, sm_scale, patience=1, always_read=16 * TILE)
    assert torch.equal(tiles, tiles_ref)
    # patience 1 alone stops after 2 tiles; tiles 0..15 of the order hold sinks: 4 per split
    assert tiles[0].tolist() == [[4] * SPLITS] * 2


@pytest.mark.parametrize("tile_tokens", [16, 64, 128])
def test_other_tile_sizes_read_and_stop_as_their_oracle_does(tile_tokens):
    batch, sm_scale = cache()
    heavy_head_tile(batch)
    params = {"tile_tokens": tile_tokens, "always_read": 4}
    (out, tiles), (out_ref, tiles_ref) = run_both(batch, sm_scale, patience=2, **params)
    assert torch.equal(tiles, tiles_ref)
    tiles_of = [math.ceil(n / tile_tokens) for n in SEQ_LENS]
    assert int(tiles[0].sum()) < 2 * tiles_of[0]  # the 1000-token request stopped early
    torch.testing.assert_close(out, out_ref, **OUT_TOL[torch.float16])
    full, _ = selection_attention_ref(**batch, sm_scale=sm_scale)
    torch.testing.assert_close(out, full, **OUT_TOL[torch.float16])
    # termination off reads every tile of every request, whatever their size
    (out, tiles), _ = run_both(batch, sm_scale, patience=0, **params)
    assert [int(tiles[b].sum()) for b in range(3)] == [2 * n for n in tiles_of]
    torch.testing.assert_close(out, full, **OUT_TOL[torch.float16])


def test_a_tile_size_the_kernel_is_not_built_for_is_refused():
    batch, sm_scale = cache()
    with pytest.raises(ValueError, match="tile_tokens"):
        art_decode(**batch, sm_scale=sm_scale, **ART, patience=2, tile_tokens=48)


@pytest.mark.parametrize("patience", [0, 2])
def test_an_explicit_page_order_reads_the_selection_in_its_order(patience):
    batch, sm_scale = cache()
    gen = torch.Generator().manual_seed(3)
    pages = [torch.randperm(math.ceil(n / 16), generator=gen)[:24] for n in SEQ_LENS]
    order = torch.zeros(len(SEQ_LENS), 24, dtype=torch.int32)
    for b, chosen in enumerate(pages):
        order[b, : len(chosen)] = chosen
    num_order = torch.tensor([len(p) for p in pages], dtype=torch.int32)
    selection = {"order": order.to(DEVICE), "num_order": num_order.to(DEVICE), "order_span": 16}
    (out, tiles), (out_ref, tiles_ref) = run_both(batch, sm_scale, patience=patience, **selection)
    assert torch.equal(tiles, tiles_ref)
    torch.testing.assert_close(out, out_ref, **OUT_TOL[torch.float16])
    if patience == 0:
        sparse = sparse_decode_attention_ref(
            **batch, selected=order.to(DEVICE), num_selected=num_order.to(DEVICE),
            sm_scale=sm_scale, page_size=16,
        )  # fmt: skip
        torch.testing.assert_close(out, sparse, **OUT_TOL[torch.float16])


def test_tile_counts_add_up_what_every_program_read_and_could_have_read():
    batch, sm_scale = cache()
    heavy_head_tile(batch)
    counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    counts_ref = torch.zeros(2, dtype=torch.int64)
    for _ in range(2):  # they accumulate
        _, tiles = art_decode(**batch, sm_scale=sm_scale, **ART, patience=3, always_read=4, tile_counts=counts)
        art_decode_ref(**batch, sm_scale=sm_scale, **ART, patience=3, always_read=4, tile_counts=counts_ref)
    in_order = sum(2 * math.ceil(n / TILE) for n in SEQ_LENS)
    assert counts.tolist() == counts_ref.tolist() == [2 * int(tiles.sum()), 2 * in_order]
    assert counts[0] < counts[1]  # the long requests stopped early


def test_each_request_may_have_its_own_tau_phi_patience():
    """A table by request pool row; patience 0 in a row is full attention for that request."""
    batch, sm_scale = cache()
    heavy_head_tile(batch)
    rows = batch["kv"].rows.tolist()
    slots = max(rows) + 1
    columns = {  # typed as the request table keeps them
        "tau": torch.full((slots,), 1e-5, device=DEVICE),
        "phi": torch.full((slots,), 1e-3, device=DEVICE),
        "patience": torch.full((slots,), 3, dtype=torch.int32, device=DEVICE),
    }
    columns["patience"][rows[0]] = 0  # request 0 opts out
    columns["patience"][rows[1]] = 1
    (out, tiles), (out_ref, tiles_ref) = run_both(
        batch, sm_scale, patience=3, always_read=4, request_columns=columns
    )
    assert torch.equal(tiles, tiles_ref)
    torch.testing.assert_close(out, out_ref, **OUT_TOL[torch.float16])
    assert tiles[0].tolist() == [all_tiles(SEQ_LENS[0])] * 2  # read it all
    assert tiles[1].tolist() == [[2] * SPLITS] * 2  # stopped after 1 + patience 1
    _, alone = art_decode(**batch, sm_scale=sm_scale, **ART, patience=3, always_read=4)
    assert torch.equal(tiles[2], alone[2].cpu())  # the table's default row: the scalars' result


def test_a_workspace_and_tile_buffer_owned_up_front_give_the_allocating_result():
    from sglang_ext.kernels.split_kv_decode import SplitKVWorkspace

    batch, sm_scale = cache()
    heavy_head_tile(batch)
    q, kv_heads = batch["q"], batch["kv"].k.shape[1]
    workspace = SplitKVWorkspace(8, q.shape[1], kv_heads, q.shape[2],
                                 max_tokens=0, device=DEVICE, num_splits=SPLITS)  # fmt: skip
    tiles_read = torch.full((8, kv_heads, SPLITS), -1, dtype=torch.int32, device=DEVICE)
    params = {"patience": 3, "always_read": 4}
    out, tiles = art_decode(**batch, sm_scale=sm_scale, **ART, **params, workspace=workspace, tiles_read=tiles_read)
    alone, alone_tiles = art_decode(**batch, sm_scale=sm_scale, **ART, **params)
    assert torch.equal(out, alone) and torch.equal(tiles, alone_tiles)
    assert tiles.data_ptr() == tiles_read.data_ptr()  # written in place, not a new tensor
    with pytest.raises(AssertionError, match="another split count"):
        art_decode(**batch, sm_scale=sm_scale, **{**ART, "num_kv_splits": 2}, **params, workspace=workspace)


@pytest.mark.skipif(DEVICE == "cpu", reason="SGLang's backends' decode kernels need CUDA")
def test_the_kernel_benchmarks_baselines_compute_the_same_attention():
    """art_kernel's rows time each vanilla backend's decode on the same cache: they must agree
    with our split-KV kernel, or the table compares different work."""
    from benchmarks.kernel_bench import Inputs, vanilla_decoders
    from sglang_ext.kernels.split_kv_decode import split_kv_decode

    shape = {"num_attention_heads": 12, "num_key_value_heads": 2, "hidden_size": 1536}
    inputs = Inputs(shape, batch=3, context=700)
    expected, _ = split_kv_decode(*inputs.cache(), inputs.scale, num_kv_splits=4)
    decoders = vanilla_decoders(inputs, kv_splits=4)
    assert {"vanilla@triton", "vanilla@flashinfer"} <= set(decoders)
    for name, run in decoders.items():
        torch.testing.assert_close(run(), expected, **OUT_TOL[torch.bfloat16], msg=name)
