"""Worker processes for the CPU benchmarks that spread independent tasks over cores: spawned
(torch's threads do not survive a fork), and each ends once the run that started it is gone, so
that a run killed by its PID does not leave workers measuring tasks of minutes on cores the
next run needs."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor


def pool(processes: int, initializer: Callable, initargs: tuple) -> ProcessPoolExecutor:
    """``processes`` spawned workers, each running ``initializer(*initargs)`` first."""
    return ProcessPoolExecutor(
        processes, mp_context=multiprocessing.get_context("spawn"),
        initializer=_start, initargs=(initializer, initargs),
    )  # fmt: skip


def _start(initializer: Callable, initargs: tuple) -> None:
    stop_with_parent()
    initializer(*initargs)


def stop_with_parent(poll_s: float = 1.0) -> None:
    """Ends this process once its parent has gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
