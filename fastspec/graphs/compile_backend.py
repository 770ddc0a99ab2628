"""How GraphRunner compiles (fastspec.graphs.runner): the Inductor backend that refuses a graph with a host sync,
`size_varies` for a size that differs between processes, and a failed compile's cause in one line.
Does not own: the buckets, buffers, capture or replay (the runner), nor Inductor's on-disk cache (compile_cache).
"""

from collections.abc import Callable

import torch
from torch import Tensor


def size_varies(tensor: Tensor, dim: int) -> None:
    """Compile backend: `tensor`'s size along `dim` is symbolic in every graph that reads it, by argument or by
    closure (a KV pool sized from free memory), so a different size neither recompiles nor misses the on-disk
    cache. Dims a graph needs constant stay specialised (Inductor decides; nothing fails)."""
    import torch._dynamo

    torch._dynamo.maybe_mark_dynamic(tensor, dim)


class HostSyncError(Exception):
    """The traced graph reads a tensor's value on the host: not capturable as a CUDA graph."""


def inductor_without_host_sync(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Inductor, after refusing graphs with data-dependent scalars or shapes.

    With dynamic=False every size is a constant, so a symbol in the graph can only come from a tensor's value:
    `.item()`, `.tolist()`, `nonzero`, boolean-mask indexing... Recent dynamo traces these without a graph
    break (so fullgraph=True alone accepts them), but each is a device->host sync that breaks CUDA capture.
    """
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    from torch.utils._pytree import tree_leaves

    symbolic = (Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    for node in gm.graph.nodes:
        values = [v for v in tree_leaves(node.meta.get("example_value")) if isinstance(v, symbolic)]
        if any(free_unbacked_symbols(v) for v in values):
            raise HostSyncError(f"'{node.name}' depends on a tensor's value (a host sync: .item(), .tolist(), "
                                f"nonzero, mask indexing...) at {_source_line(node)}")
    # Inductor keeps a fused 16-bit kernel's intermediates in float32 unless told to round them as eager does, and
    # what it fuses depends on the bucket: on CPU a bfloat16 request's logits then changed with its batch size
    # (seeded output too). Told, every bucket computes what eager computes (measured on CPU; GPU graphs unchanged)
    on_cpu = all(t.device.type == "cpu" for t in example_inputs if isinstance(t, Tensor))
    return compile_fx(gm, example_inputs, config_patches={"emulate_precision_casts": True} if on_cpu else None)


def _source_line(node: torch.fx.Node) -> str:
    """'File "f.py", line 3, in fn: return x.item()' from the node's stack trace (last frame, no ^^^ markers)."""
    lines = [ln.strip() for ln in node.meta.get("stack_trace", "").splitlines() if ln.strip().strip("^~")]
    return ": ".join(lines[-2:]) or node.format_node()


def cause_line(e: Exception) -> str:
    """`Type: first line` of the real cause (dynamo wraps backend errors in BackendCompilerFailed)."""
    import torch._dynamo.exc

    if isinstance(e, torch._dynamo.exc.BackendCompilerFailed):
        e = e.inner_exception
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}"
