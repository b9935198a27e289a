"""One Lethe pruning round's time under per-layer memory: the layers' kept entries packed into
the request's slots (``pack_layers``) against freeing by the union, the one thing the two do
differently in a fixed-pool run (issue 20), isolated from decoding.

    python -m benchmarks.lethe_round --shape qwen1.5b --context 2048,8192 --requests 1,16

``--requests`` requests of each ``--context`` positions in a synthetic pool of the shape's layers,
KV heads and head size; each layer's scores random and its own, so layers keep different tokens;
one round over each whole request under ``--policy-config`` (the round's rules: ``sparse_ratio``,
``max_kv_ratio``), all in one call (the engine prunes the requests due at a step together),
timed from the call to its return (a round ends in a host read, so its device work is inside).
Median over ``--repeats``, the requests' state reset before each; beside it, the slots a request
holds after its round and its list entries per layer (what a decode step reads). The ratio is
packed against union.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from sglang_ext.policies.lethe.runtime import LetheRuntime
from sglang_ext.policies import DecodeContext, build_policy
from sglang_ext.policies.runtime import EngineOps, StepRequest

from benchmarks import harness
from benchmarks.harness import Row, RunInfo

BENCH = "lethe_round"
MODES = {"packed": True, "union": False}  # pack_layers
ROUND_RULES = {"sparse_ratio": 10.0, "max_kv_ratio": 0.3}
HOLE = 0  # SGLang's padding slot: never a request's


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{BENCH}", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--shape", required=True, help="model shape: a folder of benchmarks/configs"
    )
    parser.add_argument("--context", type=harness.int_list, default=[2048, 8192])
    parser.add_argument(
        "--requests", type=harness.int_list, default=[1, 16],
        help="requests pruned in one call (rows' batch; one round batches as many as "
        "sglang_ext.policies.lethe.runtime.ROUND_ENTRIES allows)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--profile", action="store_true",
        help="print each mode's ops by device and host time (torch profiler, the last context)",
    )  # fmt: skip
    parser.add_argument(
        "--policy-config", type=json.loads, default=ROUND_RULES,
        help=f"Lethe's parameters (default {json.dumps(ROUND_RULES)}); pack_layers is set here",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=harness.DEFAULT_OUT_DIR)
    parser.add_argument("--results-md", type=Path, default=harness.DEFAULT_RESULTS_MD)
    return parser


class Requests:
    """``count`` requests of ``context`` positions each in a pool of the shape's layers, and
    their runtime."""

    def __init__(self, cfg: dict, context: int, count: int, params: dict, device: torch.device):
        layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
        dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        gen = torch.Generator().manual_seed(0)
        slots = count * context + 1  # slot 0 is the hole
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        pool = torch.randn(2, layers, slots, kv_heads, dim, generator=gen).to(device, dtype)
        keys, values = list(pool[0].unbind(0)), list(pool[1].unbind(0))
        self.slots = (torch.randperm(slots - 1, generator=gen) + 1).int().to(device)
        self.req_to_token = torch.zeros(count + 1, context + 1, dtype=torch.int32, device=device)
        kv_pool = SimpleNamespace(
            get_key_buffer=keys.__getitem__, get_value_buffer=values.__getitem__
        )
        ctx = DecodeContext(
            num_layers=layers, base_decode=None, write_kv=None, kv_pool=kv_pool,
            req_to_token=self.req_to_token, max_batch_size=count, device=device,
            num_q_heads=cfg["num_attention_heads"], head_dim=dim, padding_slot=HOLE,
        )  # fmt: skip
        self.policy = build_policy("lethe", params)
        self.runtime = LetheRuntime(self.policy, ctx)
        self.scores = (torch.rand(count, layers, context, generator=gen) ** 8).to(device)
        self.rows = torch.arange(1, count + 1, device=device)
        self.context, self.count, self.device = context, count, device
        self.ops = EngineOps(lambda slots: None, lambda: 0, rerun_extend=None)

    def round_seconds(self) -> float:
        """One round over every request, as prefill left them, in one call."""
        context = self.context
        self.req_to_token[1:, :context] = self.slots.view(self.count, context)
        self.runtime.reset_rows(self.rows, torch.full_like(self.rows, context))
        self.runtime.scores[:, 1 : self.count + 1, :context] = self.scores.transpose(0, 1)
        requests = [
            StepRequest(
                state=self.runtime.new_request(self.policy, None), rid=f"r{row}", row=row,
                seq_len=context + 1, prompt_len=context, output_ids=[], protected_len=0,
            )  # fmt: skip
            for row in range(1, self.count + 1)
        ]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.runtime.prune(requests, [context] * self.count, self.ops)
        return time.perf_counter() - start

    def held(self) -> int:
        """Slots the first request holds."""
        return int(self.req_to_token[1, : self.context].ne(HOLE).sum())

    def attended(self) -> float:
        """The first request's list entries, mean over layers: what a decode step reads."""
        return float(self.runtime.count[:, 1].float().mean())


def measure(cfg, context: int, count: int, args, info: RunInfo, shape: str) -> list[Row]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for mode, pack in MODES.items():
        params = {**args.policy_config, "pack_layers": pack}
        requests = Requests(cfg, context, count, params, device)
        requests.round_seconds()  # warm: the first call of each op
        times = [requests.round_seconds() for _ in range(args.repeats)]
        if args.profile and (context, count) == (args.context[-1], args.requests[-1]):
            print_profile(requests, mode)
        point = dict(
            bench=BENCH, policy=f"lethe:pack_layers={str(pack).lower()}", model_shape=shape,
            batch=count, context=context, kv_source="synthetic", budget=requests.policy.budget(),
        )  # fmt: skip
        seconds = statistics.median(times)
        rows.append(info.row(**point, metric="round_ms", value=seconds * 1e3))
        rows.append(info.row(**point, metric="round_ms_per_request", value=seconds * 1e3 / count))
        rows.append(info.row(**point, metric="held_slots", value=float(requests.held())))
        rows.append(info.row(**point, metric="attended_entries", value=requests.attended()))
    for packed, union in zip(rows[:4], rows[4:]):
        packed.baseline_value, packed.ratio = union.value, packed.value / union.value
    return rows


def print_profile(requests: Requests, mode: str) -> None:
    with torch.profiler.profile() as profile:
        for _ in range(5):
            requests.round_seconds()
    for sort_by in ("self_cpu_time_total", "self_device_time_total"):
        print(f"{BENCH}: {mode}, 5 rounds by {sort_by}", flush=True)
        print(profile.key_averages().table(sort_by=sort_by, row_limit=25), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cfg = harness.shape_config(args.shape)
    info = RunInfo.detect()
    rows = [
        row
        for context in args.context
        for count in args.requests
        for row in measure(cfg, context, count, args, info, args.shape)
    ]
    harness.save_results(BENCH, args.shape, rows, info, args.out_dir, args.results_md)


if __name__ == "__main__":
    main()
