"""Exercise 04: grader.py, stub.py, solution.py (notebook 04's drafts, assembled), mistakes.py."""
