"""The command: flags, the checks against the server before anything runs (a bad flag or a server
that cannot take the run is exit code 2 naming the flag, as argparse's own errors), the run, the
report. Exit 0 when every request finished, 1 when some failed (reported), 130 on Ctrl-C."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from sglang_ext.eval import report, runner
from sglang_ext.eval.client import Server, ServerEncoder, ServerError, ServerFacts
from sglang_ext.eval.store import REFERENCE, Settings, SettingsMismatch, Store
from sglang_ext.eval.tasks import TASKS, build_case

DEFAULT_LENGTHS = [4096 * 2**i for i in range(6)]  # 4k .. 128k, those the server holds
FULL = "full"


def length_list(text: str) -> list[int]:
    """``4k,8k,1536``: tokens, a k suffix meaning 1024."""
    lengths = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        digits, k = (part[:-1], 1024) if part.endswith("k") else (part, 1)
        if not digits.isdigit() or int(digits) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not a length (e.g. 4k, 8k, 1536)")
        lengths.append(int(digits) * k)
    if not lengths:
        raise argparse.ArgumentTypeError("no length given")
    return sorted(set(lengths))


def name_list(text: str) -> list[str]:
    names = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not names:
        raise argparse.ArgumentTypeError("no name given")
    return names


def task_list(text: str) -> list[str]:
    names = name_list(text)
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown task {unknown[0]!r} (tasks: {', '.join(TASKS)})")
    return names


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_ext.eval",
        description="What each KV policy of a running sglang_ext server costs in answers, task by "
        "task and length by length, against full attention on the same server (docs/eval.md).",
    )  # fmt: skip
    p.add_argument("--url", required=True, help="the server (python -m sglang_ext.launch ...)")
    p.add_argument("--baseline-url", default=None,
                   help="a vanilla SGLang server of the same model as the reference, instead of "
                   "full attention on --url")  # fmt: skip
    p.add_argument("--api-key", default=None, help="the servers' --api-key")
    p.add_argument("--policies", type=name_list, default=None,
                   help="policies to evaluate (default: every one the server serves)")  # fmt: skip
    p.add_argument("--tasks", type=task_list, default=list(TASKS),
                   help="; ".join(f"{t.name}: {t.about}" for t in TASKS.values())
                   + " (default: all)")  # fmt: skip
    p.add_argument("--lengths", type=length_list, default=None,
                   help="prompt lengths in tokens, k = 1024 (default: 4k, 8k, ... 128k, as far as "
                   "the server holds)")  # fmt: skip
    p.add_argument("--cases", type=positive_int, default=10, help="per task and length")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="tokens generated per answer (default: each task's, 16 to 48)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=positive_int, default=4, help="cases in flight")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds per request")
    p.add_argument("--out", type=Path, default=Path("sglang-ext-eval"),
                   help="results (results.jsonl: a rerun resumes), rows.json, table.md, "
                   "accuracy.png")  # fmt: skip
    return p


def _server(p: argparse.ArgumentParser, flag: str, url: str, args) -> tuple[Server, ServerFacts]:
    try:
        server = Server(url, args.api_key, args.timeout)
        return server, server.facts()
    except (ValueError, ServerError, KeyError, IndexError) as err:
        hint = "; give its key with --api-key" if "HTTP 401" in str(err) else ""
        p.error(f"{flag} {url}: not a reachable SGLang server ({err}){hint}")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    server, facts = _server(p, "--url", args.url, args)
    try:
        info = server.policy_info()
    except ServerError as err:
        p.error(f"--url {args.url}: GET /policy failed ({err})")
    if info is None:
        p.error(f"--url {args.url} serves no KV policy (no GET /policy): start it with "
                "python -m sglang_ext.launch --policy ...; a vanilla server goes to "
                "--baseline-url")  # fmt: skip
    served = list(info["per_request"]["policies"])
    policies = args.policies or served
    unknown = [name for name in policies if name not in served]
    if unknown:
        p.error(f"--policies: {unknown[0]!r} is not served by {args.url} "
                f"(serves: {', '.join(served)})")  # fmt: skip

    if args.baseline_url:
        baseline, reference_facts = _server(p, "--baseline-url", args.baseline_url, args)
        probe = ["The quick brown fox, 12345 times."]
        try:
            if baseline.policy_info() is not None:
                p.error(f"--baseline-url {args.baseline_url} serves a KV policy: give a "
                        "vanilla SGLang server")  # fmt: skip
            if baseline.tokenize(probe) != server.tokenize(probe):
                p.error(f"--baseline-url {args.baseline_url}: its tokenizer is not --url's")
        except ServerError as err:
            p.error(f"--baseline-url {args.baseline_url}: {err}")
        reference = runner.Arm(REFERENCE, baseline, None)
        reference_label, reference_key = "vanilla", f"baseline {reference_facts.model}"
    elif FULL in served:
        reference = runner.Arm(REFERENCE, server, {"name": FULL})
        reference_facts, reference_label, reference_key = facts, FULL, FULL
    else:
        name = info["policy"]["name"]
        p.error(f"--url {args.url} serves {name}, which a request cannot opt out of to full "
                f"attention: serve full beside it (--policy {name},full) or give "
                "--baseline-url")  # fmt: skip

    new_tokens = args.max_new_tokens or max(TASKS[t].max_new_tokens for t in args.tasks)
    limit = min(f.max_prompt_len(new_tokens) for f in (facts, reference_facts))
    lengths = args.lengths or [n for n in DEFAULT_LENGTHS if n <= limit]
    too_long = [n for n in lengths if n > limit]
    if too_long or not lengths:
        first = too_long[0] if too_long else DEFAULT_LENGTHS[0]
        p.error(f"--lengths: {first} tokens is more than the server holds: at most {limit} "
                f"prompt tokens with {new_tokens} generated ({facts.context_len}-token context, "
                f"{facts.pool_tokens}-token KV pool)")  # fmt: skip

    encoder = ServerEncoder(server)
    try:  # each task fits the shortest length (the longer ones then fit too)
        for task in args.tasks:
            build_case(encoder, task, lengths[0], 0, args.seed)
    except ValueError as err:
        p.error(f"--lengths: {err}")
    except ServerError as err:
        p.error(f"--url {args.url}: tokenizing failed ({err})")

    settings = Settings(args.seed, facts.model, info["policy"], reference_key, args.max_new_tokens)
    try:
        store = Store(args.out, settings)
    except SettingsMismatch as err:
        p.error(f"--out: {err}; give another --out or the same settings")
    cases = [runner.CaseId(t, n, i) for n in lengths for t in args.tasks for i in range(args.cases)]
    # Evicting policies first in each case, the reference last: a prompt a request that does not
    # evict leaves in the radix cache would be shared by an evicting request after it, which may
    # not free it (its KV kept would show 100 %); an evicting request leaves none there.
    built = report.served_policies(info["policy"], policies)
    in_turn = sorted(policies, key=lambda name: not (built[name] and built[name].evicts()))
    arms = [*(runner.Arm(name, server, {"name": name}) for name in in_turn), reference]
    try:
        runner.run(encoder, cases, arms, store, args.seed, args.concurrency, args.max_new_tokens)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished results are kept in {args.out}; the same command resumes",
              file=sys.stderr)  # fmt: skip
        return 130

    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    run_info = report.RunInfo(
        args.url, facts, reference_facts, reference_label, tuple(policies), tuple(args.tasks),
        tuple(lengths), args.cases, args.concurrency, args.seed,
        now.isoformat().replace("+00:00", "Z"), report.policy_budgets(info["policy"], policies),
    )  # fmt: skip
    written = report.write(args.out, store, run_info)
    print((args.out / report.TABLE_FILE).read_text())
    print("wrote " + ", ".join(str(path) for path in written), file=sys.stderr)
    if store.failed:
        print(f"{len(store.failed)} requests failed (in the table; rerun to retry them), e.g. "
              f"{next(iter(store.failed.values())).error}", file=sys.stderr)  # fmt: skip
        return 1
    return 0
