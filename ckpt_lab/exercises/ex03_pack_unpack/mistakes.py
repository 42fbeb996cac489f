"""Exercise 03's catalogued mistakes: what learners get wrong, each a one-line change (or a few
lines) of the reference solution (``solution.py``) and the check that must catch it, with a phrase of
its message that tells this mistake apart (``tests/test_exercises.py`` grades every one)."""

from ckpt_lab.exercises._grading import Mistake

MISTAKES = [
    Mistake(
        "pack keeps the tensor as it is",
        "    return tensor.dtype, tensor.to(torch.bfloat16)",
        "    return tensor.dtype, tensor",
        "bytes",
        "20,004 B stay alive",
    ),
    Mistake(
        "unpack does not cast back",
        "    return tensor.to(dtype)",
        "    return tensor",
        "unpack-returns",
        "unpack returned bf16[1000] on cpu for f32[1000]",
    ),
    Mistake(
        "compresses to an integer type",
        "tensor.to(torch.bfloat16)",
        "tensor.to(torch.uint8)",
        "gradient",
        "relative error 0.544",
    ),
    Mistake(
        "a debugging list keeps every saved tensor",
        "def pack(tensor):\n",
        "SEEN = []\n\n\ndef pack(tensor):\n    SEEN.append(tensor)  # for debugging\n",
        "bytes",
        "30,004 B stay alive",
    ),
]
