"""Host values onto the device without waiting for the device.

`torch.tensor(values, device="cuda")` and `cpu_tensor.to("cuda")` copy and then synchronise the stream: the host
waits for every kernel queued before the copy, for a few bytes. In a round that is a stall per tensor, and it
undoes the overlap schedule's launch of round K+1 before round K is read. A non_blocking copy from pageable
memory returns once the driver has staged the values (the source may be dropped at once) and is ordered on the
stream like a kernel. On CPU this is a plain tensor.
"""

from __future__ import annotations

import torch


def to_device(values, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list or a CPU tensor) as a tensor on `device`, queued behind the device's work, not waiting
    for it."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return host.to(device, non_blocking=True)
