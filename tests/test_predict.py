"""ckpt_lab.helpers.predict.reveal: the predict-then-run prompts of the notebooks."""

from __future__ import annotations

import pytest

from ckpt_lab.helpers.predict import reveal


@pytest.mark.parametrize(
    ("guess", "answer", "kwargs", "expected"),
    [
        (None, 4000, {}, "measured bytes: 4,000  (write a guess in the cell above before running this one)"),
        (4000, 4000, {}, "measured bytes: 4,000  |  your guess: 4000, right"),
        (3999, 4000, {}, "measured bytes: 4,000  |  your guess: 3999, not what was measured"),
        (1.3, 1.33, {"rel_tol": 0.05}, "measured bytes: 1.33  |  your guess: 1.3, right"),
        (1, True, {}, "measured bytes: True  |  your guess: 1, not what was measured"),
        (True, True, {}, "measured bytes: True  |  your guess: True, right"),
        (" Mul ", "mul", {}, "measured bytes: 'mul'  |  your guess: ' Mul ', right"),
        ([1, 2], [1, 2], {}, "measured bytes: [1, 2]  |  your guess: [1, 2], right"),
    ],
)
def test_reveal_prints_the_measured_answer_and_judges_the_guess(capsys, guess, answer, kwargs, expected):
    reveal(guess, answer, "bytes", **kwargs)
    assert capsys.readouterr().out.rstrip("\n") == expected
