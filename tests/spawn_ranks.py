"""Run a function in N gloo processes on the CPU and collect each rank's JSON result."""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp

#: a rank stuck in a collective exits after the group's timeout first
GROUP_TIMEOUT_S = 90
JOIN_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        result = fn(rank, world, *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # the result is written: leave without the interpreter's teardown, where a still-joinable
    # C++ thread can abort the process ("terminate called without an active exception")
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, args: tuple, out_dir: Path) -> list[Any]:
    """``fn(rank, world, *args)`` in ``world`` spawned gloo processes; their JSON results.

    ``fn`` must be importable by the spawned processes (a module-level function of a test
    module). A rank that raises or hangs fails the calling test, naming the ranks.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, str(out_dir))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} did not finish within {JOIN_TIMEOUT_S} s (a collective deadlocked)"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"rank exit codes {codes} (a rank raised: see its traceback above)"
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


@contextmanager
def counting_all_reduces() -> Iterator[list[int]]:
    """Count ``torch.distributed.all_reduce`` calls made inside the block: each adds one to the
    last entry of the yielded list (nothing while it is empty), so a caller appends an entry
    per step and reads the counts per step."""
    import torch.distributed as dist

    counts: list[int] = []
    orig = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        if counts:
            counts[-1] += 1
        return orig(*args, **kwargs)
    dist.all_reduce = counting
    try:
        yield counts
    finally:
        dist.all_reduce = orig


@contextmanager
def as_ranks_run() -> Iterator[None]:
    """The block runs on one CPU thread, as every rank does (``_entry``): a CPU GEMM's blocking,
    hence its summation order, follows its thread count on some BLAS builds (MKL on Intel), so
    a one-process reference computed with more threads need not match the ranks bit for bit."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
