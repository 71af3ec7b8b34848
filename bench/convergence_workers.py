"""The convergence study's worker processes: a hard deadline, a clean stop on SIGTERM, and
throughput measured from what the workers write.

``bench.convergence`` starts each worker as a ``hybridfp train`` process. Here: waiting for them
until a deadline (:func:`run_workers`: SIGTERM, then SIGKILL after a grace), the driver's own
SIGTERM turned into an exception (:class:`Interrupted`) so it can stop its workers and still
write its reports, and the probe's rates as tokens per *wall* second while every worker trains
(:class:`Progress` stamps the records of a worker's ``metrics.jsonl`` with the file's write
time; :func:`achieved_rates`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

#: Default ``--grace-s``: seconds a worker gets to exit after SIGTERM before SIGKILL.
GRACE_S = 5.0
#: Default ``--poll-s``: seconds between the driver's reads of its workers.
POLL_S = 0.25


class Interrupted(KeyboardInterrupt):
    """The driver received SIGTERM (an outer time-out, a scheduler): stop, report what finished."""


def raise_interrupted(signum: int, frame: object) -> None:
    """A signal handler: raise :class:`Interrupted` naming the signal."""
    raise Interrupted(signal.Signals(signum).name)


def interrupt_cause(e: KeyboardInterrupt) -> str:
    """The reason runs cut by an interrupt of the driver fail with."""
    return f"the driver was interrupted ({e.args[0] if isinstance(e, Interrupted) else 'SIGINT'})"


@dataclass(frozen=True)
class WorkerEnd:
    """How a worker ended: its exit code, wall seconds since the workers started, and why the
    driver stopped it (None: it ended on its own)."""

    exit: Optional[int]
    wall_s: float
    stopped: Optional[str] = None


class Progress:
    """A worker's ``metrics.jsonl`` read as it grows; each read's last record is stamped with the
    file's modification time, i.e. when the worker wrote it, not when the driver looked."""

    def __init__(self, out: Path) -> None:
        self.path, self.offset = out / "metrics.jsonl", 0
        self.stamps: list[tuple[float, dict]] = []

    def poll(self) -> None:
        """Read the records written since the last call."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        if st.st_size <= self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(st.st_size - self.offset)
        end = chunk.rfind(b"\n") + 1  # whole lines only; a partial one is read next time
        self.offset += end
        recs = [json.loads(line) for line in chunk[:end].decode().splitlines() if line.strip()]
        if recs:
            self.stamps.append((st.st_mtime, recs[-1]))


def stop_workers(jobs: dict[Path, subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every live worker, SIGKILL those still alive after ``grace_s``, reap them all."""
    live = [p for p in jobs.values() if p.poll() is None]
    for p in live:
        p.terminate()
    end = time.time() + grace_s
    while time.time() < end and any(p.poll() is None for p in live):
        time.sleep(0.05)
    for p in live:
        if p.poll() is None:
            p.kill()
        p.wait()


def run_workers(jobs: dict[Path, subprocess.Popen], deadline: Optional[float] = None, budget_cause: str = "",
                grace_s: float = GRACE_S, poll_s: float = POLL_S, watch: Optional[dict[Path, Progress]] = None
                ) -> tuple[dict[Path, WorkerEnd], Optional[str]]:
    """Wait for every worker until ``deadline`` (``time.time()`` seconds; None: no limit); then stop
    the rest (:func:`stop_workers`) with ``budget_cause`` as the reason. A KeyboardInterrupt or
    SIGTERM of the driver (:class:`Interrupted`) stops them the same way.

    Returns
    -------
    (out dir -> :class:`WorkerEnd`, the interrupt's cause or None).
    """
    t0, done = time.time(), {}
    cause, interrupted = budget_cause, None
    try:
        while len(done) < len(jobs):
            for out, proc in jobs.items():
                if out not in done and proc.poll() is not None:
                    done[out] = WorkerEnd(proc.returncode, time.time() - t0)
            for progress in (watch or {}).values():
                progress.poll()
            if len(done) < len(jobs) and deadline is not None and time.time() >= deadline:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt as e:  # Interrupted (SIGTERM) included
        cause = interrupted = interrupt_cause(e)
    rest = {out: p for out, p in jobs.items() if out not in done}
    if rest:
        print(f"stopping {len(rest)} worker(s): {cause}", flush=True)
        stop_workers(rest, grace_s)
        done.update({out: WorkerEnd(p.returncode, time.time() - t0, cause) for out, p in rest.items()})
    for progress in (watch or {}).values():
        progress.poll()
    return done, interrupted


