"""Exercise 05: the knapsack solver, and a selective policy that meets a memory budget (notebook 05).

The learner's file defines:

* ``knapsack(items, capacity)``: ``items`` are ``(key, nbytes, cost)``; return the keys to keep so
  that their bytes fit in ``capacity`` and the cost they save is the largest possible (the 0/1
  knapsack the planner solves, notebook 05 §4). Graded against brute force on small problems, some
  built to catch a greedy solver and a strict ``<``.
* ``make_policy(block)``: a fresh selective-checkpointing policy (torch's signature,
  ``policy(ctx, op, *args, **kwargs)``) for one call of block ``block`` (0, 1, 2) of a stack of three
  feed-forward blocks, each run in ``ckpt_lab.selective_checkpoint``. Graded by measurement over two
  training steps: the bytes alive after the forward (``Tracker``, ``measure_memory``'s number) within
  ``BUDGET``, the FLOPs backward spends recomputing (``ckpt_lab.instruments.op_cost`` summed over the
  ops that run with grad on inside backward) at most ``TARGET_RECOMPUTE``, both steps alike, and
  gradients equal to the stack's without checkpoint, bit for bit.

``BUDGET`` leaves room for four kept 32 KiB tensors beside the block boundaries; the best four
(``ckpt_lab.planner`` finds the same, tests/test_exercises.py checks) recompute ``TARGET_RECOMPUTE``.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_lab import selective_checkpoint
from ckpt_lab.exercises._feedback import Tracker, compare_gradients, listing, size
from ckpt_lab.exercises._grading import Check, Exercise, Submission
from ckpt_lab.instruments import op_cost

BATCH, WIDTH_IN, WIDTH, BLOCKS = 32, 64, 256, 3
BOUNDARY_BYTES = 2 * BATCH * WIDTH_IN * 4  # blocks 0 and 1's outputs, the next blocks' inputs
LOSS_BYTES = 4
BUDGET = BOUNDARY_BYTES + LOSS_BYTES + 4 * BATCH * WIDTH * 4  # 147,460 B
TARGET_RECOMPUTE = 2_146_304  # FLOPs: the best plan's (4 kept tensors: 3 x addmm 2, 1 x addmm 1)


def make_block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH_IN, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, WIDTH_IN))  # fmt: skip


def _stack() -> tuple[list[nn.Sequential], torch.Tensor]:
    torch.manual_seed(0)
    blocks = [make_block() for _ in range(BLOCKS)]
    return blocks, torch.randn(BATCH, WIDTH_IN, generator=torch.Generator().manual_seed(1)).requires_grad_()


# ------------------------------------------------------------------------------------------- knapsack
Item = tuple[Any, int, float]


def _problems() -> list[tuple[str, list[Item], int]]:
    """(what it is, items, capacity): a few built by hand, then random ones (keys are not positions)."""
    problems = [
        ("a greedy solver's trap", [("a", 6, 30), ("b", 5, 20), ("c", 5, 20)], 10),
        ("an exact fit", [("x", 4, 10), ("y", 3, 7), ("z", 3, 7)], 10),
        ("a free item", [("free", 0, 5), ("big", 11, 100)], 10),
        ("nothing to choose", [], 10),
        ("no room", [("free", 0, 1), ("one", 1, 9)], 0),
    ]
    rng = random.Random(0)
    for k in range(12):
        items = [((k, f"op{i}"), rng.randint(1, 20), rng.randint(1, 50)) for i in range(rng.randint(4, 9))]
        problems.append((f"random problem {k + 1}", items, rng.randint(5, 60)))
    return problems


def best_choice(items: Sequence[Item], capacity: int) -> tuple[float, int]:
    """(cost saved, bytes) of the best subset, by brute force (ties: the fewest bytes)."""
    best = (0.0, 0)
    for r in range(len(items) + 1):
        for subset in itertools.combinations(items, r):
            nbytes, cost = sum(i[1] for i in subset), sum(i[2] for i in subset)
            if nbytes <= capacity and (cost, -nbytes) > (best[0], -best[1]):
                best = (cost, nbytes)
    return best


def greedy_cost(items: Sequence[Item], capacity: int) -> float:
    """What the best-cost-per-byte-first heuristic saves (to recognise it)."""
    left, saved = capacity, 0.0
    for _, nbytes, cost in sorted(items, key=lambda i: -i[2] / i[1] if i[1] else -math.inf):
        if nbytes <= left:
            left, saved = left - nbytes, saved + cost
    return saved


def _choices(sub: Submission) -> list[tuple[str, list[Item], int, Any]]:
    return sub.once(
        "knapsack",
        lambda: [
            (what, items, capacity, sub.knapsack(list(items), capacity))
            for what, items, capacity in _problems()
        ],
    )


def _describe(items: Sequence[Item], capacity: int) -> str:
    return f"items {[(k, b, c) for k, b, c in items]}, capacity {capacity}"


def check_knapsack_keys(sub: Submission) -> None:
    for what, items, capacity, chosen in _choices(sub):
        keys = [k for k, _, _ in items]
        assert isinstance(chosen, set | frozenset | list | tuple), (
            f"{what}: knapsack returned {type(chosen).__name__}; return the keys to keep (a set)."
        )
        stray = [c for c in chosen if c not in keys]
        assert not stray, (
            f"{what} ({_describe(items, capacity)}): knapsack returned {sorted(map(repr, stray))}, which are "
            "not keys of the items. Return the items' keys (their first element), not their positions."
        )
        assert len(set(chosen)) == len(list(chosen)), f"{what}: knapsack returned a key twice: {list(chosen)}"


def check_knapsack_fits(sub: Submission) -> None:
    for what, items, capacity, chosen in _choices(sub):
        nbytes = sum(b for k, b, _ in items if k in set(chosen))
        assert nbytes <= capacity, (
            f"{what} ({_describe(items, capacity)}): your choice {sorted(map(repr, chosen))} takes {nbytes} "
            "bytes, more than the capacity."
        )


def check_knapsack_optimal(sub: Submission) -> None:
    said = []
    for what, items, capacity, chosen in _choices(sub):
        kept = [i for i in items if i[0] in set(chosen)]
        cost, nbytes = sum(i[2] for i in kept), sum(i[1] for i in kept)
        best_cost, best_bytes = best_choice(items, capacity)
        if cost < best_cost:
            hint = ""
            greedy = cost == greedy_cost(items, capacity)
            # Both can explain one case: the best fills the capacity exactly, and greedy misses it too.
            strict = best_bytes == capacity and cost == best_choice(items, capacity - 1)[0]
            if greedy and strict:
                hint = (" (yours is both the best below the capacity, `<` for `<=`?, and what the best cost "
                        "per byte first gives, greedy?)")
            elif greedy:
                hint = " (what the best cost per byte first gives: greedy, not exact; a dynamic program is)"
            elif strict:
                hint = " (the best fills the capacity exactly, yours the best below it: `<` for `<=`?)"
            said.append(
                f"{what} ({_describe(items, capacity)}): your choice saves {cost:g} using {nbytes} bytes; "
                f"the best saves {best_cost:g} using {best_bytes}{hint}"
            )
    assert not said, "\n".join(said[:4]) + (f"\n... and {len(said) - 4} more" if len(said) > 4 else "")


# ------------------------------------------------------------------------------------------- the policy
class _RecomputeCost(TorchDispatchMode):
    """FLOPs of the ops backward runs with grad on: the recomputation (backward's own run with grad off)."""

    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self.tracker, self.total, self.by_op = tracker, 0, {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled():
            cost = op_cost(func, args, kwargs, out)
            if cost:
                self.total += cost
                where = self.tracker.modules[-1] if self.tracker.modules else ""
                key = f"{func.overloadpacket.__name__} in {where}" if where else func.overloadpacket.__name__
                self.by_op[key] = self.by_op.get(key, 0) + cost
        return out


def _step(sub: Submission, blocks: list[nn.Sequential], x: torch.Tensor) -> dict[str, Any]:
    """One training step: bytes alive after the forward, what the policy kept, FLOPs recomputed."""
    with Tracker(sub) as tracker:
        for i, block in enumerate(blocks):
            tracker.watch(block, f"blocks.{i}")
        h, boundaries = x, []
        for i, block in enumerate(blocks):
            h = selective_checkpoint(block, h, policy=sub.make_policy(i))
            boundaries.append(h)
        loss = h.sum()  # keeps nothing of h: alive after the forward are the boundaries, the loss, the kept
        del h, boundaries[-1]
        retained = tracker.snapshot()
        kept = tracker.alive("forward", exclude=[*boundaries, loss])
        tracker.phase = "backward"
        with _RecomputeCost(tracker) as recompute:
            loss.backward()
    return {"retained": retained, "kept": kept, "recompute": recompute.total, "by_op": recompute.by_op}


def _two_steps(sub: Submission) -> tuple[list[dict[str, Any]], list[tuple[str, Any, Any]]]:
    """Two training steps with the learner's policies (measured once per grading), and the gradients
    of the first with those of the stack without checkpoint: (name, got, expected)."""
    return sub.once("two steps", lambda: _measure_two_steps(sub))


def _measure_two_steps(sub: Submission) -> tuple[list[dict[str, Any]], list[tuple[str, Any, Any]]]:
    blocks, x = _stack()
    leaves = [
        ("x", x),
        *((f"blocks.{i}.{n}", p) for i, b in enumerate(blocks) for n, p in b.named_parameters()),
    ]
    h = x
    for block in blocks:
        h = block(h)
    h.sum().backward()
    expected = [t.grad.clone() for _, t in leaves]
    for _, t in leaves:
        t.grad = None
    steps = [_step(sub, blocks, x)]
    got = [t.grad for _, t in leaves]
    for _, t in leaves:
        t.grad = None
    steps.append(_step(sub, blocks, x))
    return steps, [(n, g, e) for (n, _), g, e in zip(leaves, got, expected, strict=True)]


def check_policy_gradients(sub: Submission) -> None:
    _, named = _two_steps(sub)
    said = compare_gradients(named)
    assert not said, "Gradients differ from the stack's without checkpoint:\n" + "\n".join(
        f"- {s}" for s in said[:3]
    )


def check_policy_steady(sub: Submission) -> None:
    steps, _ = _two_steps(sub)
    first, second = (sorted((b.op, b.module, b.nbytes) for b in s["kept"]) for s in steps)
    assert first == second, (
        f"Your policies kept {size(sum(b.nbytes for b in steps[0]['kept']))} in the first training step and "
        f"{size(sum(b.nbytes for b in steps[1]['kept']))} in the second. The first step kept:\n"
        f"{listing(steps[0]['kept'])}\nthe second:\n{listing(steps[1]['kept'])}\nA decision must not depend "
        "on calls before this one: keep any counter inside make_policy, which is called once per "
        "checkpointed call (notebook 07 §6)."
    )


def check_policy_budget(sub: Submission) -> None:
    steps, _ = _two_steps(sub)
    step = steps[0]
    if step["retained"] <= BUDGET:
        return
    running, first_over = BOUNDARY_BYTES + LOSS_BYTES, None
    for b in step["kept"]:
        running += b.nbytes
        if running > BUDGET and first_over is None:
            first_over = b
    said = (
        f"After the forward, {size(step['retained'])} are alive; the budget is {size(BUDGET)}: the block "
        f"boundaries ({size(BOUNDARY_BYTES)}), the loss ({LOSS_BYTES} B) and what your policies keep, "
        f"{size(sum(b.nbytes for b in step['kept']))}:\n{listing(step['kept'], limit=6)}"
    )
    if first_over is not None:
        said += f"\nThe first one over the budget: {first_over.describe()}"
    raise AssertionError(
        said + "\n(A kept block output is the next block's input, alive anyway, except in the last block.)"
    )


def check_policy_recompute(sub: Submission) -> None:
    steps, _ = _two_steps(sub)
    step = steps[0]
    largest = sorted(step["by_op"].items(), key=lambda kv: -kv[1])[:3]
    assert step["recompute"] <= TARGET_RECOMPUTE, (
        f"Backward recomputes {step['recompute']:,} FLOPs (ckpt_lab.instruments.op_cost: 2·m·k·n per matmul, "
        f"one per element otherwise); the target is at most {TARGET_RECOMPUTE:,}. The most expensive "
        "recomputed:\n"
        + "\n".join(f"  {name}: {cost:,} FLOPs" for name, cost in largest)
        + "\nWithin the budget, keep what saves the most FLOPs per byte: a knapsack (notebook 05 §4)."
    )


def checks() -> list[Check]:
    return [
        Check("knapsack-keys", "knapsack returns keys of the items, each once", check_knapsack_keys),
        Check("knapsack-fits", "knapsack's choice fits the capacity", check_knapsack_fits,
              needs=("knapsack-keys",)),
        Check("knapsack-optimal", "knapsack's choice saves the most (brute force)", check_knapsack_optimal,
              needs=("knapsack-fits",)),
        Check("policy-gradients", "selective_checkpoint with your policies: gradients bit for bit",
              check_policy_gradients),
        Check("policy-steady", "two training steps keep the same tensors", check_policy_steady,
              needs=("policy-gradients",)),
        Check("policy-budget", f"at most {BUDGET:,} B alive after the forward", check_policy_budget,
              needs=("policy-gradients",)),
        Check("policy-recompute", f"at most {TARGET_RECOMPUTE:,} FLOPs recomputed in backward",
              check_policy_recompute, needs=("policy-gradients",)),
    ]  # fmt: skip


EXERCISE = Exercise(
    name="05-selective-budget",
    notebook="05",
    section="§2.2 and §4",
    defines="knapsack(items, capacity), make_policy(block)",
    grades=f"the knapsack against brute force; a per-block policy: at most {BUDGET:,} B kept and "
    f"{TARGET_RECOMPUTE:,} FLOPs recomputed (measured), the same each step, gradients bit for bit",
    required=("knapsack", "make_policy"),
    checks=checks,
    # the planner solves the same knapsack
    refuses=("ckpt_lab.planner", "ckpt_lab.peak_planner"),
)
