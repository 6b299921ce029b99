"""Host tensors to the GPU without making the host wait for the device.

A plain ``tensor.to("cuda")`` from pageable host memory ends in a stream synchronise: the host waits until every
kernel queued before the copy has run. The train phase copies each micro-batch's fields (tokens, positions, mask,
advantages, log-probs, sample ids, the LM head's scored indices) when it reaches them, some in the middle of a
micro-batch (the loss after the forward), so each copy would drain the GPU's queue and the host then relaunch from an
empty one, the GPU idle meanwhile (BENCHMARKS.md, "Step against peers, earlier runs": the profiled 1.7B step). From
page-locked memory the copy is queued on the stream like a kernel: ordered with the work around it, and the host goes
on. The page-locked staging copy comes from torch's caching host allocator, which keeps the block until the copy that
reads it has run.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor bound for a GPU goes through a page-locked copy, queued on the current
    stream without a host wait (a ``tensor`` that is page-locked already is read in place, after this returns: write
    to it only once the stream has passed the copy). Anything else is ``tensor.to(device)``."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    # contiguous first: from a strided source the copy would stage through a pageable temporary, and wait
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)