def achieved_rates(stamps: dict[str, list[tuple[float, dict]]], tokens_per_step: dict[str, int],
                   finished: Sequence[str]) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, str]], float]:
    """Tokens per wall second of every probed recipe, measured while every worker trains.

    The window runs from the moment the last worker wrote its first training step to the moment
    the first of the ``finished`` workers (those that exited cleanly) wrote its last. A run's
    rate is the steps it completed between its first and last stamped record in the window,
    times ``tokens_per_step``, over the seconds between them: evaluations, host stalls and the
    sharing of the GPU are in it, unlike the trainer's per-step ``tokens_per_s``. A run with
    fewer than two stamps in the window is timed over all of its own (basis ``alone``: less
    sharing, so optimistic; the plan says so). A recipe probed on several workers keeps its
    slowest rate.

    Parameters
    ----------
    stamps : worker (``COMPARISON/wK``) -> (write time, record) as :class:`Progress` stamps them.
    tokens_per_step : comparison -> tokens of one training step.
    finished : the workers that exited cleanly (the others do not close the window).

    Returns
    -------
    (comparison -> recipe -> tokens/s, comparison -> recipe -> basis, the window's seconds).

    Example
    -------
    >>> rec = lambda step, recipe: {"step": step, "recipe": recipe, "tokens_per_s": 1e9}
    >>> s = {"d/w0": [(0.0, rec(1, "a")), (1.0, rec(3, "a")), (2.0, rec(5, "a")), (4.0, rec(9, "a"))],
    ...      "d/w1": [(1.0, rec(1, "b")), (2.0, rec(2, "b")), (3.0, rec(3, "b"))]}
    >>> rates, basis, window = achieved_rates(s, {"d": 100}, ["d/w0", "d/w1"])
    >>> rates, basis["d"]["a"], window
    ({'d': {'a': 200.0, 'b': 100.0}}, 'all workers training', 2.0)
    """
    train = {w: [(t, r) for t, r in pts if "tokens_per_s" in r] for w, pts in stamps.items()}
    train = {w: pts for w, pts in train.items() if pts}
    lo = max((pts[0][0] for pts in train.values()), default=0.0)
    hi = min((pts[-1][0] for w, pts in train.items() if w in finished),
             default=max((pts[-1][0] for pts in train.values()), default=0.0))
    rates: dict[str, dict[str, float]] = {}
    basis: dict[str, dict[str, str]] = {}
    for w, pts in train.items():
        cmp = w.split("/")[0]
        for label in dict.fromkeys(r["recipe"] for _, r in pts):
            own = [(t, r["step"]) for t, r in pts if r["recipe"] == label]
            inside, how = [(t, s) for t, s in own if lo <= t <= hi], "all workers training"
            if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
                inside, how = own, "alone"
            if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
                continue  # too fast to time between two reads: the caller says what it uses instead
            rate = (inside[-1][1] - inside[0][1]) * tokens_per_step[cmp] / (inside[-1][0] - inside[0][0])
            recipe = label.rpartition("@seed=")[0] or label
            if rate < rates.setdefault(cmp, {}).get(recipe, float("inf")):
                rates[cmp][recipe] = rate
                basis.setdefault(cmp, {})[recipe] = how
    return rates, basis, max(0.0, hi - lo)


__all__ = ["GRACE_S", "POLL_S", "Interrupted", "Progress", "WorkerEnd", "achieved_rates", "interrupt_cause",
           "raise_interrupted", "run_workers", "stop_workers"]
