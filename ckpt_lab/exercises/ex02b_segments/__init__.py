"""Exercise 02b: grader.py, stub.py, solution.py, mistakes.py (see ckpt_lab/exercises/__init__.py)."""
