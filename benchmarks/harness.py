"""What every benchmark shares: the row schema, where and with what a run happened, the engine
flags and environments of this host, an SGLang server in a subprocess, and saving results (JSON
rows, a section of RESULTS.md, PNG plots via benchmarks.plot)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import re
import shlex
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path


from benchmarks.engine_process import EngineServer, engine_env, free_port, log_tail  # noqa: F401  (re-exported)
from sglang_ext.engine.backends import default_cuda_backend
from sglang_ext.launch import CPU_DEFAULT_MAX_TOTAL_TOKENS
from sglang_ext.platform import cpu
from sglang_ext.rows import Row  # noqa: F401  (re-exported: benchmarks write harness.Row)

BENCH_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = BENCH_DIR / "configs"
DEFAULT_OUT_DIR = BENCH_DIR / "results"
# a run appends its section to the month's history log; RESULTS.md holds the curated current numbers
DEFAULT_RESULTS_MD = BENCH_DIR / "history" / f"RESULTS-{dt.date.today():%Y-%m}.md"
VANILLA = "vanilla"
REAL_MODEL = "smollm2-135m-instruct"  # the embedded model, as rows of its real weights name it
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_TARGET = "sglang_ext.plugin:register"


@dataclasses.dataclass
class RunInfo:
    device: str
    sglang_version: str
    torch_version: str
    date: str
    command: str

    @classmethod
    def detect(cls, on_cpu: bool = False) -> RunInfo:
        """``on_cpu``: the run computes on the CPU even where a GPU is present (the trace
        benchmarks), so its rows name the CPU."""
        import torch

        now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        return cls(
            device=device_name(on_cpu),
            sglang_version=_version("sglang"),
            torch_version=torch.__version__,
            date=now.isoformat().replace("+00:00", "Z"),
            command=_command_line(),
        )

    @property
    def device_slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.device.lower()).strip("-")

    def row(self, **fields) -> Row:
        return Row(device=self.device, sglang_version=self.sglang_version, date=self.date, **fields)


def _command_line() -> str:
    """How this process was started, as one would type it again."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["python", "-m", spec.name] if spec else ["python", sys.argv[0]]
    return shlex.join([*head, *sys.argv[1:]])


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


# torch's vectorised kernels and MKL's BLAS: the instruction set each computes with
CPU_NUMERICS_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR")


def device_name(on_cpu: bool = False) -> str:
    if cpu.is_cuda_host() and not on_cpu:
        import torch

        return torch.cuda.get_device_name(0)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    name = f"CPU {model.group(1).strip() if model else 'unknown'} ({os.cpu_count()} cores)"
    # A CPU's float rounding follows the instruction set its kernels run; a run that forces one
    # rounds otherwise than the same CPU left alone, so its rows say which.
    forced = [f"{var}={os.environ[var]}" for var in CPU_NUMERICS_ENV if os.environ.get(var)]
    return f"{name} {' '.join(forced)}" if forced else name


def shape_path(shape: str) -> Path:
    path = CONFIGS_DIR / shape
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(p.name for p in CONFIGS_DIR.iterdir() if p.is_dir()))
        raise SystemExit(f"unknown --shape {shape!r} (known: {known})")
    return path


def shape_config(shape: str) -> dict:
    return json.loads((shape_path(shape) / "config.json").read_text())


