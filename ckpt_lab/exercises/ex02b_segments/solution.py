"""Exercise 02b, reference solution: how many segments, under a memory limit? (notebook 02b A)"""


def choose_segments(n_layers, activation_bytes, limit_bytes):
    # A step runs n + (s - 1) * n / s layers: fewer segments, fewer re-runs. So the smallest s that
    # fits. Kept: each checkpointed segment's input (s - 1), and the last segment's n / s activations.
    for s in range(1, n_layers + 1):
        if n_layers % s == 0 and (s - 1 + n_layers // s) * activation_bytes <= limit_bytes:
            return s
    return None
