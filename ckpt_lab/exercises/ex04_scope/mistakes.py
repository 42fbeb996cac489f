"""Exercise 04's catalogued mistakes: one change of the reference solution (the package's scope core,
ckpt_lab/scope_core.py), and whole files (``old`` empty), each with the check that must catch it and
a phrase of its message that tells it apart (``tests/test_exercises.py`` grades every one)."""

from ckpt_lab.exercises._grading import Mistake

# Notebook 04's two drafts, a scope that recomputes nothing, and the scope core without its RNG replay.
_DRAFT_1 = '''"""Notebook 04's draft 1: record, hand out handles, replay; the hooks popped at __exit__."""

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode


class Made(int):
    """A tensor argument made by the scope, recorded as the position of the op that made it."""


class gradient_checkpoint_scope(TorchDispatchMode):  # noqa: N801
    def __enter__(self):
        self.tape, self.made = [], {}
        self.hooks = saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.hooks.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tape.append((func, [self.pack(v) if isinstance(v, torch.Tensor) else v for v in args], kwargs))
        self.made[id(out.untyped_storage())] = Made(len(self.tape) - 1)
        return out

    def pack(self, tensor):
        return self.made.get(id(tensor.untyped_storage()), tensor)

    def unpack(self, packed):
        if type(packed) is not Made:
            return packed
        values = []
        with torch.no_grad():
            for func, args, kwargs in self.tape:
                values.append(func(*[values[v] if type(v) is Made else v for v in args], **(kwargs or {})))
        return values[packed]
'''
_DRAFT_2 = _DRAFT_1.replace(
    "        super().__exit__(*exc)\n        self.hooks.__exit__(*exc)\n",
    "        super().__exit__(*exc)  # stop recording only: the hooks stay, for tensors used later\n",
)
MISTAKES = [
    Mistake(
        "stores everything (a scope that recomputes nothing)",
        "",
        "import contextlib\n\n\ndef gradient_checkpoint_scope():\n    return contextlib.nullcontext()\n",
        "api-page-example",
        "yet its memory is still alive after y = x * c",
    ),
    Mistake(
        "forgets the RNG replay",
        "def gradient_checkpoint_scope(*, preserve_rng_state: bool = True)",
        "def gradient_checkpoint_scope(*, preserve_rng_state: bool = False)",
        "dropout",
        "dropout in the scope",
    ),
    Mistake(
        "pops its hooks at __exit__ (notebook 04's draft 1)",
        "",
        _DRAFT_1,
        "hooks-released",
        "no hook is on the stack: x * c would store x",
    ),
    Mistake(
        "leaves its hooks on the stack (notebook 04's draft 2)",
        "",
        _DRAFT_2,
        "enclosing-hooks",
        "the enclosing hook packed []",
    ),
]

