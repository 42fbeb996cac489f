"""Exercise 04-scope's catalogued mistakes: one change of the reference solution (notebook 04's drafts,
assembled: ``solution.py``), or a whole file (``old`` empty), each with the check that must catch it
and a phrase of its message that tells it apart (``tests/test_exercises.py`` grades every one)."""

from ckpt_lab.exercises._grading import Mistake

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
        "                    draw[0].set_state(draw[1])  # the state this op drew from in the forward\n",
        "                    pass\n",
        "dropout",
        "dropout in the scope",
    ),
    Mistake(
        "replays at every unpack (notebook 04's draft (b))",
        "        if ref.round == self.round:",
        "        if True:",
        "recomputes-each-op-once",
        "ops run again in backward",
    ),
    Mistake(
        "pops its entry as the scope closes (notebook 04's drafts (b) and (c))",
        "        ResidentHooks.restack(drop=entry)\n",
        "        pop_hooks()\n",
        "hooks-released",
        "no hook is on the stack: x * c would store x",
    ),
    Mistake(
        "replays a tensor written after autograd saved it",
        "        if ref.tape.last_write.get(ref.slot, -1) >= ref.saved_at:",
        "        if False:",
        "modified-after-saved",
        "modified in place after sin saved it",
    ),
]
