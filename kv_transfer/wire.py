"""Wire layout of one request's KV: for a run of layers, K then V of its blocks, contiguous.

The cache is ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]``. The
sender gathers the request's blocks of layers ``start:end`` and of a range of its KV heads
into ``[end - start, 2, heads, n, block_size, head_dim]`` and the receiver scatters that into
its own (different) block ids and its own place of those layers and heads (tensor-parallel
ranks hold different heads, pipeline stages different layers, on each side). A partial last
block travels whole: positions past the request's length are never read. Layers travel in runs
of about ``TARGET_MESSAGE_BYTES``: one message per layer costs gloo ~1 ms each, which dominated
small prompts.

On CPUs the C++ kernels copy the blocks and take the packed run's checksum (``faults.checksum``)
in one pass (``pack_summed``, ``unpack_summed``): packing, then reading the run again for its
checksum, took two passes over every byte on each side.
"""

from __future__ import annotations

import torch

from duet.kernels.block_copy import copy_block_runs, num_runs
from duet.kv_transfer.faults import checksum

TARGET_MESSAGE_BYTES = 8 << 20


def layer_runs(
    kv_cache: torch.Tensor, num_blocks: int, num_heads: int | None = None, num_layers: int | None = None
) -> list[tuple[int, int]]:
    """``(start, end)`` ranges of a transfer's ``num_layers`` layers (default: the cache's),
    counted from its first, one per message; both sides compute the same ones."""
    num_layers = num_layers or kv_cache.shape[0]
    layer_bytes = 2 * (num_heads or kv_cache.shape[2]) * num_blocks * kv_cache.shape[4] * kv_cache.shape[5] * kv_cache.element_size()
    per_message = max(1, min(num_layers, TARGET_MESSAGE_BYTES // max(layer_bytes, 1)))
    return [(start, min(start + per_message, num_layers)) for start in range(0, num_layers, per_message)]


def packed_shape(kv_cache: torch.Tensor, start: int, end: int, num_blocks: int, num_heads: int | None = None) -> tuple[int, ...]:
    _, two, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    return (end - start, two, num_heads or num_kv_heads, num_blocks, block_size, head_dim)


def pack_layers(
    kv_cache: torch.Tensor, start: int, end: int, block_ids: list[int], heads: slice = slice(None), out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather ``block_ids`` of layers ``start:end`` (of the cache's ``heads``) into one contiguous
    tensor: ``out`` where given (of ``packed_shape``)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    if out is None:
        return kv_cache[start:end, :, heads].index_select(3, index)
    return torch.index_select(kv_cache[start:end, :, heads], 3, index, out=out)


def unpack_layers(
    kv_cache: torch.Tensor, start: int, end: int, block_ids: list[int], packed: torch.Tensor, heads: slice = slice(None)
) -> None:
    """Scatter packed layers ``start:end`` into this replica's ``block_ids`` (of its ``heads``), a
    run of consecutive ids at a time where they mostly are (``index_copy_`` took 1.6x as long)."""
    layers = kv_cache[start:end, :, heads]
    if _by_runs(block_ids):
        copy_block_runs(layers, packed, list(enumerate(block_ids)))
        return
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    layers.index_copy_(3, index, packed.to(kv_cache.dtype))


def block_ops(kv_cache: torch.Tensor):
    """The C++ kernels that copy this cache's blocks and sum them in one pass (``copy_blocks_sum``),
    or None: a GPU cache, blocks not a multiple of 8 bytes, or no kernels here (torch copies)."""
    _, _, _, _, block_size, head_dim = kv_cache.shape
    if kv_cache.is_cuda or not kv_cache.is_contiguous() or (block_size * head_dim * kv_cache.element_size()) % 8:
        return None
    from duet.kernels import cpu_ops

    return cpu_ops.load()


def pack_summed(
    kv_cache: torch.Tensor, start: int, end: int, block_ids: list[int], heads: slice, out: torch.Tensor, ops
) -> int | None:
    """``pack_layers`` into ``out``, and the packed run's ``checksum`` where ``ops`` (``block_ops``)
    copied it in the same pass; None where torch packed it (its checksum not taken)."""
    if ops is None or out.dtype != kv_cache.dtype or not out.is_contiguous():
        pack_layers(kv_cache, start, end, block_ids, heads, out=out)
        return None
    ids = torch.tensor(block_ids, dtype=torch.long)
    return ops.copy_blocks_sum(out, kv_cache[start:end, :, heads], ids, torch.arange(len(block_ids)))


def unpack_summed(
    kv_cache: torch.Tensor, start: int, end: int, block_ids: list[int], packed: torch.Tensor, heads: slice, ops
) -> int:
    """``unpack_layers``, returning the packed run's ``checksum`` (taken in the same pass where
    ``ops``, ``block_ops``, copies it)."""
    if ops is None or packed.dtype != kv_cache.dtype or not packed.is_contiguous():
        total = checksum(packed)
        unpack_layers(kv_cache, start, end, block_ids, packed, heads)
        return total
    ids = torch.tensor(block_ids, dtype=torch.long)
    return ops.copy_blocks_sum(kv_cache[start:end, :, heads], packed, torch.arange(len(block_ids)), ids)


def _by_runs(block_ids: list[int]) -> bool:
    """Whether a copy per run of consecutive ids beats one indexed copy: runs of four blocks or
    more on average (a block table mostly is one; an indexed scatter of a run costs about twice
    a slice's copy)."""
    runs = num_runs(block_ids)
    return 4 * runs <= len(block_ids) or runs == 1
