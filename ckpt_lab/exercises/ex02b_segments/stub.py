"""Exercise 02b: how many segments, under a memory limit? (notebook 02b A)

checkpoint_sequential(chain, s, x) cuts a chain of n_layers layers into s segments and checkpoints
all but the last. Write choose_segments: given the number of layers, the bytes of one layer's
activation, and a limit on the bytes kept from forward to backward, return the number of segments
s (a divisor of n_layers) that stays within the limit with the fewest layer runs in a training step
(forward and the re-runs in backward), or None if no s fits. s = 1 (no checkpoint) counts.

It is graded by measurement: for each case the grader runs ckpt_lab.checkpoint_sequential on a
chain of n_layers (Linear + Tanh) layers, 8 x 16 floats (one activation: 512 bytes), with every
divisor, and reads what each keeps (measure_memory's retained_bytes, less the 4-byte loss) and
how often the layers ran (CallCounter). Check it from the notebook, or from a shell in the
notebooks folder:

    python -m ckpt_lab.exercises check 02b-segments exercises/02b_segments.py
"""


def choose_segments(n_layers, activation_bytes, limit_bytes):
    raise NotImplementedError
