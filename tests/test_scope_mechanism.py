"""The scope's mechanism tests, on both scopes: the shipped one (``ckpt_lab.scope``) and its core
(``ckpt_lab.scope_core``). The checks themselves live in ``ckpt_lab.scope_checks`` (shared with the
exercise grader); each test here runs one check on one implementation. Marked ``mechanism``:
``pytest -m mechanism`` runs only these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import ckpt_lab.scope
import ckpt_lab.scope_core
from ckpt_lab.instruments.state import assert_no_global_state
from ckpt_lab.scope_checks import CHECKS

IMPLEMENTATIONS = {
    "scope": ckpt_lab.scope.gradient_checkpoint_scope,
    "scope_core": ckpt_lab.scope_core.gradient_checkpoint_scope,
}

pytestmark = pytest.mark.mechanism


@pytest.fixture(params=sorted(IMPLEMENTATIONS), autouse=False)
def scope_impl(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Each implementation of ``gradient_checkpoint_scope``; clean global state before and after."""
    assert_no_global_state()
    yield IMPLEMENTATIONS[request.param]
    assert_no_global_state()
    assert not any(ckpt_lab.scope_core.leftovers().values())


@pytest.mark.parametrize("check", CHECKS, ids=[check.__name__.removeprefix("check_") for check in CHECKS])
def test_mechanism(check: Callable[[Callable[..., Any]], None], scope_impl: Callable[..., Any]) -> None:
    check(scope_impl)
