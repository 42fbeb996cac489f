"""Run a function in several processes joined in a gloo process group, from a script or a notebook.

* ``run_workers(fn, world_size=2, timeout=60, **kwargs)``: starts ``world_size`` processes on this
  machine, puts each in a gloo process group, runs ``fn(rank, world_size, **kwargs)`` in each and
  returns the results in rank order. ``fn`` must be importable (defined at module level in a module,
  never in a notebook cell or as a lambda).
* ``WorkerError``: what ``run_workers`` raises when a worker raises or dies, with the worker's
  traceback; a run that outlives ``timeout`` kills every worker and raises ``TimeoutError``.
* ``free_port()``: a TCP port for the group's rendezvous.

The parent's side comes first (``run_workers``, how workers start, what they reported, how they are
stopped), then the worker's side (``_worker_main``: join the group, run ``fn``, report). The module
knows nothing of what the workers do; notebook 06's workers live in ``ckpt_lab.distributed``.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue as queue_module
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["WorkerError", "free_port", "run_workers"]


def run_workers(
    fn: Callable[..., Any],
    world_size: int = 2,
    timeout: float = 60.0,
    *,
    start_method: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` in ``world_size`` processes joined in a gloo group.

    Returns the ``world_size`` results in rank order (each must be picklable: keep them small).
    Raises ``WorkerError`` (with the worker's traceback) if a worker raises or dies, after stopping
    the others, and ``TimeoutError`` if the run takes longer than ``timeout`` seconds, after killing
    every worker. Workers are quiet: their stdout and stderr are captured, and shown only in a
    ``WorkerError``. The first call also starts the fork server (a few seconds of ``import torch``),
    which counts towards its ``timeout``.
    """
    name = getattr(fn, "__qualname__", repr(fn))
    if getattr(fn, "__module__", "__main__") == "__main__" or "<" in name:
        # Pickling would fail inside Process.start with an obscure message; say what to do instead.
        raise ValueError(
            f"run_workers: {name} must be importable by its module and name, so that a new process can "
            "find it; define it at module level in a .py file (not in a notebook, not a lambda)."
        )
    ctx = _context(start_method, preload=fn.__module__)
    results_queue = ctx.Queue()
    port = free_port()
    workers = [
        ctx.Process(
            target=_worker_main,
            args=(fn, rank, world_size, port, timeout, results_queue, kwargs),
            name=f"ckpt_lab-rank{rank}",
            # Daemons die with the parent, so an interrupted notebook leaves no orphans behind.
            daemon=True,
        )
        for rank in range(world_size)
    ]
    inbox = _Inbox(results_queue, workers)
    deadline = time.monotonic() + timeout
    started = []
    try:
        for worker in workers:
            worker.start()
            started.append(worker)
        while inbox.pending() and not inbox.failures:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"run_workers: {name} did not finish within {timeout:g} s: rank(s) {inbox.pending()} "
                    f"had not reported. All {world_size} workers were killed."
                )
            inbox.poll(wait=0.05)
        if inbox.failures:
            # One rank failed; the others may be blocked in a collective, waiting for it forever. Give
            # them a moment to report how they fared (often: a broken connection), then stop them.
            grace = time.monotonic() + 1.0
            while inbox.pending() and time.monotonic() < grace:
                inbox.poll(wait=0.05)
    finally:
        _stop(started)
        results_queue.close()
    if inbox.failures:
        raise WorkerError(name, inbox.failures, inbox.cause())
    return [inbox.results[rank] for rank in range(world_size)]


class WorkerError(RuntimeError):
    """A worker raised or died. ``rank``: the failure reported first, most likely the cause (when one
    rank fails, its peers' collectives fail next); ``worker_traceback``: that rank's traceback (and
    captured output), or what is known of its death; ``failures``: a one-line summary per failed
    rank (``"ValueError: ..."``), in order of arrival."""

    def __init__(self, fn_name: str, failures: dict[int, tuple[str, str]], cause: int) -> None:
        self.rank = cause
        self.worker_traceback = failures[cause][1]
        self.failures = {rank: summary for rank, (summary, _) in failures.items()}
        others = [rank for rank in failures if rank != cause]
        also = f" (then rank(s) {others} failed too)" if others else ""
        details = "".join(f"\n  rank {rank}: {line}" for rank, line in self.failures.items() if rank != cause)
        super().__init__(
            f"run_workers: {fn_name} failed on rank {cause}: {self.failures[cause]}{also}\n"
            f"All workers were stopped. Traceback of rank {cause}:\n{self.worker_traceback}"
            + (f"\nThe other failures:{details}" if details else "")
        )


