"""Results as they finish, one JSON line each in ``--out``: a run stopped anywhere keeps what ran,
and a rerun with the same settings skips it (a request that failed is tried again)."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from pathlib import Path

RESULTS_FILE = "results.jsonl"
SETTINGS_FILE = "settings.json"
REFERENCE = "reference"  # the arm of full attention (or of --baseline-url); never a policy's name


@dataclasses.dataclass(frozen=True)
class Result:
    """One case under one arm: a policy, or the reference."""

    case: str  # tasks.Case.key
    task: str
    length: int
    arm: str
    answers: tuple[str, ...]
    seconds: float
    output_ids: tuple[int, ...] = ()
    text: str = ""
    correct: bool | None = None
    kv_policy: str | None = None  # as the server reported (the policy that decoded it)
    retained_tokens: int | None = None
    evicted_tokens: int | None = None
    attended_tokens: float | None = None
    error: str | None = None  # why there is no output
    answer_depths: tuple[float, ...] = ()  # tasks.Case's: where the answers' needles are

    def __post_init__(self):
        if not self.arm or not self.case or self.length < 1:
            raise ValueError(f"incomplete result: {self}")
        if (self.error is None) != (self.correct is not None):
            raise ValueError(f"{self.case} {self.arm}: a score, or an error, not both")

    @property
    def index(self) -> int:
        return int(self.case.rsplit("/", 1)[1])

    @classmethod
    def from_json(cls, line: str) -> Result:
        fields = json.loads(line)
        for name in ("answers", "output_ids", "answer_depths"):
            fields[name] = tuple(fields.get(name, ()))
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a run's results depend on beyond a case's key: a rerun into the same folder must
    have the same."""

    seed: int
    model: str  # the served model's name
    served_policy: dict  # GET /policy's "policy": the policies' resolved parameters
    reference: str  # "full" (on the server), or "baseline MODEL" (--baseline-url)
    max_new_tokens: int | None  # --max-new-tokens; None: each task's own

    def __post_init__(self):
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")


class SettingsMismatch(ValueError):
    pass


class Store:
    def __init__(self, folder: Path, settings: Settings):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        saved, now = folder / SETTINGS_FILE, dataclasses.asdict(settings)
        if saved.exists():
            before = json.loads(saved.read_text())
            changed = sorted(k for k in {*before, *now} if before.get(k) != now.get(k))
            if changed:
                detail = "; ".join(
                    f"{k} {before.get(k)!r} then, {now.get(k)!r} now" for k in changed
                )
                raise SettingsMismatch(f"{folder} holds results of other settings: {detail}")
        else:
            saved.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        self.finished: dict[tuple[str, str], Result] = {}
        self.failed: dict[tuple[str, str], Result] = {}  # this run's, unless finished since
        self._lock = threading.Lock()
        path = folder / RESULTS_FILE
        if path.exists():
            for number, line in enumerate(path.read_text().splitlines(), 1):
                try:
                    result = Result.from_json(line)
                except (ValueError, TypeError) as err:  # a line cut short when a run was killed
                    print(f"{path}:{number}: skipped ({err})", file=sys.stderr)
                    continue
                if result.error is None:
                    self.finished[(result.case, result.arm)] = result

    def done(self, case: str, arm: str) -> bool:
        return (case, arm) in self.finished

    def add(self, result: Result) -> None:
        line = json.dumps(dataclasses.asdict(result)) + "\n"
        with self._lock:
            with open(self.folder / RESULTS_FILE, "a") as out:
                out.write(line)
            key = (result.case, result.arm)
            if result.error is None:
                self.finished[key] = result
                self.failed.pop(key, None)
            else:
                self.failed[key] = result
