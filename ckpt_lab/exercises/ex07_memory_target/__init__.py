"""Exercise 07: grader.py, stub.py, solution.py, mistakes.py (see ckpt_lab/exercises/__init__.py)."""
