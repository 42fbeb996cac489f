"""Exercise 04b: grader.py, stub.py, mistakes.py; the reference solution is ckpt_lab/scope_core.py."""
