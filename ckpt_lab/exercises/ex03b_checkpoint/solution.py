"""Exercise 03b, reference solution: a non-reentrant checkpoint on saved-tensor hooks (notebook 03b)."""

import torch
from torch.autograd.graph import saved_tensors_hooks


def checkpoint(function, *args):
    rng_state = torch.get_rng_state()  # dropout must draw the same masks in the re-run
    count = 0  # how many tensors the forward saved: each gets its position as a ticket
    recomputed = {}  # position -> tensor, filled by a re-run, emptied as backward takes them

    def pack(tensor):
        nonlocal count
        count += 1
        return count - 1  # autograd stores the ticket, not the tensor

    def recompute():
        position = 0

        def pack_again(tensor):  # the re-run saves the same tensors in the same order
            nonlocal position
            recomputed[position] = tensor.detach()
            position += 1
            return tensor

        inputs = [
            a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args
        ]
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is put back afterwards
            torch.set_rng_state(rng_state)
            with torch.enable_grad(), saved_tensors_hooks(pack_again, lambda t: t):
                function(*inputs)

    def unpack(position):
        if position not in recomputed:  # the first unpack of a backward: one re-run fills them all
            recompute()
        return recomputed.pop(position)  # handed out once: backward frees it after use

    with saved_tensors_hooks(pack, unpack):
        return function(*args)
