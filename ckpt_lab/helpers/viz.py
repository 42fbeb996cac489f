"""Pictures: autograd graphs (torchviz, rendered to PNG) and memory plots (matplotlib).

Introduced in notebook 01. Graphs are rendered to PNG rather than SVG because JupyterLab does not
show SVG outputs of an untrusted (freshly cloned) notebook, and because torchviz's SVG changes on
every run (its node names are ``id()``s). Notebooks save their pictures to ``images/`` only when
``CKPT_LAB_SAVE_IMAGES=1`` (set by ``make notebooks``), so running the tests never rewrites files.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt_lab.instruments.counting import OpCounter

__all__ = [
    "IMAGES",
    "GraphPicture",
    "draw_graph",
    "plot_memory_bars",
    "plot_timeline",
    "save_figure",
    "save_png",
    "show_dot",
]

# The checkout's images/ folder, where `make notebooks` saves the pictures.
IMAGES = Path(__file__).resolve().parents[2] / "images"


def _saving() -> bool:
    return os.environ.get("CKPT_LAB_SAVE_IMAGES") == "1"


class GraphPicture:
    """A rendered autograd graph; displays as PNG in Jupyter."""

    def __init__(self, png: bytes, ops_while_drawing: int) -> None:
        self.png = png
        # Aten ops that ran while torchviz read the graph: > 0 means reading saved tensors recomputed them.
        self.ops_while_drawing = ops_while_drawing

    def _repr_png_(self) -> bytes:
        return self.png

    def __repr__(self) -> str:
        return "<autograd graph>"


def draw_graph(
    output: torch.Tensor,
    params: Mapping[str, torch.Tensor] | None = None,
    *,
    show_saved: bool = False,
    show_attrs: bool = False,
    name: str | None = None,
) -> GraphPicture:
    """Draw the autograd graph that produced ``output`` (torchviz), as PNG; save it as ``images/name.png``.

    With ``show_saved``/``show_attrs`` torchviz reads ``grad_fn._saved_*`` attributes, which
    *unpacks* saved tensors. Under a non-reentrant checkpoint an unpack recomputes the checkpointed
    function, so drawing changes what it draws: the picture warns when that happened.
    """
    from torchviz import make_dot

    with OpCounter() as ops, warnings.catch_warnings():
        # torchviz 0.0.3 uses a deprecated torch API on every call; that warning is noise here.
        warnings.simplefilter("ignore", DeprecationWarning)
        dot = make_dot(output, params=dict(params or {}), show_attrs=show_attrs, show_saved=show_saved)
    if ops.total:
        warnings.warn(
            f"drawing this graph ran {ops.total} aten ops: reading its saved tensors unpacked them, "
            "and a saved-tensor hook recomputed them (a non-reentrant checkpoint?). Draw without "
            "show_saved/show_attrs to leave the graph untouched.",
            stacklevel=2,
        )
    dot.graph_attr.update(dpi="72")
    png = dot.pipe(format="png")
    if name is not None:
        save_png(png, name)
    return GraphPicture(png, ops.total)


def save_png(png: bytes, name: str) -> None:
    """Save PNG bytes (a rendered graph) as ``images/name.png`` when regenerating the notebooks."""
    if _saving():
        IMAGES.mkdir(exist_ok=True)
        (IMAGES / f"{name}.png").write_bytes(png)


def show_dot(dot: str, name: str) -> Any:
    """Render DOT to PNG, save it as ``images/name.png`` when regenerating, and return it for display."""
    import graphviz
    from IPython.display import Image

    png = graphviz.Source(dot).pipe(format="png")
    save_png(png, name)
    return Image(png)


def save_figure(fig: Any, name: str) -> None:
    """Save a matplotlib figure as ``images/name.png`` when regenerating the notebooks."""
    if _saving():
        IMAGES.mkdir(exist_ok=True)
        fig.savefig(IMAGES / f"{name}.png", dpi=100, bbox_inches="tight")


def plot_memory_bars(ax: Any, values: Mapping[str, int], title: str = "", unit: int = 1024) -> None:
    """Horizontal bars of byte counts (in KiB by default), each labelled with its value."""
    labels = list(values)
    sizes = [values[k] / unit for k in labels]
    bars = ax.barh(labels, sizes, color="tab:blue")
    ax.invert_yaxis()
    ax.bar_label(bars, labels=[f"{s:,.1f}" for s in sizes], padding=3)
    ax.set_xlabel("KiB" if unit == 1024 else ("MiB" if unit == 1024**2 else "bytes"))
    ax.set_title(title)
    ax.margins(x=0.2)


def plot_timeline(ax: Any, mem: Any, label: str, unit: int = 1024, exclude: set[int] | None = None) -> None:
    """Live bytes after each allocation or free recorded by a ``LiveMemory``, forward then backward.

    ``exclude``: serials to leave out, e.g. ``mem.born_in("backward")`` for the gradients, so that
    the curve's maximum is ``MemoryReport.peak_bytes``.
    """
    live, xs, ys = 0, [], []
    events = [e for e in mem.events if not exclude or e[0] not in exclude]
    for i, (serial, sign, _) in enumerate(events):
        live += sign * mem.nbytes(serial)
        xs.append(i)
        ys.append(live / unit)
    ax.step(xs, ys, where="post", label=label)
    ax.set_xlabel("allocation / free event")
    ax.set_ylabel("live KiB" if unit == 1024 else "live bytes")