def common_parser(bench: str, doc: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes: what to run, against which policies, where results go."""
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{bench}", description=doc.split("\n\n")[0]
    )
    parser.add_argument(
        "--shape", required=True, help="model shape: a folder of benchmarks/configs"
    )
    parser.add_argument("--policies", type=name_list, default=[VANILLA, "full"])
    parser.add_argument(
        "--policy-config", default=None,
        help="JSON given to every non-vanilla policy, or an object keyed by --policies entries "
        "(each gets its own; an entry not named gets its defaults)",
    )  # fmt: skip
    parser.add_argument(
        "--max-total-tokens", type=int, default=None, help="KV pool size (default: SGLang's)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs)")
    parser.add_argument(
        "--context-length", type=int, default=None, help="SGLang's (default: the model's)"
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--results-md", type=Path, default=DEFAULT_RESULTS_MD)
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="engine logs (default: --out-dir)"
    )
    return parser


def trace_parser(
    bench: str, doc: str, lengths: list[int], decode_steps: int | None = None
) -> argparse.ArgumentParser:
    """The flags of the benchmarks that replay full-attention decode traces of real weights on the
    CPU (sglang_ext.tools.attention_trace): which model, prompts and steps, where results go."""
    from sglang_ext.tools.attention_trace import SEED_TEXT_DIR

    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{bench}", description=doc.split("\n\n")[0]
    )
    parser.add_argument(
        "--model-path", type=Path, default=None, help="HF folder (default: SmolLM2)"
    )
    parser.add_argument("--lengths", type=int_list, default=lengths)
    if decode_steps is not None:
        parser.add_argument("--decode-steps", type=int, default=decode_steps)
    parser.add_argument("--prompts-per-length", type=int, default=2)
    parser.add_argument("--text-dir", type=Path, default=SEED_TEXT_DIR)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--results-md", type=Path, default=DEFAULT_RESULTS_MD)
    return parser


def model_label(args: argparse.Namespace) -> str:
    """What a row's ``model_shape`` names: the shape, or the embedded model where a benchmark
    serves its real weights (``--real-weights``)."""
    return REAL_MODEL if getattr(args, "real_weights", False) else args.shape


def run_label(args: argparse.Namespace) -> str:
    """The model (``model_label``), and the tensor- and data-parallel sizes where over 1 (``--dp``
    where the benchmark has it): names a run's result files."""
    sizes = (("tp", args.tp), ("dp", getattr(args, "dp", 1)))
    return model_label(args) + "".join(f"-{name}{size}" for name, size in sizes if size > 1)


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def float_list(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def policy_variant(text: str, policies=("delta", "tidal", "lethe")) -> tuple[str, dict]:
    """``NAME:KEY=VALUE,...`` -> (policy name, parameters) for NAME among ``policies``; values
    are JSON (numbers, lists)."""
    name, _, assignments = text.partition(":")
    if name not in policies or not assignments:
        expected = ", ".join(f"{policy}:KEY=VALUE,..." for policy in policies)
        raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}")
    params = {}
    # a comma starts the next KEY=VALUE only where one follows: a list value keeps its commas
    for assignment in re.split(r",(?=\s*[A-Za-z_]\w*=)", assignments):
        key, equals, value = assignment.partition("=")
        if not equals:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {assignment!r}")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(f"{key}: {value!r} is not a JSON value") from err
    from sglang_ext.policies import PolicyConfigError, build_policy

    try:
        build_policy(name, params)
    except PolicyConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return name, params


def variant_list(text: str, policies=("delta", "tidal", "lethe")) -> list[tuple[str, dict]]:
    """``--variants``: policy variants separated by ';' (``policy_variant`` each)."""
    return [policy_variant(part, policies) for part in text.split(";") if part]


def art_tiles(url: str) -> tuple[float, float]:
    """(tiles read, tiles in the traversals) so far on the server at ``url``, from the extension's
    Prometheus metrics (``--enable-metrics``); they lag the kernel by a step or so (copied back
    without waiting)."""
    import requests

    text = requests.get(f"{url}/metrics", timeout=30).text
    values = {}
    for name in ("art_tiles_read_total", "art_tiles_total"):
        found = re.search(rf"^sglang_ext:{name}{{[^}}]*}} (\S+)$", text, re.M)
        values[name] = float(found[1]) if found else 0.0
    return values["art_tiles_read_total"], values["art_tiles_total"]


def split_policy(name: str) -> tuple[str, str | None]:
    """``vanilla@fa3`` -> ("vanilla", "fa3"): a policy run on a named attention backend."""
    policy, _, backend = name.partition("@")
    return policy, backend or None


def named_backend(name: str) -> str:
    """The attention backend ``NAME@BACKEND`` names ("" where it names none): a kernel row's."""
    return split_policy(name)[1] or ""


def is_vanilla(name: str) -> bool:
    return split_policy(name)[0] == VANILLA


# In a benchmark's --policies, ``lethe/delta`` is one server of both (``--policy lethe,delta``)
# whose requests name its members in turn.
MIX_SEPARATOR = "/"


def served_policy(name: str) -> str:
    """The ``--policy`` a benchmark's policy name serves (``lethe/delta@fa3`` -> lethe,delta)."""
    return split_policy(name)[0].replace(MIX_SEPARATOR, ",")


def file_safe(name: str) -> str:
    """A policy's name as part of a file name: letters, digits, '.', '_' and '-' only
    (``lethe/delta`` is no file name; a device call brings back no file named with '@' or '+')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def request_policies(name: str) -> list[str | None]:
    """The ``kv_policy.name`` each request names, in turn: a mix's members; [None] otherwise."""
    policy = split_policy(name)[0]
    return policy.split(MIX_SEPARATOR) if MIX_SEPARATOR in policy else [None]


def policy_config(policy: str, config: str | None, policies: list[str]) -> str | None:
    """``--policy-config`` as ``policy`` (one of ``policies``) gets it: the entry under its name
    when every key of the object names one of ``policies``, else the whole text."""
    if not config:
        return None
    value = json.loads(config)
    if isinstance(value, dict) and value and set(value) <= set(policies):
        return json.dumps(value[policy]) if policy in value else None
    return config


def policy_budget(name: str, config: str | None) -> str:
    """The KV budget a benchmark row names for a policy (``--policy-config`` JSON or defaults);
    empty for vanilla."""
    if is_vanilla(name):
        return ""
    from sglang_ext.policies import build_policy

    return build_policy(served_policy(name), json.loads(config or "{}")).budget()


def engine_flags(
    max_total_tokens: int | None, tp: int = 1, context_length: int | None = None,
    attention_backend: str | None = None, dp: int = 1,
) -> list[str]:
    """SGLang flags for this host, shared by vanilla and policy runs so both see the same engine.

    On CUDA, prefill CUDA-graph capture is off (it takes most of the start-up time); decode CUDA
    graphs stay on. On CPU the KV pool is capped as sglang_ext.launch caps it.
    """
    if cpu.is_cuda_host():
        backend = attention_backend or default_cuda_backend()
        flags = ["--attention-backend", backend, "--disable-prefill-cuda-graph"]
    else:
        flags = cpu.as_argv(cpu.server_flags())
        max_total_tokens = max_total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS
    if max_total_tokens:
        flags += ["--max-total-tokens", str(max_total_tokens)]
    if tp > 1:
        flags += ["--tp-size", str(tp)]
    if dp > 1:  # SGLang's data-parallel controller: dp workers of tp GPUs each
        flags += ["--dp-size", str(dp)]
    if context_length:
        flags += ["--context-length", str(context_length)]
    return flags


def require_plugin_entry_point() -> None:
    """SGLang loads plugins in each engine process (the spawned scheduler too) from installed entry
    points only: with sglang_ext merely on PYTHONPATH, a policy server would serve vanilla."""
    if not any(ep.value == PLUGIN_TARGET for ep in metadata.entry_points(group=PLUGIN_GROUP)):
        raise SystemExit(
            f"no {PLUGIN_GROUP} entry point for {PLUGIN_TARGET}: install sglang_ext "
            "(pip install -e ., or on the GPU machine scripts/gpu_install_ext.sh and "
            "PYTHONPATH=/tmp/site:/tmp/ext)"
        )


def copy_bytes_per_s(device: str, nbytes: int = 1 << 30, repeats: int = 9) -> float:
    """The device's memory bandwidth as a device-to-device copy sees it (each byte read and
    written: 2 * nbytes moved), median of ``repeats``: the rate a decode step's reads are judged by."""
    import torch  # the engine's children and the kernel bench measure; the parents need no torch

    if device != "cuda":
        nbytes = min(nbytes, 1 << 26)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    seconds = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            target.copy_(source)
            seconds.append(time.perf_counter() - began)
    del source, target
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(seconds)



def point_of(row: Row) -> tuple:
    """The point a row measures: its benchmark, shape, batch and context."""
    return row.bench, row.model_shape, row.batch, row.context


def fastest_vanilla(rows: list[Row], speed_metric: str) -> dict[tuple, Row]:
    """Per point (``point_of``), the vanilla row of ``speed_metric`` with the best value."""
    fastest: dict[tuple, Row] = {}
    for r in rows:
        if r.metric == speed_metric and is_vanilla(r.policy) and r.value is not None:
            held = fastest.get(point_of(r))
            if held is None or _better(r, held):
                fastest[point_of(r)] = r
    return fastest


def add_baseline_ratios(rows: list[Row], speed_metric: str | None = None) -> None:
    """Fill baseline_value (vanilla's value at the same point of the same run), baseline_backend
    and ratio. Where vanilla ran on several backends (``vanilla@BACKEND``), the baseline of every
    metric at a point is the backend fastest there by ``speed_metric``, so that one row set never
    compares its metrics against different backends; without one, or at a point where no vanilla
    has it, each metric's best vanilla value."""
    fastest = fastest_vanilla(rows, speed_metric) if speed_metric else {}
    best: dict = {}
    for r in rows:
        if not is_vanilla(r.policy) or r.value is None:
            continue
        key, held = (point_of(r), r.metric), best.get((point_of(r), r.metric))
        if point_of(r) in fastest:
            if r.policy == fastest[point_of(r)].policy:
                best[key] = r
        elif held is None or _better(r, held):
            best[key] = r
    for row in rows:
        baseline = best.get((point_of(row), row.metric))
        row.baseline_value = baseline.value if baseline else None
        row.baseline_backend = baseline.attention_backend if baseline else ""
        if row.value is not None and row.baseline_value:
            row.ratio = row.value / row.baseline_value


def _better(row: Row, than: Row) -> bool:
    """Whether ``row``'s value beats ``than``'s of the same metric: smaller for times and
    distances from the floor, larger for rates."""
    lower_is_better = (
        "latency" in row.metric or "floor" in row.metric or row.metric.endswith("_ms")
    )
    return (row.value < than.value) == lower_is_better


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| policy | batch | context | metric | value | vanilla (fastest backend) | ratio |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        value = f"skipped: {r.skipped}" if r.skipped else _fmt(r.value)
        baseline = _fmt(r.baseline_value) + (f" ({r.baseline_backend})" if r.baseline_backend else "")
        lines.append(
            f"| {r.policy} | {r.batch} | {r.context} | {r.metric} | {value} "
            f"| {baseline} | {_fmt(r.ratio)} |"
        )
    return "\n".join(lines)


def _unused_path(path: Path) -> Path:
    """``path``, or ``stem-2``, ``stem-3``... when a run of the same day already wrote it."""
    candidate, n = path, 2
    while candidate.exists():
        candidate, n = path.with_name(f"{path.stem}-{n}{path.suffix}"), n + 1
    return candidate


def save_results(
    bench: str, shape: str, rows: list[Row], info: RunInfo, out_dir: Path, results_md: Path
) -> Path:
    """Write the rows as JSON, append a RESULTS.md section and print the table.

    Returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = _unused_path(out_dir / f"{bench}-{shape}-{info.device_slug}-{info.date[:10]}.json")
    json_path.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    table = markdown_table(rows)
    section = "\n".join(
        [
            f"## {bench} · {shape} · {info.device} · {info.date}",
            "",
            f"- command: `{info.command}`",
            f"- device: {info.device}; sglang {info.sglang_version}; torch {info.torch_version}",
            f"- rows: `{json_path.name}`",
            "",
            table,
            "",
        ]
    )
    if not results_md.exists():
        results_md.parent.mkdir(parents=True, exist_ok=True)
        results_md.write_text(
            "# Benchmark results\n\nSections appended by the scripts in benchmarks/; each policy "
            "is compared with vanilla SGLang measured in the same run.\n\n"
        )
    with open(results_md, "a") as md:
        md.write(section + "\n")
    print(f"\n{table}\n\nrows: {json_path}\nsection appended to: {results_md}", flush=True)
    return json_path
