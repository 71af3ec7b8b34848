"""The convergence study's worker processes: a hard deadline, a clean stop on SIGTERM, and
throughput measured from what the workers write.

``bench.convergence`` starts each worker as a ``hybridfp train`` process. Here: waiting for them
until a deadline (:func:`run_workers`: SIGTERM, then SIGKILL after a grace), the driver's own
SIGTERM turned into an exception (:class:`Interrupted`) so it can stop its workers and still
write its reports, and the workers' records stamped with their write times (:class:`Progress`:
the probe, ``bench.convergence_probe``, measures from them). Also: the workers' folders cleared
before they start (:func:`clear_worker_dirs`), signals ignored while the driver stops them and writes its reports
(:func:`signals_ignored`), and each worker's predicted and actual seconds (:func:`predict`,
:func:`workers_table`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from bench.convergence_report import split_label

#: Default ``--grace-s``: seconds a worker gets to exit after SIGTERM before SIGKILL.
GRACE_S = 5.0
#: Default ``--poll-s``: seconds between the driver's reads of its workers.
POLL_S = 0.25


class Interrupted(KeyboardInterrupt):
    """The driver received SIGTERM (an outer time-out, a scheduler): stop, report what finished."""


def raise_interrupted(signum: int, frame: object) -> None:
    """A signal handler: raise :class:`Interrupted` naming the signal.

    Parameters
    ----------
    signum : the signal's number (``signal.SIGTERM``).
    frame : the interrupted frame (unused).

    Raises
    ------
    Interrupted : always, with the signal's name (``SIGTERM``) as its argument.
    """
    raise Interrupted(signal.Signals(signum).name)


def interrupt_cause(e: KeyboardInterrupt) -> str:
    """The reason runs cut by an interrupt of the driver fail with.

    Parameters
    ----------
    e : the interrupt: :class:`Interrupted` (a signal, named) or a plain KeyboardInterrupt (SIGINT).

    Returns
    -------
    str : ``the driver was interrupted (SIGNAL)``.

    Example
    -------
    >>> interrupt_cause(Interrupted("SIGTERM")), interrupt_cause(KeyboardInterrupt())
    ('the driver was interrupted (SIGTERM)', 'the driver was interrupted (SIGINT)')
    """
    return f"the driver was interrupted ({e.args[0] if isinstance(e, Interrupted) else 'SIGINT'})"


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGTERM and SIGINT ignored inside the block, the previous handlers restored after it.

    The driver stops its workers and writes its reports once, whatever stopped it: a second
    signal there would leave workers running or a report cut off. Outside the main thread
    (where handlers cannot be set) the block runs unchanged.

    Example
    -------
    >>> with signals_ignored():
    ...     signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    True
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@dataclass(frozen=True)
class WorkerEnd:
    """How a worker ended: its exit code, wall seconds since the workers started, and why the
    driver stopped it (None: it ended on its own)."""

    exit: Optional[int]
    wall_s: float
    stopped: Optional[str] = None


#: Seconds a file's write time may trail ``time.time()``: file systems stamp with a coarse clock.
_CLOCK_SLACK_S = 1.0


class Progress:
    """A worker's ``metrics.jsonl`` read as it grows; each read's last record is stamped with the
    file's modification time, i.e. when the worker wrote it, not when the driver looked.

    A file last written before the :class:`Progress` was made is an earlier study's and is not
    read; a file replaced (another inode), shortened, or rewritten so that the read offset no
    longer follows a line end is read again from its start."""

    def __init__(self, out: Path) -> None:
        self.path, self.offset, self.inode = out / "metrics.jsonl", 0, None
        self.since = time.time() - _CLOCK_SLACK_S
        self.stamps: list[tuple[float, dict]] = []

    def _restarted(self, st: os.stat_result) -> bool:
        if st.st_ino != self.inode or st.st_size < self.offset:
            return True
        with open(self.path, "rb") as f:  # a rewrite longer than the old one: the offset mid-line
            f.seek(self.offset - 1)
            return f.read(1) != b"\n"

    def poll(self) -> None:
        """Read the records written since the last call.

        Raises
        ------
        ValueError : a line that is not JSON, naming the file and the line's byte offset.
        """
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        if st.st_mtime < self.since:
            return  # an earlier study's file: the worker replaces it
        if self.offset and self._restarted(st):
            self.offset = 0
        self.inode = st.st_ino
        if st.st_size <= self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(st.st_size - self.offset)
        end = chunk.rfind(b"\n") + 1  # whole lines only; a partial one is read next time
        recs, at = [], self.offset
        for line in chunk[:end].splitlines(keepends=True):
            if line.strip():
                try:
                    recs.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{self.path}: the line at byte offset {at} is not a JSON record ({e}); "
                                     "is another process writing this file?") from None
            at += len(line)
        self.offset += end
        if recs:
            self.stamps.append((st.st_mtime, recs[-1]))


def stop_workers(jobs: dict[Path, subprocess.Popen], grace_s: float) -> dict[Path, subprocess.Popen]:
    """SIGTERM every live worker, SIGKILL those still alive after ``grace_s``, reap them all;
    SIGTERM and SIGINT of the driver are ignored meanwhile (:func:`signals_ignored`).

    Parameters
    ----------
    jobs : out dir -> worker process.
    grace_s : seconds the workers get to exit after SIGTERM.

    Returns
    -------
    dict : out dir -> process of the workers it signalled (those that had not exited yet).
    """
    with signals_ignored():
        live = {out: p for out, p in jobs.items() if p.poll() is None}
        for p in live.values():
            p.terminate()
        end = time.time() + grace_s
        while time.time() < end and any(p.poll() is None for p in live.values()):
            time.sleep(0.05)
        for p in live.values():
            if p.poll() is None:
                p.kill()
            p.wait()
    return live


def run_workers(jobs: dict[Path, subprocess.Popen], deadline: Optional[float] = None, budget_cause: str = "",
                grace_s: float = GRACE_S, poll_s: float = POLL_S, watch: Optional[dict[Path, Progress]] = None,
                stop: Optional[Callable[[], Optional[str]]] = None) -> tuple[dict[Path, WorkerEnd], Optional[str]]:
    """Wait for every worker until ``deadline`` (``time.time()`` seconds; None: no limit); then stop
    the rest (:func:`stop_workers`) with ``budget_cause`` as the reason. ``stop``, called at every
    check after the progress is read, may end the wait early: the reason it returns is recorded
    for the workers it stops (the probe's window, ``bench.convergence_probe.Window``). A KeyboardInterrupt or
    SIGTERM of the driver (:class:`Interrupted`) stops them the same way; any other error stops
    them and is raised.

    Parameters
    ----------
    jobs : out dir -> worker process.
    deadline : when to stop the workers still running (``time.time()`` seconds; None: no limit).
    budget_cause : the reason recorded for workers stopped at the deadline.
    grace_s : seconds a worker gets after SIGTERM before SIGKILL.
    poll_s : seconds between checks.
    watch : out dir -> :class:`Progress` polled at every check.
    stop : returns a reason to stop the workers still running, or None to go on.

    Returns
    -------
    (out dir -> :class:`WorkerEnd`, the interrupt's cause or None). Only the workers the driver
    signalled have ``stopped`` set; one that exited on its own just before has not.
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
            why = stop() if stop is not None and len(done) < len(jobs) else None
            if why:
                cause = why
                break
            time.sleep(poll_s)
    except KeyboardInterrupt as e:  # Interrupted (SIGTERM) included
        cause = interrupted = interrupt_cause(e)
    except BaseException:  # never leave workers running behind an error
        stop_workers({out: p for out, p in jobs.items() if out not in done}, grace_s)
        raise
    rest = {out: p for out, p in jobs.items() if out not in done}
    if rest:
        print(f"stopping {len(rest)} worker(s): {cause}", flush=True)
        signalled = stop_workers(rest, grace_s)
        done.update({out: WorkerEnd(p.returncode, time.time() - t0, cause if out in signalled else None)
                     for out, p in rest.items()})
    for progress in (watch or {}).values():
        progress.poll()
    return done, interrupted


def clear_worker_dirs(outs: Sequence[Path]) -> None:
    """Remove the workers' folders ``outs`` (an earlier study's files in the same ``--out``): what
    the driver reads there is then this study's alone.

    Example
    -------
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     (Path(d) / "w0").mkdir()
    ...     _ = (Path(d) / "w0" / "metrics.jsonl").write_text("{}\\n")
    ...     clear_worker_dirs([Path(d) / "w0", Path(d) / "w1"])
    ...     (Path(d) / "w0").exists()
    False
    """
    for out in outs:
        if out.exists():
            shutil.rmtree(out)


def predict(group: Sequence[str], cost: dict[str, float], startup: float, tokens: float,
            eval_fraction: float, run_eval_s: Optional[dict[str, float]] = None) -> Optional[float]:
    """A worker's predicted wall seconds: ``startup`` plus, over ``1 - eval_fraction`` (set-up and
    stalls), its runs' probed seconds per token times ``tokens`` and their evaluations'
    seconds (``run_eval_s``: recipe -> seconds of one run's evaluations; missing: 0); None when a
    run's recipe has no probed rate (a fixed comparison's recipe that failed the probe).

    Example
    -------
    >>> predict(["a@seed=0", "b@seed=0"], {"a": 1e-3, "b": 2e-3}, 5.0, 1000, 0.5)
    11.0
    >>> predict(["a@seed=0", "b@seed=0"], {"a": 1e-3, "b": 2e-3}, 5.0, 1000, 0.5, {"a": 1.0})
    13.0
    >>> predict(["a@seed=0", "c@seed=0"], {"a": 1e-3}, 5.0, 1000, 0.5) is None
    True
    """
    per_token = [cost.get(split_label(label)[0]) for label in group]
    if None in per_token:
        return None
    evals = sum((run_eval_s or {}).get(split_label(label)[0], 0.0) for label in group)
    return startup + (sum(per_token) * tokens + evals) / (1 - eval_fraction)


def workers_table(workers: Sequence[dict]) -> str:
    """Markdown: each worker's runs, predicted and actual wall seconds, and how it ended.

    Parameters
    ----------
    workers : per worker ``{"worker", "runs", "predicted_s", "actual_s", "exit", "stopped"}``
        (``report.json``'s ``studies[...]["workers"]``); None seconds print as a dash.

    Returns
    -------
    str : the table with its heading line.

    Example
    -------
    >>> print(workers_table([{"worker": "w0", "runs": 2, "predicted_s": 100.0, "actual_s": 150.0, "exit": 0,
    ...                       "stopped": None}]).splitlines()[-1])
    | w0 | 2 | 100 | 150 | 1.50 | exit 0 |
    """
    def sec(v: Optional[float]) -> str:
        return "—" if v is None else f"{v:.0f}"
    lines = ["Workers, wall seconds from their start (predicted: the plan from the probe's rates):", "",
             "| worker | runs | predicted s | actual s | actual / predicted | ended |", "|---|---:|---:|---:|---:|---|"]
    for w in workers:
        ended = f"stopped: {w['stopped']}" if w["stopped"] else f"exit {w['exit']}"
        ratio = f"{w['actual_s'] / w['predicted_s']:.2f}" if w["predicted_s"] and w["actual_s"] is not None else "—"
        lines.append(f"| {w['worker']} | {w['runs']} | {sec(w['predicted_s'])} | {sec(w['actual_s'])} | {ratio} "
                     f"| {ended} |")
    return "\n".join(lines)


__all__ = ["GRACE_S", "POLL_S", "Interrupted", "Progress", "WorkerEnd", "clear_worker_dirs",
           "interrupt_cause", "predict", "raise_interrupted", "run_workers", "signals_ignored", "stop_workers",
           "workers_table"]
