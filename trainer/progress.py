"""How a training reports its progress and is told to stop: the two callbacks, the plain progress line for logs,
and the progress bar on a terminal."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

ProgressFn = Callable[[dict[str, Any]], None]
StopFn = Callable[[], bool]


class TrainingStopped(Exception):
    """``should_stop`` said so: the run ended between two steps, and nothing was produced."""

    def __init__(self, step: int, total: int) -> None:
        super().__init__(f"stopped at update {step} of {total}")
        self.step, self.total = step, total


def never() -> bool:
    """A ``should_stop`` that never says so."""
    return False


def progress_line(p: dict[str, Any]) -> str:
    """One plain line for a progress report (what ``on_progress`` receives), for logs and non-terminal stderr."""
    dev = "".join(f" dev {k} {v:.4f}" for k, v in (p["dev"] or {}).items())
    return f"step {p['step']}/{p['total_steps']} loss {p['loss']:.4f}{dev} (seed={p['seed']} lr={p['lr']:g})"


def progress_logger(every_s: float = 30.0, prefix: str = "") -> ProgressFn | None:
    """An ``on_progress`` that prints a plain ``progress_line`` on stderr at most every ``every_s`` seconds (and at a
    run group's last update), each after ``prefix`` (which run it is, where several share a log) -- or None when stderr
    is a terminal, where the trainer's progress bar shows instead. For logs, CI and ``nohup``, where there is no
    bar and an hour-long run would otherwise print nothing until it ends."""
    if sys.stderr.isatty():
        return None
    last = [-math.inf]

    def log(p: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - last[0] < every_s and p["step"] != p["total_steps"]:
            return
        last[0] = now
        print(prefix + progress_line(p), file=sys.stderr, flush=True)

    return log


def progress_bar(total: int, desc: str) -> tqdm:
    """A progress bar of ``total`` updates on a terminal's stderr (off anywhere else: logs get ``progress_logger``)."""
    return tqdm(total=total, desc=desc, disable=not sys.stderr.isatty(), leave=False, dynamic_ncols=True)