def free_port() -> int:
    """A TCP port that was free a moment ago: bind to port 0 and let the OS choose.

    Racy in principle (another program could take it before the workers do), but the workers bind
    it within a second, and on a laptop or CI machine nothing else is hunting for ports.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ==================================================================================== the parent's side
def _context(start_method: str | None, preload: str) -> Any:
    """The multiprocessing context workers start from; ``preload``: the module of the workers' ``fn``.

    Default: ``forkserver`` where the OS has it, else ``spawn``. Both work from Jupyter, because a
    worker never inherits the notebook's state: it finds ``fn`` by module and name. ``spawn`` starts a
    fresh interpreter per worker, and each pays for ``import torch`` (about 5 s per process here,
    10 s for two on two cores). ``forkserver`` pays that once: a server process imports torch, this
    module and ``preload``, then forks each worker from that clean, single-threaded state in
    milliseconds. Plain ``fork`` would copy the notebook's process, threads and all, which torch does
    not support.
    """
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Only takes effect when the server starts (first use); later calls change nothing, and their
        # workers import their own fn's module after the fork.
        # torch._dynamo: torch imports it lazily on the first optimizer step (2 s here), once per
        # worker unless the server has it already.
        ctx.set_forkserver_preload([__name__, preload, "torch._dynamo"])
    return ctx


class _Inbox:
    """What the workers reported so far: results by rank, failures in order of arrival."""

    def __init__(self, results_queue: Any, workers: list[Any]) -> None:
        self.queue = results_queue
        self.workers = workers
        self.results: dict[int, Any] = {}
        self.failures: dict[int, tuple[str, str]] = {}  # rank -> (summary, traceback)
        self.silent: list[int] = []  # ranks that died without a word

    def pending(self) -> list[int]:
        return [r for r in range(len(self.workers)) if r not in self.results and r not in self.failures]

    def poll(self, wait: float) -> None:
        """Take the messages waiting (up to ``wait`` s for the first); if none came, look for the dead."""
        if not self._read(wait):
            self._find_dead()

    def _read(self, wait: float) -> bool:
        got = False
        while True:
            try:
                # Wait only for the first message; then take what is already there and return.
                rank, ok, payload = self.queue.get(timeout=wait if not got else 0.0)
            except queue_module.Empty:
                return got
            got = True
            if ok:
                self.results[rank] = pickle.loads(payload)
            else:
                self.failures[rank] = payload

    def _find_dead(self) -> None:
        """A worker that exited without reporting (killed, segfault, ``os._exit``) has failed too."""
        for rank in self.pending():
            worker = self.workers[rank]
            if worker.is_alive():
                continue
            # Its message may still be in the pipe: one last look before declaring it lost.
            self._read(0.5)
            if rank in self.pending():
                death = f"the worker process exited with code {worker.exitcode} without reporting"
                self.failures[rank] = (death, death)
                self.silent.append(rank)

    def cause(self) -> int:
        # A silent death comes first: its peers only learn of it when their connections break.
        return self.silent[0] if self.silent else next(iter(self.failures))


def _stop(workers: list[Any]) -> None:
    """End every worker still running: SIGTERM, a short grace, then SIGKILL; reap them all."""
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(timeout=2.0)
        if worker.is_alive():
            worker.kill()
            worker.join()


# ==================================================================================== the worker's side
def _worker_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    results_queue: Any,
    kwargs: dict[str, Any],
) -> None:
    """One worker: join the group, run ``fn``, leave the group, report (result or traceback)."""
    # Everything inherited from the fork server (torch, sympy, ...) is long-lived: keep the garbage
    # collector from scanning it again and again (measure_memory collects at every snapshot).
    gc.freeze()
    message = None
    reported = False
    with _captured_output() as capture:
        try:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(port)
            loopback = _loopback_interface()
            if loopback is not None:
                # Gloo otherwise picks its network device by resolving the hostname, which on some
                # machines (VPNs, containers, odd /etc/hosts) fails or names an unreachable address.
                # All ranks are on this machine: the loopback device always works.
                os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
            # The workers share this machine's cores: with torch's default (one intra-op thread per
            # core, in every worker) they would oversubscribe them and slow each other down.
            torch.set_num_threads(1)
            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                # A backstop for a worker whose parent is gone: the parent's own deadline comes first.
                timeout=timedelta(seconds=timeout + 30),
            )
            try:
                # Pickled here with plain pickle: tensors travel as bytes, not as shared memory that
                # would vanish when this process exits.
                message = (rank, True, pickle.dumps(fn(rank, world_size, **kwargs)))
            except BaseException:
                # Report before leaving the group: leaving breaks the peers' connections, so their
                # collectives fail next, and the parent should hear of the cause first.
                results_queue.put(_failure(rank, capture))
                reported = True
                raise
            finally:
                dist.destroy_process_group()
        except BaseException:
            if not reported:
                message = _failure(rank, capture)
    if message is not None:
        results_queue.put(message)
    # Wait until the message is in the pipe before the process ends.
    results_queue.close()
    results_queue.join_thread()


def _loopback_interface() -> str | None:
    """The loopback network interface's name (``lo`` on Linux, ``lo0`` on macOS), if there is one."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


@contextmanager
def _captured_output() -> Iterator[Any]:
    """Point this process's file descriptors 1 and 2 at a temporary file (C++ and Python output alike).

    Workers inherit the notebook kernel's descriptors, and Jupyter shows whatever arrives there in the
    cell's output: torch's warnings, gloo's messages. Captured, they can't make a notebook's output
    differ from run to run, and a ``WorkerError`` can still show them.
    """
    capture = tempfile.TemporaryFile(mode="w+b")
    # Python's buffers first, so that what was printed before goes where it was meant to go.
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(capture.fileno(), 1)
    os.dup2(capture.fileno(), 2)
    try:
        yield capture
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        capture.close()


def _failure(rank: int, capture: Any, limit: int = 4000) -> tuple[int, bool, tuple[str, str]]:
    """The message reporting the exception being handled: its first line ("ValueError: ..."), and
    its traceback followed by the tail of the worker's captured output."""
    error = sys.exc_info()[1]
    summary = traceback.format_exception_only(type(error), error)[0].strip().splitlines()[0]
    text = traceback.format_exc()
    # What the worker printed may still sit in Python's buffers, not yet in the captured file.
    sys.stdout.flush()
    sys.stderr.flush()
    capture.seek(0)
    output = capture.read().decode(errors="replace")[-limit:]
    if output.strip():
        text += f"\n--- output of rank {rank} ---\n{output}"
    return (rank, False, (summary, text))
