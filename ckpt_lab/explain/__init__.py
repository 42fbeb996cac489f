"""``explain``: what a forward keeps for backward, who made it, what each checkpoint changed, and
what stands at the peak.

One call runs one forward and one backward and says, storage by storage, what stayed alive between
them and what was alive at the peak::

    report = ckpt_lab.explain(model, x)          # or explain(fn, x, loss_fn=...)
    print(report.summary())                      # the peak by role, the largest holders, the verdicts
    report.saved                                 # one row per storage kept: op, module, line, region
    report.peak_ledger                           # every storage alive at the peak, by role (.rows, .roles)
    report.plot()                                # live bytes over forward and backward, the peak

or, from a shell, ``python -m ckpt_lab.explain MODULE:FACTORY [--plot out.png] [--table]``.

The parts, in the order a step goes through them: this entry point runs the step under two
dispatch modes (NOTE [ Two modes ]); ``recorder.py`` stamps each storage an op makes with what made
it; ``regions.py`` finds the checkpoint, scope or hooks an op runs in; ``build.py`` turns the
recording into the report of ``report.py``; ``peak.py`` writes the peak's ledger.

NOTE [ Storages, not saved tensors ]
A ``saved_tensors_hooks`` pack hook is blind to everything a checkpoint saves inside its *own*
hooks (only the innermost hooks run). So the report is built from storages: ``LiveMemory`` (the
instrument every notebook measures with) records every storage an aten op creates and frees, and
a dispatch mode of ours, above it, writes down at each storage's birth what made it: the aten op,
the module running (global forward hooks keep a stack of module paths), the caller's source line,
and the *regions* it was made in (NOTE [ Regions ] in ``regions.py``). What is alive when the
forward ends is what the forward kept: ``retained_bytes == sum of report.saved + the loss (+ the
output, if the loss keeps it)``, to the byte, and the same numbers as ``measure_memory``. What is
alive at the peak is the peak: the ledger's rows add up to ``peak_bytes`` (NOTE [ Which peak ] in
``peak.py``).

Blind spots:

* alive is not always needed: a tensor the user keeps (stored on a module, in a list) is listed like
  one autograd saved, under the op that made it;
* memory no aten op makes (``torch.get_rng_state`` snapshots, allocator slack), and tensors made
  before the call (parameters and inputs: listed apart, never counted): ``LiveMemory``'s blind spots;
* a hook-based region opened *inside* a custom Function's forward is listed outside it; which scope
  a replay belongs to is known only through ``ckpt_lab.scope``'s internals (else "unknown region");
* recomputation in backward is found by grad mode (backward runs its nodes with grad off) and by the
  unpack hooks seen in forward: a re-run with grad off outside them counts as ordinary backward work;
* modules outside the function's own module tree (a plain function calling modules) are named by
  class and order of first call (``Sequential.0``); pass a module, or a bound method of one, for
  real paths (``layers.3.linear1``); backward's own work runs in no module: named by its autograd
  node (``MmBackward0``).

NOTE [ The function and the package ]
``ckpt_lab`` exports the function ``explain`` under this package's name, so ``ckpt_lab.explain(...)``
calls it, and ``python -m ckpt_lab.explain`` runs ``__main__.py`` here (a plain module of that name,
imported by ``ckpt_lab`` itself, would run twice under ``-m``). ``import ckpt_lab`` does not import
this package: the name is resolved on first use (``ckpt_lab/__init__.py``). Import the rest from the
package: ``from ckpt_lab.explain import Report``. The models it is shown on live apart, in ``ckpt_lab.cases``
(``from ckpt_lab.cases.examples import stack``): this package is the instrument only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ckpt_lab._aten import tensors_in
from ckpt_lab.explain import regions
from ckpt_lab.explain.build import build_report
from ckpt_lab.explain.peak import PeakLedger, PeakRow
from ckpt_lab.explain.recorder import _Recorder, held, module_hooks, module_names, root_module
from ckpt_lab.explain.report import Held, RegionReport, Report, SavedRow, Span, Timeline
from ckpt_lab.instruments.memory import LiveMemory

__all__ = [
    "Held", "PeakLedger", "PeakRow", "RegionReport", "Report", "SavedRow", "Span", "Timeline", "explain"
]


def explain(
    function: Callable[..., Any], *args: Any, loss_fn: Callable[[Any], Any] | None = None, **kwargs: Any
) -> Report:
    """Run ``function(*args, **kwargs)`` and its backward once; report what the forward kept, and
    what was alive at the peak.

    The loss is ``loss_fn(output)`` (summed if not a scalar), else the sum of the output's tensors.
    Gradients land in ``.grad`` as after any training step; nothing else is left behind.
    """
    _check_callables(function, loss_fn)
    root = root_module(function)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_start = torch.cuda.memory_allocated()
    memory = LiveMemory()
    recorder = _Recorder(memory, module_names(root))
    # All of the root's parameters (MultiheadAttention reads its out_proj's without calling it), and
    # those of any other module that runs.
    for name, p in [] if root is None else root.named_parameters():
        recorder.parameters[id(p)] = held(name, p)
    # NOTE [ Two modes ]
    # LiveMemory is entered first, so it sits below our mode: each op reaches us first, we let it
    # run (through LiveMemory, which gives each new storage its serial), then read the serials back
    # (``serial_of``) and write down who made each storage. Modes entered later (a selective
    # checkpoint's, a scope's) sit above both: we see the ops they run, and their frames.
    with memory, recorder, module_hooks(recorder.modules):
        output = function(*args, **kwargs)
        recorder.stage = "loss"
        output_serials = recorder.serials_of(output)
        loss = _loss(output, loss_fn)
        # Only the graph may keep the output now: alive at the snapshot means the loss keeps it.
        del output
        retained = memory.snapshot("after forward")
        alive = memory.born_in("forward")
        loss_serials = recorder.serials_of(loss)
        forward_events = len(memory.events)
        memory.phase = recorder.stage = "backward"
        loss.backward()
        del loss
        memory.snapshot("after backward")
    cuda_peak = torch.cuda.max_memory_allocated() - cuda_start if cuda else None
    return build_report(
        recorder, retained, alive, output_serials, loss_serials, forward_events, cuda_peak, args, kwargs
    )


# In backward, a caller's line found only beyond this function's frame is the line that called
# explain, not one that made a storage (regions.py).
regions.ENTRY_CODES.add(explain.__code__)


def _loss(output: Any, loss_fn: Callable[[Any], Any] | None) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"explain: loss_fn returned {_described(loss)}; it must return the loss as a tensor "
                "(a scalar, or a tensor explain sums), computed from the output it is given."
            )
    else:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if not tensors:
            raise ValueError("explain: the output has no tensor that requires grad: no backward to run.")
        # Not sum(...): its start value 0 would add one more op (and a storage) to the report.
        loss = tensors[0].sum()
        for t in tensors[1:]:
            loss = loss + t.sum()
    return loss if loss.dim() == 0 else loss.sum()


def _check_callables(function: Any, loss_fn: Any) -> None:
    if not callable(function):
        raise TypeError(f"explain: the function to explain must be callable (a model, a function); got "
                        f"{_described(function)}.")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"explain: loss_fn must be callable (output -> loss) or None; got {_described(loss_fn)}."
        )


def _described(value: Any) -> str:
    """A value in a few words for an error message: "None", "a str ('mse')", "a tuple of 2 items"."""
    if value is None:
        return "None"
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    if isinstance(value, str | int | float | bool):
        return f"{article} {kind} ({value!r:.40})"
    if isinstance(value, tuple | list | dict):
        return f"{article} {kind} of {len(value)} item{'s' * (len(value) != 1)}"
    return f"{article} {kind}"
