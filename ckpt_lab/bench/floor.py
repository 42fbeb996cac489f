"""What a dispatch mode written in Python costs before it does anything: the floor under the scope.

    python -m ckpt_lab.bench.floor [--rounds 15] [--depth 64]

On the benchmark's dropout chain (``chain-64``: 64 blocks of 8 cheap pointwise ops and a dropout),
torch's non-reentrant checkpoint per block is timed alone, with an *empty* ``TorchDispatchMode``
around its forward, and against ``gradient_checkpoint_scope`` per block. The scope records in such
a mode during the forward, so the empty mode's ratio is the least any scope built this way can
cost there; what the scope costs above it is its own bookkeeping (the benchmark page, "The scope against its
peers"). Paired rounds in a shuffled order, one thread, process time; the median of per-round
ratios to torch's checkpoint is printed. Times only: nothing here is asserted by a test.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_lab.bench.workloads import Workload, chain
from ckpt_lab.strategies import Strategy, by_label


class EmptyMode(TorchDispatchMode):
    """Runs each op as it is: the cost of entering Python once per aten op, and nothing more."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No torch._dynamo.disable wrapper around __torch_dispatch__: the cheapest a Python mode can be.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _step(wl: Workload, strategy: Strategy, mode: bool) -> None:
    """One training step of ``wl`` run by ``strategy``; the forward inside an ``EmptyMode`` if ``mode``."""
    torch.manual_seed(0)
    with EmptyMode() if mode else contextlib.nullcontext():
        out = strategy.run(wl.blocks, wl.input)
    out.sum().backward()
    for p in wl.parameters():
        p.grad = None
    wl.input.grad = None


def runs(wl: Workload) -> dict[str, Callable[[], None]]:
    """The three ways timed, by name; "torch-nr" is the one the others are divided by."""
    torch_nr, scope = by_label("torch non-reentrant"), by_label("ckpt_lab.gradient_checkpoint_scope")
    return {
        "torch-nr": lambda: _step(wl, torch_nr, mode=False),
        "torch-nr + empty mode in forward": lambda: _step(wl, torch_nr, mode=True),
        "scope": lambda: _step(wl, scope, mode=False),
    }


def measure(rounds: int = 15, depth: int = 64) -> dict[str, float]:
    """Median over ``rounds`` of each way's time divided by torch-nr's in the same round."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ways = runs(chain(depth))
        for run in ways.values():
            run()  # warm-up: first calls pay for caches and lazy imports
        ratios: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            order = list(ways)
            random.shuffle(order)
            seconds = {}
            for name in order:
                start = time.process_time()
                ways[name]()
                seconds[name] = time.process_time() - start
            for name in ways:
                ratios[name].append(seconds[name] / seconds["torch-nr"])
    finally:
        torch.set_num_threads(threads)
    return {name: statistics.median(values) for name, values in ratios.items()}


def main(argv: list[str] | None = None) -> None:
    first_line = (__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m ckpt_lab.bench.floor", description=first_line)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--depth", type=int, default=64, help="blocks in the dropout chain (chain-DEPTH)")
    args = parser.parse_args(argv)
    for name, ratio in measure(args.rounds, args.depth).items():
        print(f"{name:34} {ratio:.3f}x torch-nr (chain-{args.depth}, median of {args.rounds} paired rounds)")


if __name__ == "__main__":
    main()
