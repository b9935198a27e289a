"""Running the cases: each case is built, then sent under each arm in turn (the server's prefix
cache then holds its prompt for the next arm), ``--concurrency`` cases at a time. Every result is
stored as it finishes; a failed request is stored as failed and the run goes on."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import threading
import time
from typing import TextIO

from sglang_ext.eval import scoring
from sglang_ext.eval.client import Server
from sglang_ext.eval.store import Result, Store
from sglang_ext.eval.tasks import TASKS, Encoder, build_case, case_key


@dataclasses.dataclass(frozen=True)
class Arm:
    """A way to run a case: a policy of the server, or the reference (full attention)."""

    name: str  # a policy's name, or store.REFERENCE
    server: Server
    kv_policy: dict | None  # custom_params.kv_policy; None: none sent (a vanilla server)

    def __post_init__(self):
        if not self.name:
            raise ValueError("an arm needs a name")


@dataclasses.dataclass(frozen=True)
class CaseId:
    task: str
    length: int
    index: int

    def __post_init__(self):
        if self.task not in TASKS or self.length < 1 or self.index < 0:
            raise ValueError(f"no such case: {self}")

    @property
    def key(self) -> str:
        return case_key(self.task, self.length, self.index)


class Progress:
    """Requests done of those to run, on stderr: one line rewritten on a terminal, a line per
    tenth of the run elsewhere (a CI log)."""

    def __init__(self, total: int, stream: TextIO | None = None):
        self.total, self.stream, self.done, self.failed = total, stream or sys.stderr, 0, 0
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self._tty = self.stream.isatty()

    def add(self, result: Result) -> None:
        with self._lock:
            self.done += 1
            self.failed += result.error is not None
            if self._tty or self.done == self.total or self.done % max(1, self.total // 10) == 0:
                elapsed = int(time.monotonic() - self.start)
                line = (f"[eval] {self.done}/{self.total} requests, {self.failed} failed, "
                        f"{elapsed // 60}:{elapsed % 60:02d}")  # fmt: skip
                end = "\n" if not self._tty or self.done == self.total else ""
                print(("\r" if self._tty else "") + line, end=end, file=self.stream, flush=True)


def run(
    encoder: Encoder,
    cases: list[CaseId],
    arms: list[Arm],
    store: Store,
    seed: int,
    concurrency: int,
    max_new_tokens: int | None,
) -> None:
    """Every (case, arm) the store does not hold yet. Ctrl-C stops after the requests in flight."""
    todo = [(case, [a for a in arms if not store.done(case.key, a.name)]) for case in cases]
    todo = [(case, pending) for case, pending in todo if pending]
    progress = Progress(sum(len(pending) for _, pending in todo))
    if not todo:
        print(f"[eval] nothing to run: all {len(cases) * len(arms)} results are in {store.folder}",
              file=sys.stderr)  # fmt: skip
    stop = threading.Event()

    def run_case(case: CaseId, pending: list[Arm]) -> None:
        new_tokens = max_new_tokens or TASKS[case.task].max_new_tokens
        try:
            built = build_case(encoder, case.task, case.length, case.index, seed)
        except Exception as err:  # noqa: BLE001  (the server's tokenizer failed: every arm fails)
            for arm in pending:
                why = f"building the case: {type(err).__name__}: {err}"
                failed = Result(case.key, case.task, case.length, arm.name, (), 0.0, error=why)
                store.add(failed)
                progress.add(failed)
            return
        for arm in pending:
            if stop.is_set():
                return
            started = time.monotonic()
            try:
                out = arm.server.generate(built.input_ids, arm.kv_policy, new_tokens)
                result = Result(
                    case.key, case.task, case.length, arm.name, built.answers,
                    round(time.monotonic() - started, 3), tuple(out.output_ids), out.text,
                    scoring.is_correct(built.answers, out.text), out.kv_policy,
                    out.retained_tokens, out.evicted_tokens, out.attended_tokens,
                    answer_depths=built.answer_depths,
                )  # fmt: skip
            except Exception as err:  # noqa: BLE001  (recorded, reported; the run goes on)
                result = Result(case.key, case.task, case.length, arm.name, built.answers,
                                round(time.monotonic() - started, 3),
                                error=f"{type(err).__name__}: {err}",
                                answer_depths=built.answer_depths)  # fmt: skip
            store.add(result)
            progress.add(result)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency)
    try:
        futures = [pool.submit(run_case, case, pending) for case, pending in todo]
        for future in concurrent.futures.as_completed(futures):
            future.result()
    except KeyboardInterrupt:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
