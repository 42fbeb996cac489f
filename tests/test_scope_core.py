"""What only the scope's core does: its refusals (each names the shipped scope), and its budget.

The mechanism both scopes share is tested in tests/test_scope_mechanism.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import ckpt_lab.scope_core as core
from ckpt_lab.errors import CheckpointError
from ckpt_lab.instruments.state import assert_no_global_state
from ckpt_lab.scope_core import gradient_checkpoint_scope

PACKAGE = Path(core.__file__).parent


def ckpt_lab_imports(path: Path) -> set[str]:
    """The ckpt_lab modules a file imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckpt_lab"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("ckpt_lab"))
    return names


def assert_clean() -> None:
    assert_no_global_state()
    assert not any(core.leftovers().values())


def test_the_core_is_read_in_one_sitting_and_copied_with_three_files() -> None:
    assert len((PACKAGE / "scope_core.py").read_text().splitlines()) <= 450
    assert ckpt_lab_imports(PACKAGE / "scope_core.py") <= {
        "ckpt_lab.errors",
        "ckpt_lab.rng",
        "ckpt_lab._aten",
    }
    # ... and so does the shipped scope: copying it takes scope.py, errors.py, rng.py and _aten.py.
    assert ckpt_lab_imports(PACKAGE / "scope.py") <= {"ckpt_lab.errors", "ckpt_lab.rng", "ckpt_lab._aten"}


def test_an_in_place_write_to_an_outside_tensor_is_refused() -> None:
    a = torch.randn(8, requires_grad=True)
    buf = torch.zeros(8)
    with pytest.raises(
        CheckpointError, match=r"add_.*writes to an input.*ckpt_lab.gradient_checkpoint_scope"
    ):
        with gradient_checkpoint_scope():
            buf.add_(1)
    assert torch.equal(buf, torch.zeros(8))  # refused before it ran
    bn = nn.BatchNorm1d(8)
    with pytest.raises(CheckpointError, match="writes to an input"):
        with gradient_checkpoint_scope():
            bn(a.view(1, 8).expand(4, 8))
    assert_clean()


def test_a_tensor_on_memory_the_scope_made_is_refused() -> None:
    with pytest.raises(CheckpointError, match=r"\.data.*ckpt_lab.gradient_checkpoint_scope"):
        with gradient_checkpoint_scope():
            w = torch.empty(4, 4)
            nn.init.uniform_(nn.Parameter(w))  # a Parameter built in the scope, initialised in place
    assert_clean()


def test_inference_mode_inside_the_scope_is_refused() -> None:
    a = torch.randn(4, requires_grad=True)
    with pytest.raises(CheckpointError, match="inference_mode"):
        with gradient_checkpoint_scope():
            with torch.inference_mode():
                a.sin()
    assert_clean()
