"""A small synthetic KV cache like SGLang's, for the decode functions of selection policies."""

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from sglang_ext.kernels.split_kv_decode import attend_positions_ref
from sglang_ext.policies.context import DecodeContext, DecodeInputs, RankGroup

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


class Cache:
    """A KV pool and request table like SGLang's: each request's tokens in scattered slots."""

    Q_HEADS, KV_HEADS, DIM, SLOTS, MAX_BATCH = 4, 2, 64, 2048, 6

    def __init__(self, num_layers=4, seq_lens=(300, 40, 17), device="cpu"):
        gen = torch.Generator().manual_seed(0)
        self.num_layers, self.device = num_layers, torch.device(device)
        self.step_setups = []  # decode_fns' programs': run before each decode
        # fp16 on CUDA, as served; fp32 on CPU, where the torch references compute
        dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.tol = {"rtol": 1e-2, "atol": 5e-3} if dtype == torch.float16 else {}

        def randn(*shape):
            return torch.randn(shape, generator=gen).to(self.device, dtype)

        # each one buffer of per-layer views, as the engine allocates them for per-layer memory
        self.keys = list(randn(num_layers, self.SLOTS, self.KV_HEADS, self.DIM).unbind(0))
        self.values = list(randn(num_layers, self.SLOTS, self.KV_HEADS, self.DIM).unbind(0))
        req_to_token = torch.zeros(8, 512, dtype=torch.int32)
        slots = torch.randperm(self.SLOTS, generator=gen).int()
        start = 0
        for row, n in enumerate(seq_lens):
            req_to_token[row + 1, :n] = slots[start : start + n]  # rows 1.. like a live pool
            start += n
        rows, lens = torch.arange(1, len(seq_lens) + 1), torch.tensor(seq_lens)
        self.req_to_token = req_to_token.to(self.device)
        self.batch = SimpleNamespace(
            req_pool_indices=rows.to(self.device),
            seq_lens=lens.to(self.device),
            seq_lens_cpu=lens,
            out_cache_loc=req_to_token[rows, lens - 1].long().to(self.device),  # decoded token's
        )
        self.q = randn(len(seq_lens), self.Q_HEADS * self.DIM)
        self.new_k = randn(len(seq_lens), self.KV_HEADS, self.DIM)
        self.new_v = randn(len(seq_lens), self.KV_HEADS, self.DIM)

    def context(self, base_decode=None, fingerprint=None, ranks=None):
        ctx = DecodeContext(
            num_layers=self.num_layers,
            base_decode=base_decode,
            write_kv=self.write_kv,
            kv_pool=SimpleNamespace(
                get_key_buffer=self.keys.__getitem__, get_value_buffer=self.values.__getitem__
            ),
            req_to_token=self.req_to_token,
            max_batch_size=self.MAX_BATCH,
            device=self.device,
            num_q_heads=self.Q_HEADS,  # on CUDA the decoders own their scratch, as in the engine
            head_dim=self.DIM,
            model_fingerprint=fingerprint or {"architecture": "Tiny", "layers": self.num_layers},
            ranks=ranks,
        )
        return ctx

    def decode_fns(self, policy, **context):
        """``policy``'s decode functions on this cache (``context``: ``context``'s arguments),
        its program's per-step setups run before each ``decode``."""
        program = policy.decode_program(self.context(**context), DecodeInputs())
        self.step_setups.extend(program.step_setups)
        return program.layers

    def rank_view(self, rank: int, num_ranks: int) -> "Cache":
        """This cache as tensor-parallel rank ``rank`` sees it: its share of the KV heads and their
        query heads, the same slots and requests."""
        kv_per_rank, q_per_rank = self.KV_HEADS // num_ranks, self.Q_HEADS // num_ranks
        view = copy.copy(self)
        view.step_setups = []
        view.req_to_token = self.req_to_token.clone()  # each rank's own (eviction writes holes)
        view.Q_HEADS, view.KV_HEADS = q_per_rank, kv_per_rank
        kv = slice(rank * kv_per_rank, (rank + 1) * kv_per_rank)
        view.keys = list(torch.stack([k[:, kv] for k in self.keys]).unbind(0))
        view.values = list(torch.stack([v[:, kv] for v in self.values]).unbind(0))
        q = self.q.view(len(self.q), self.Q_HEADS, self.DIM)
        view.q = q[:, rank * q_per_rank : (rank + 1) * q_per_rank].reshape(len(self.q), -1)
        view.new_k, view.new_v = self.new_k[:, kv].clone(), self.new_v[:, kv].clone()
        return view

    def write_kv(self, layer, forward_batch, k, v):
        self.keys[layer.layer_id][forward_batch.out_cache_loc] = k
        self.values[layer.layer_id][forward_batch.out_cache_loc] = v

    def layer(self, layer_id):
        return SimpleNamespace(
            layer_id=layer_id, tp_q_head_num=self.Q_HEADS, qk_head_dim=self.DIM, scaling=0.125
        )

    def decode(self, decode_fn, layer_id):
        # the per-step setups the runtime runs before a step's layers (idempotent here)
        for setup in self.step_setups:
            setup(self.batch)
        return decode_fn(self.q, self.new_k, self.new_v, self.layer(layer_id), self.batch, True)

    def full_attention(self, layer_id):
        q = self.q.view(-1, self.Q_HEADS, self.DIM)
        rows = zip(self.batch.req_pool_indices.tolist(), self.batch.seq_lens.tolist())
        return torch.stack([
            attend_positions_ref(
                q[b], self.keys[layer_id], self.values[layer_id],
                self.req_to_token[row, :n].long(), 0.125,
            )[0]
            for b, (row, n) in enumerate(rows)
        ]).view(len(q), -1).to(q.dtype)  # fmt: skip


class ThreadRanks:
    """Tensor-parallel ranks as threads of this process: a rank's gather hands its tensor to the
    others through a barrier, as SGLang's group all-gather does across processes."""

    def __init__(self, size: int):
        self.size = size
        self._slots: list = [None] * size
        self._barrier = threading.Barrier(size, timeout=60)

    def group(self, rank: int) -> RankGroup:
        def gather(x):
            self._slots[rank] = x.clone()
            self._barrier.wait()
            gathered = torch.stack(self._slots)
            self._barrier.wait()  # nobody overwrites a slot before every rank has read it
            return gathered

        return RankGroup(rank, self.size, gather)

    def run(self, work) -> list:
        """``work(rank, group)`` on every rank at once; their results in rank order."""
        with ThreadPoolExecutor(self.size) as pool:
            futures = [pool.submit(work, rank, self.group(rank)) for rank in range(self.size)]
            return [future.result() for future in futures]
