"""Exercise 04, reference solution: the package's scope core (ckpt_lab/scope_core.py, notebook 04 §3).

The core is the reference: written in the order notebook 04 builds it, a few hundred lines, and
the mechanism checks run on it in the tests (tests/test_scope_mechanism.py).
"""

from ckpt_lab.scope_core import gradient_checkpoint_scope  # noqa: F401
