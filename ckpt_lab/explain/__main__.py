"""``python -m ckpt_lab.explain MODULE:FACTORY [--plot out.png] [--table] [--peak]``

Imports ``MODULE``, calls ``FACTORY()`` for ``(model, inputs)``, ``(model, inputs, loss_fn)`` or
``(model, inputs, loss_fn, kwargs)`` (``inputs``: a tensor or a tuple of arguments; ``kwargs``:
keyword arguments, e.g. ``{"labels": ids}``), explains one training step of the model, prints the
summary and writes the plot (by default to ``results/explain-FACTORY.png``; ``results/`` is ignored
by git). Try ``ckpt_lab.cases.examples:transformer_per_layer``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from pathlib import Path
from typing import Any

import torch

from ckpt_lab.explain import _described, explain

EXPECTED = "(model, inputs[, loss_fn[, kwargs]])"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ckpt_lab.explain", description=__doc__.split("\n\n")[1])
    parser.add_argument("target", help="MODULE:FACTORY, e.g. ckpt_lab.cases.examples:transformer_per_layer")
    parser.add_argument("--plot", type=Path, help="the plot's file (default: results/explain-FACTORY.png)")
    parser.add_argument("--table", action="store_true", help="also list every kept storage and the peak's")
    parser.add_argument("--peak", action="store_true", help="also list every storage alive at the peak")
    args = parser.parse_args(argv)
    try:
        model, inputs, loss_fn, kwargs = load(args.target)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    report = explain(model, *inputs, loss_fn=loss_fn, **kwargs)
    print(report.summary())
    if args.table:
        print(report.table())
    elif args.peak:
        print(report.peak_ledger.table())
    # Imported here: the summary needs no matplotlib. Agg: no display needed.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = args.plot or Path("results") / f"explain-{args.target.partition(':')[2]}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    report.plot(ax)
    ax.set_title(f"{args.target}: live memory over one step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def load(target: str) -> tuple[Any, tuple, Any, dict]:
    """Import ``MODULE:FACTORY``, call the factory, and check what it returned: ``(model, inputs,
    loss_fn, kwargs)``, ``inputs`` as a tuple of arguments. Errors say what came back instead."""
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise ValueError(f"give the factory as MODULE:FACTORY, not {target!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, factory_name):
        raise ValueError(f"{target}: module {module_name} has no {factory_name!r}")
    factory = getattr(module, factory_name)
    if not callable(factory):
        raise TypeError(f"{target}: {factory_name} is {_described(factory)}, not a function; it must be a "
                        f"function that returns {EXPECTED}")
    made = factory()
    said = f"{target}: {factory_name}() returned"
    if inspect.isgenerator(made):
        raise TypeError(f"{said} a generator (a function with `yield`); return the tuple {EXPECTED} instead")
    if isinstance(made, torch.nn.Module):
        raise TypeError(f"{said} {_described(made)}, a model alone; it must return a tuple {EXPECTED}: "
                        "the model and its inputs at least")
    if not isinstance(made, tuple | list):
        raise TypeError(f"{said} {_described(made)}; it must return a tuple {EXPECTED}")
    if not 2 <= len(made) <= 4:
        raise TypeError(f"{said} {_described(made)}; it must return 2 to 4 of them: {EXPECTED}")
    model, inputs, loss_fn, kwargs = (*made, None, None)[:4]
    if not callable(model):
        raise TypeError(f"{said} {_described(model)} as the model; it must be callable (a module)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{said} {_described(loss_fn)} as loss_fn; it must be callable or None")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"{said} {_described(kwargs)} as kwargs; it must be a dict of keyword arguments")
    return model, inputs if isinstance(inputs, tuple) else (inputs,), loss_fn, kwargs or {}


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
