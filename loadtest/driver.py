"""Running locustfile.py headless against a server, and reading its stats CSV back."""

from __future__ import annotations

import csv
import os
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# locust's own entries of a STREAM-typed event that are not requests: time to first token,
# inter-token gaps, aborts on purpose (loadtest/locustfile.py)
DERIVED = ("TTFT", "ITL", "ABORTED")


def run_locust(locust: str, host: str, out_dir: Path, users: int, duration: str, env: dict[str, str]) -> float:
    """locustfile.py for ``duration`` with ``users`` users (``env``: its LOADTEST_* mix, over
    this environment); CSVs and HTML under ``out_dir`` as ``locust*``. Returns the seconds it ran."""
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    subprocess.run(
        [locust, "-f", str(HERE / "locustfile.py"), "--headless", "--host", host,
         "--users", str(users), "--spawn-rate", str(users), "--run-time", duration,
         "--csv", str(out_dir / "locust"), "--html", str(out_dir / "locust.html"),
         "--only-summary", "--exit-code-on-error", "0"],
        env={**os.environ, **env}, check=True,
    )  # fmt: skip
    return time.monotonic() - started


def settle(server, timeout: float = 300) -> dict:
    """After a load: wait until ``server`` is idle (SGLang's idle memory check runs), then whether
    it is healthy and its log is free of leaks and tracebacks; ``log`` is the log itself."""
    import requests

    server.wait_idle(timeout=timeout)
    log = server.log()
    return {
        "healthy_after": requests.get(f"{server.url}/health", timeout=60).status_code == 200,
        "leak_or_traceback_in_log": any(word in log for word in ("leak", "Leak", "Traceback")),
        "log": log,
    }


def read_stats(stats_csv: Path) -> dict[str, dict[str, float]]:
    """Per locust entry ("TYPE NAME"): requests, failures, mean, median, p95, p99 (ms)."""
    with open(stats_csv) as f:
        return {
            f"{row['Type']} {row['Name']}": {
                "requests": int(row["Request Count"]), "failures": int(row["Failure Count"]),
                "mean_ms": float(row["Average Response Time"]), "p50_ms": _ms(row["50%"]),
                "p95_ms": _ms(row["95%"]), "p99_ms": _ms(row["99%"]),
            }
            for row in csv.DictReader(f)
            if row["Name"] != "Aggregated"
        }  # fmt: skip


def _ms(value: str) -> float | None:
    return None if value in ("", "N/A") else float(value)


def is_request(entry: str) -> bool:
    """A request of its own (not a TTFT/ITL/ABORTED entry derived from one)."""
    return not entry.split(" ", 1)[1].startswith(DERIVED)
