"""Wire layout of one request's KV: per layer, K then V of its blocks, packed contiguously.

A layer's cache is ``[2, num_kv_heads, num_blocks, block_size, head_dim]`` (K and V).
The sender gathers the request's blocks into ``[2, num_kv_heads, n, block_size, head_dim]``
and the receiver scatters that into its own (different) block ids. A partial last block
travels whole: positions past the request's length are never read.
"""

from __future__ import annotations

import torch


def layer_shape(kv_layer: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
    """Shape of one layer's packed KV for ``num_blocks`` blocks."""
    two, num_kv_heads, _, block_size, head_dim = kv_layer.shape
    return (two, num_kv_heads, num_blocks, block_size, head_dim)


def pack_layer(kv_layer: torch.Tensor, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather ``block_ids`` of one layer into a contiguous buffer (``out`` if given)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_layer.device)
    if out is None:
        return kv_layer.index_select(2, index)
    return torch.index_select(kv_layer, 2, index, out=out)


def unpack_layer(kv_layer: torch.Tensor, block_ids: list[int], packed: torch.Tensor) -> None:
    """Scatter a packed layer into this replica's ``block_ids``."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_layer.device)
    kv_layer.index_copy_(2, index, packed.to(kv_layer.dtype))
