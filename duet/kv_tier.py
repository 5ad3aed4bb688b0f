"""A second KV tier behind the paged pool (``kv_offload``): blocks the prefix cache evicts are
copied into a bounded store in host memory (or a file), and a prompt whose prefix misses the
pool but hits the tier gets those blocks copied back instead of recomputed.

The scheduler's side (``KVTier``) knows which chained block hashes the tier holds and in which
slot, least recently used first, and decides every copy. The workers' side (``KVTierStore``)
carries a step's copies out before that step's forward and before its KV transfers start:
saves first, then loads. So an evicted block is saved before anything overwrites it, and a
restored block holds its KV before anything reads it. A slot a step loads from is pinned until
the step's copies are handed out, so no save of the same step takes it. The tier is inclusive: a
restored block keeps its slot, and evicting it from the pool again writes nothing.

Exact: the store holds the pool's bytes in the pool's dtype, so a restored prefix yields the
tokens a recomputed one would. A restore costs the step a copy (about 46 MB for 1,000 of
SmolLM2's fp32 tokens), where a recompute costs it the prompt's forward. With ``dtype: int8``
(``kv_offload``) a float pool's rows are kept as the int8 KV cache keeps its own, about 4x the
blocks in the same bytes, and a restored prefix's KV carries that cache's rounding.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from duet.config import ConfigError
from duet.kernels.block_copy import copy_block_runs
from duet.kernels.kv_quant import dequantize_rows, quantize_rows, rotate, row_width
from duet.outputs import KVTierOps


@dataclass(frozen=True)
class TierBlock:
    """A prefix-cache hit in the tier, not in the pool: its KV comes back from ``slot``."""

    block_hash: int
    slot: int


class KVTier:
    """The tier's index: chained block hash -> (slot, the block's tokens), least recently used
    first. Tokens are kept so that a hit is checked token by token, as the pool's are."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ConfigError("kv_offload.size_gib holds no KV block; give it at least one block's bytes")
        self.capacity_blocks = capacity_blocks
        self._entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))
        self._pinned: set[int] = set()
        self._ops = KVTierOps()
        self.num_saved = 0  # blocks written to the tier
        self.num_restored = 0  # blocks copied back into the pool

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> TierBlock | None:
        entry = self._entries.get(block_hash)
        if entry is None or entry[1] != tuple(token_ids):
            return None
        return TierBlock(block_hash, entry[0])

    def save(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> None:
        """Keep the KV of a block the pool evicts. Nothing is written for a hash the tier holds
        (it becomes the most recently used), nor when every slot is pinned by this step's loads."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._entries[block_hash] = (slot, tuple(token_ids))
        self._ops.saves.append((block_id, slot))
        self.num_saved += 1

    def pin(self, hits: Sequence[TierBlock]) -> None:
        """Keep these hits' slots for this step: call before the pool evicts (and so saves) for
        the blocks they are restored into."""
        self._pinned.update(hit.slot for hit in hits)

    def restore(self, hit: TierBlock, block_id: int) -> None:
        """Copy a pinned hit into the pool's ``block_id`` at the start of the coming step."""
        self._entries.move_to_end(hit.block_hash)
        self._ops.loads.append((hit.slot, block_id))
        self.num_restored += 1

    def take_ops(self) -> KVTierOps:
        """The step's copies, for the workers; the pins end with them."""
        ops, self._ops = self._ops, KVTierOps()
        self._pinned.clear()
        return ops

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, (slot, _) in self._entries.items():  # least recently used first
            if slot not in self._pinned:
                del self._entries[block_hash]
                return slot
        return None


class KVTierStore:
    """A worker's tier: one tensor shaped like its KV cache with ``capacity_blocks`` in place of
    the pool's blocks, in host memory (pinned when the cache is on a GPU) or mapped from a file
    under ``path`` that is unlinked at once (nothing is left behind, even by a crash).
    ``quantized``: a float cache's rows kept as the int8 KV cache keeps its own
    (``kernels.kv_quant``: a row's codes in a Hadamard basis and a byte of scale), restored into
    the pool's dtype and basis; not exact, ``head_dim + 1`` bytes a row."""

    def __init__(self, kv_cache: torch.Tensor, capacity_blocks: int, path: str | None = None, quantized: bool = False) -> None:
        self.kv_cache = kv_cache
        self.quantized = quantized
        shape = list(kv_cache.shape)
        shape[3] = capacity_blocks  # [layers, 2, kv_heads, blocks, block_size, width]
        dtype = kv_cache.dtype
        if quantized:
            shape[-1] = row_width(shape[-1], torch.int8)
            dtype = torch.int8
        if path is None:
            self.store = torch.empty(shape, dtype=dtype, pin_memory=kv_cache.is_cuda)
        else:
            numel = math.prod(shape)
            handle, file_name = tempfile.mkstemp(prefix="duet-kv-tier-", suffix=".bin", dir=path)
            try:
                os.ftruncate(handle, numel * dtype.itemsize)
                self.store = torch.from_file(file_name, shared=True, size=numel, dtype=dtype).view(shape)
            finally:
                os.close(handle)
                os.unlink(file_name)

    def apply(self, ops: KVTierOps) -> None:
        if not self.quantized:
            copy_block_runs(self.store, self.kv_cache, ops.saves)
            copy_block_runs(self.kv_cache, self.store, ops.loads)
            return
        if ops.saves:
            blocks, slots = (torch.tensor(ids) for ids in zip(*ops.saves))
            rows = self.kv_cache.index_select(3, blocks.to(self.kv_cache.device))
            self.store.index_copy_(3, slots, quantize_rows(rows, torch.int8).to(self.store.device))
        if ops.loads:
            slots, blocks = (torch.tensor(ids) for ids in zip(*ops.loads))
            rows = self.store.index_select(3, slots).to(self.kv_cache.device)
            values = rotate(dequantize_rows(rows, torch.float32)).to(self.kv_cache.dtype)  # back to the model's basis
            self.kv_cache.index_copy_(3, blocks.to(self.kv_cache.device), values)
