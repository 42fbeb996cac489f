"""Exercise 07's catalogued mistakes: what learners get wrong, each a one-line change (or a few
lines) of the reference solution (``solution.py``) and the check that must catch it, with a phrase of
its message that tells this mistake apart (``tests/test_exercises.py`` grades every one)."""

from ckpt_lab.exercises._grading import Mistake

MISTAKES = [
    Mistake(
        "only the log fixed: the whole function still checkpointed",
        "        last = len(self.blocks) - 1\n        for i, block in enumerate(self.blocks):\n"
        "            x = block(x) if i == last else checkpoint(block, x)\n        return x\n",
        "        return checkpoint(self.run_blocks, x)\n",
        "peak",
        "The step peaks at 335,876 B",
    ),
    Mistake(
        "only the checkpoints moved: the log keeps the activations",
        "        if not in_backward():  # a re-run in backward calls the hook again: "
        "log the forward only\n"
        "            self.logged.append(output.detach().abs().mean().item())  "
        "# a number keeps no tensor alive\n",
        "        self.logged.append(output)\n",
        "kept",
        "212,992 B stay alive",
    ),
    Mistake(
        "logs detached tensors",
        "            self.logged.append(output.detach().abs().mean().item())",
        "            self.logged.append(output.detach())",
        "logging",
        "entry 0 is a whole tensor",
    ),
    Mistake(
        "logs in the re-runs too",
        "        if not in_backward():  # a re-run in backward calls the hook again: "
        "log the forward only\n",
        "        if True:\n",
        "logging",
        "holds 7 entries",
    ),
    Mistake(
        "removes the checkpoints",
        "            x = block(x) if i == last else checkpoint(block, x)",
        "            x = block(x)",
        "kept",
        "311,296 B stay alive",
    ),
    Mistake(
        "removes the log",
        "            self.logged.append(output.detach().abs().mean().item())",
        "            pass",
        "logging",
        "holds 0 entries",
    ),
    Mistake("names the wrong causes", "CAUSES = {1, 2}", "CAUSES = {3}", "causes", "Not a cause here: 3"),
]
