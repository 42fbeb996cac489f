"""Exercise 04: grader.py, stub.py, mistakes.py; the reference solution is ckpt_lab/scope_core.py."""
