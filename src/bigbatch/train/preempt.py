"""Preemption: a job told to stop (SIGTERM, as SLURM and Kubernetes stop jobs; SIGUSR1, as
SLURM warns before the end of a job's time) finishes the step it is in, writes a checkpoint
and exits with :data:`PREEMPTED_EXIT`, on every rank together.

A signal reaches one process, or all at different moments; the ranks must stop after the same
step, or one would wait in the next step's collectives for ranks that left. So the handler
only notes the signal, and after each step the ranks agree (:meth:`StopSignals.agreed`: the
largest flag over ranks, one small all-reduce on the group the main rank's work waits on):
when any rank was told to stop, all write the checkpoint of that step and stop.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from ..engine import distributed as D
from .main_rank import any_rank

__all__ = ["PREEMPT_SIGNALS", "PREEMPTED_EXIT", "StopSignals"]

PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1")
# the exit status of a run stopped by one of them after writing its checkpoint (EX_TEMPFAIL:
# "try again later"), distinct from an error (2), Ctrl-C (130) and a kill by SIGTERM (143)
PREEMPTED_EXIT = 75


class StopSignals:
    """``with StopSignals() as stop:`` notes SIGTERM and SIGUSR1 (the first one received)
    instead of dying at once, while the training loop runs; the previous handlers come back
    on exit. Outside the main thread (where Python cannot handle signals) it notes nothing."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for name in PREEMPT_SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def agreed(self, info: D.WorldInfo) -> str | None:
        """The signal any rank received (the same answer on every rank: call on all, at the
        same point), or None."""
        flag = PREEMPT_SIGNALS.index(self.received) + 1 if self.received else 0
        flag = any_rank(flag, info)
        return PREEMPT_SIGNALS[flag - 1] if flag else None
