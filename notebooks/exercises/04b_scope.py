"""Exercise 04b-scope: the rest of gradient_checkpoint_scope (notebook 04b).

Start from your exercise 04-scope solution (copy it here), then make it pass what notebook 04b
teaches: enclosing hooks and several scopes alive at once (§11), a scope inside a checkpoint (§2),
a chain of scopes and the release after a backward (§5, §11), the replays that must be refused (§9),
writes outside the recording with autograd's own error (§6), autocast (§10), views and in-place ops
(§4), and a scope on another thread (§1). Each failure names the 04b section that teaches the fix.

    python -m ckpt_lab.exercises check 04b-scope exercises/04b_scope.py
"""

import contextlib


@contextlib.contextmanager
def gradient_checkpoint_scope():
    raise NotImplementedError
    yield
