"""Exercise 03b's catalogued mistakes: what learners get wrong, each a one-line change (or a few
lines) of the reference solution (``solution.py``) and the check that must catch it, with a phrase of
its message that tells this mistake apart (``tests/test_exercises.py`` grades every one)."""

from ckpt_lab.exercises._grading import Mistake

MISTAKES = [
    Mistake(
        "every unpack re-runs the function (unpacking again and again)",
        "        if position not in recomputed:",
        "        if True:",
        "re-run",
        "Each unpack re-ran it",
    ),
    Mistake(
        "keeps the recomputed tensors after use",
        "        return recomputed.pop(position)",
        "        return recomputed[position]",
        "frees-after-use",
        "still holds 5 tensors its re-run made",
    ),
    Mistake(
        "pushes the hooks without popping them on error",
        "    with saved_tensors_hooks(pack, unpack):\n        return function(*args)\n",
        "    hooks = saved_tensors_hooks(pack, unpack)\n    hooks.__enter__()\n"
        "    out = function(*args)\n    hooks.__exit__(None, None, None)\n    return out\n",
        "error-leaves-nothing",
        "a saved-tensor hook is still on the stack",
    ),
    Mistake(
        "forgets the RNG replay",
        "            torch.set_rng_state(rng_state)\n",
        "            pass\n",
        "dropout",
        "The re-run drew new dropout masks",
    ),
    Mistake(
        "re-runs under no_grad",
        "            with torch.enable_grad(), saved_tensors_hooks",
        "            with torch.no_grad(), saved_tensors_hooks",
        "re-run",
        "ran the block with grad mode off",
    ),
    Mistake(
        "pack keeps the tensor (no checkpoint at all)",
        "        return count - 1  # autograd stores the ticket, not the tensor",
        "        return tensor",
        "keeps-only-inputs",
        "Its pack hook should store a ticket",
    ),
]
