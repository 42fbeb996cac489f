"""``python -m ckpt_lab.explain MODULE:FACTORY [--plot out.png] [--table]``

Imports ``MODULE``, calls ``FACTORY()`` for ``(model, inputs)``, ``(model, inputs, loss_fn)`` or
``(model, inputs, loss_fn, kwargs)`` (``inputs``: a tensor or a tuple of arguments; ``kwargs``:
keyword arguments, e.g. ``{"labels": ids}``), explains one training step of the model, prints the
summary and writes the plot (by default to ``results/explain-FACTORY.png``; ``results/`` is ignored
by git). Try ``ckpt_lab.explain.examples:transformer_per_layer``.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch

from ckpt_lab.explain import explain


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ckpt_lab.explain", description=__doc__.split("\n\n")[1])
    parser.add_argument("target", help="MODULE:FACTORY, e.g. ckpt_lab.explain.examples:transformer_per_layer")
    parser.add_argument("--plot", type=Path, help="the plot's file (default: results/explain-FACTORY.png)")
    parser.add_argument("--table", action="store_true", help="also list every kept storage")
    args = parser.parse_args(argv)
    module_name, _, factory_name = args.target.partition(":")
    if not factory_name:
        parser.error("give the factory as MODULE:FACTORY")
    made = getattr(importlib.import_module(module_name), factory_name)()
    model, inputs, *rest = made
    loss_fn, kwargs = (rest[0] if rest else None), (rest[1] if len(rest) > 1 else {})
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    report = explain(model, *inputs, loss_fn=loss_fn, **kwargs)
    print(report.summary())
    if args.table:
        print(report.table())
    # Imported here: the summary needs no matplotlib. Agg: no display needed.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = args.plot or Path("results") / f"explain-{factory_name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    report.plot(ax)
    ax.set_title(f"{args.target}: live memory over one step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
