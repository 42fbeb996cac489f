"""Exercise 02's catalogued mistakes: what learners get wrong, each a one-line change (or a few
lines) of the reference solution (``solution.py``) and the check that must catch it, with a phrase of
its message that tells this mistake apart (``tests/test_exercises.py`` grades every one)."""

from ckpt_lab.exercises._grading import Mistake

MISTAKES = [
    Mistake(
        "saves the block's intermediates (forward keeps its graph)",
        "        return run_function(*args)\n",
        "        with torch.enable_grad():\n"
        "            ctx.outputs = run_function(*[t.detach().requires_grad_() for t in args])\n"
        "        return ctx.outputs.detach()\n",
        "keeps-only-inputs",
        "keeps 4 tensors made by the block",
    ),
    Mistake(
        "does not detach the inputs in the re-run",
        "        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]\n",
        "        inputs = list(ctx.saved_tensors)\n",
        "gradients",
        "x's gradient was added twice",
    ),
    Mistake(
        "forgets the RNG replay",
        "                torch.set_rng_state(ctx.rng_state)\n",
        "                pass\n",
        "dropout",
        "drew new dropout masks",
    ),
    Mistake(
        "re-runs under no_grad",
        "            with torch.enable_grad():",
        "            with torch.no_grad():",
        "re-run",
        "re-ran the block with grad mode off",
    ),
    Mistake(
        "restores the RNG without a fork",
        "        with torch.random.fork_rng(devices=[]):",
        "        if True:",
        "random-stream",
        "random stream was rewound",
    ),
    Mistake(
        "autograd.grad for the inputs only (draft 1)",
        "        torch.autograd.backward(outputs, grads)\n"
        "        return (None, None, *(t.grad for t in inputs))\n",
        "        return (None, None, *torch.autograd.grad(outputs, inputs, grads))\n",
        "gradients",
        "None of the block's parameters got a gradient",
    ),
    Mistake(
        "takes the RNG snapshot after the block ran",
        "        if preserve_rng_state:\n"
        "            ctx.rng_state = torch.get_rng_state()"
        "  # dropout must draw the same masks in the re-run\n"
        "        ctx.save_for_backward(*args)  # only the inputs; apply runs this with grad off: no graph\n"
        "        return run_function(*args)\n",
        "        ctx.save_for_backward(*args)\n"
        "        out = run_function(*args)\n"
        "        if preserve_rng_state:\n"
        "            ctx.rng_state = torch.get_rng_state()\n"
        "        return out\n",
        "dropout",
        "your snapshot (torch.get_rng_state()) was taken after the block ran",
    ),
    Mistake(
        "runs the forward with grad on (nothing kept)",
        "        return run_function(*args)\n",
        "        with torch.enable_grad():\n            return run_function(*args)\n",
        "re-run",
        "the block recorded a graph of its own",
    ),
]
