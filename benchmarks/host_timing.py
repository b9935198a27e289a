"""Host time of SGLang's one-batch decode steps, taken inside benchmarks.decode_step_child for
benchmarks.decode_host.

one_batch runs a decode step synchronously: the GPU is idle from the previous step's sync until
the step's CUDA graph is launched, so the host time up to that launch is on every step's critical
path. Per (batch, context), after WARMUP_CALLS steps, every other step is timed bare (from the
call to the graph's launch, to the call's return, and to the GPU's end of the step) and the others
run under cProfile (which slows the Python it sees, so its times only rank the host's parts).
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

WARMUP_CALLS = 3


class DecodeHostTimer:
    def __init__(self):
        self._points: dict[str, dict] = {}
        self._launched_at: float | None = None

    def install(self, one_batch, graph_runner=None, synchronize=None) -> None:
        """Wrap one_batch's decode call and the decode graph runner's pre-launch step
        (``graph_runner``: SGLang's DecodeCudaGraphRunner; ``synchronize``: the GPU's)."""
        if graph_runner is None:
            from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
                DecodeCudaGraphRunner as graph_runner,
            )
        if synchronize is None:
            import torch

            synchronize = torch.cuda.synchronize
        decode, load_batch = one_batch._TorchBenchRunner.decode, graph_runner.load_batch

        def load_batch_then_mark(runner, *args, **kwargs):
            result = load_batch(runner, *args, **kwargs)
            self._launched_at = time.perf_counter()  # the graph's replay is launched next
            return result

        def timed_decode(runner, next_token_ids, batch):
            key = f"{len(batch.reqs)},{len(batch.reqs[0].origin_input_ids)}"
            point = self._points.setdefault(
                key, {"calls": 0, "to_launch": [], "call": [], "step": [], "profile": None}
            )
            point["calls"] += 1
            if point["calls"] <= WARMUP_CALLS:
                return decode(runner, next_token_ids, batch)
            if point["calls"] % 2:
                point["profile"] = point["profile"] or cProfile.Profile()
                point["profile"].enable()
                try:
                    return decode(runner, next_token_ids, batch)
                finally:
                    point["profile"].disable()
            self._launched_at = None
            start = time.perf_counter()
            result = decode(runner, next_token_ids, batch)
            returned = time.perf_counter()
            synchronize()
            point["step"].append(time.perf_counter() - start)
            point["call"].append(returned - start)
            if self._launched_at is not None:  # None: the step ran eagerly
                point["to_launch"].append(self._launched_at - start)
            return result

        one_batch._TorchBenchRunner.decode = timed_decode
        graph_runner.load_batch = load_batch_then_mark

    def write(self, path: Path) -> None:
        """Per point: medians in ms and every function by cumulative profiled time per step,
        most first; each point's whole profile as text beside ``path``."""
        out = {}
        for key, point in self._points.items():
            if not point["step"] or point["profile"] is None:
                continue
            batch, context = key.split(",")
            stats = pstats.Stats(point["profile"])
            steps = point["calls"] - WARMUP_CALLS - len(point["step"])
            text_path = path.with_name(f"{path.stem}-b{batch}-c{context}.txt")
            with open(text_path, "w") as f:
                pstats.Stats(point["profile"], stream=f).sort_stats("cumulative").print_stats(80)
            ms = lambda values: 1e3 * statistics.median(values) if values else None  # noqa: E731
            out[key] = {
                "host_to_launch_ms": ms(point["to_launch"]),
                "host_call_ms": ms(point["call"]),
                "step_ms": ms(point["step"]),
                "functions": _ranked_functions(stats, steps),
            }
        path.write_text(json.dumps(out))


def _ranked_functions(stats: pstats.Stats, steps: int) -> list[tuple[str, float]]:
    """(name, cumulative ms per step) of every profiled function, the most cumulative first."""
    rows = []
    for (filename, _, name), (_, _, _, cumulative, _) in stats.stats.items():
        where = Path(filename)
        label = name if filename == "~" else f"{where.parent.name}/{where.stem}.{name}"
        rows.append((label, 1e3 * cumulative / max(steps, 1)))
    return sorted(rows, key=lambda row: -row[1])
