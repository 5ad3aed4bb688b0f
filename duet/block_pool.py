"""Physical KV blocks: reference counts, a free queue in eviction order, and the prefix cache."""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass


class BlockIntegrityError(AssertionError):
    """The pool's bookkeeping is inconsistent: a block leaked or was freed twice."""


# The parent of a prompt's first block. Not None: hash(None) differs between processes
# before Python 3.12, and routers compare these hashes across replicas.
ROOT_HASH = 0
# The depths (in blocks) at which a prompt's chained hash stands for its prefix in routing: every
# ``ROUTING_DEPTHS_FINE`` blocks (and the first few) to ``ROUTING_DEPTHS_FINE_TO``, then every
# ``ROUTING_DEPTHS_STRIDE``. A chained hash names the whole prefix before it, so a replica
# holding a long shared prefix (a system prompt, a conversation's history) is found from a few
# hashes a prompt, not one per block; fine enough that the router tells how much of a
# conversation a replica holds to within 64 tokens of blocks of 16 (a reply is a few blocks).
ROUTING_DEPTHS_FINE = 4
ROUTING_DEPTHS_FINE_TO = 256
ROUTING_DEPTHS_STRIDE = 64
# The pool's null block (``BlockPool(null_block=True)``): what a block table names in place of
# blocks a sequence gave back.
NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of a full block: it identifies the whole prefix, not only this block.

    Tuples of ints hash the same in every process, so replicas agree on a prefix's hashes.
    """
    return hash((ROOT_HASH if parent_hash is None else parent_hash, tuple(token_ids)))


def chain_root(lora: str | None, lora_path: str | None = None, key: int | None = None) -> int | None:
    """The parent of a chain's first block: none for the base model's KV, a hash of the LoRA
    adapter's name and folder for KV computed with it (``duet.lora``), which then shares no
    block with any other chain (nor with an adapter unloaded, then loaded under its name from
    another folder). Of their bytes, not of the strings: a string's hash differs from process
    to process, and the router and the replicas must agree on a prefix's hashes. ``key``: what
    else the KV depends on (``Request.cache_key``; None: nothing), in the root likewise."""
    root = None
    if lora is not None:
        identity = lora.encode() + b"\0" + (lora_path or "").encode()
        root = hash((ROOT_HASH, int.from_bytes(hashlib.blake2b(identity, digest_size=8).digest(), "little")))
    return root if key is None else hash((ROOT_HASH if root is None else root, -1, key))


def routing_depth(depth: int) -> bool:
    """Whether a prefix of ``depth`` full blocks is one that routing names (``ROUTING_DEPTHS_*``)."""
    if depth <= ROUTING_DEPTHS_FINE:
        return depth >= 1
    return depth % (ROUTING_DEPTHS_FINE if depth <= ROUTING_DEPTHS_FINE_TO else ROUTING_DEPTHS_STRIDE) == 0


def routing_depths() -> Iterator[int]:
    """The routing depths in order: those of ``routing_block_hashes``' hashes."""
    return (depth for depth in itertools.count(1) if routing_depth(depth))


def held_blocks(prefix_hashes: Sequence[int], held: Container[int]) -> int:
    """How many leading full blocks of a prompt whose routing hashes are ``prefix_hashes``
    (``routing_block_hashes``) a replica reporting ``held`` holds: the deepest routing depth up
    to which it holds every one of them."""
    blocks = 0
    for block_hash, depth in zip(prefix_hashes, routing_depths()):
        if block_hash not in held:
            break
        blocks = depth
    return blocks


def routing_block_hashes(token_ids: Sequence[int], block_size: int, lora: str | None = None, lora_path: str | None = None) -> list[int]:
    """The chained hashes of a prompt's full blocks at the routing depths, shallowest first, as
    the cache keys them (``lora``, ``lora_path``: see ``chain_root``): replicas report which of these they hold,
    and the router sends a prompt to the replica holding the deepest of its own."""
    hashes: list[int] = []
    parent = chain_root(lora, lora_path)
    for index in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[index * block_size : (index + 1) * block_size])
        if routing_depth(index + 1):
            hashes.append(parent)
    return hashes


class RecalledPrefixes:
    """The routing hashes (``routing_block_hashes``) of the contexts a replica holds, most recent
    last, at most ``limit`` of them (36 for a 2,048-token prompt; a conversation's turns share
    theirs): what its routing report names, those of them still in its prefix cache."""

    def __init__(self, limit: int = 8192) -> None:
        self.limit = limit
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def add(self, token_ids: Sequence[int], block_size: int, lora: str | None = None, lora_path: str | None = None) -> None:
        for block_hash in routing_block_hashes(token_ids, block_size, lora, lora_path):
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.limit:
            self._hashes.popitem(last=False)

    def cached(self, engine) -> list[int]:
        """Those still in ``engine``'s prefix cache (``LLMEngine.cached_prefixes``)."""
        return engine.cached_prefixes(list(self._hashes))


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    # Kept with the hash so that a hit is checked token by token: a hash collision
    # must never hand one prompt another prompt's KV.
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Owns every KV block.

    A block is in use (``ref_cnt > 0``, possibly shared by several requests) or free. Free
    blocks wait in a queue, least recently freed first; a free block that holds a full,
    hashed block of some prefix stays findable in the prefix cache until the queue hands
    it out again (lazy eviction). ``on_evict`` sees each cached block as the queue hands it
    out, its hash and tokens still on it (a second KV tier keeps its KV: ``duet.kv_tier``).

    With ``null_block``, block 0 is never handed out: it stands in a block table for blocks a
    sequence no longer needs (keys past every layer's sliding window), holds zeros, and is
    never written, counted, cached or freed; ``num_blocks`` counts the others.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        on_evict: Callable[[KVCacheBlock], None] | None = None,
        null_block: bool = False,
    ) -> None:
        self.on_evict = on_evict
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        first = 1 if null_block else 0
        self.null_block = self.blocks[NULL_BLOCK_ID] if null_block else None
        self.num_blocks = num_blocks - first
        self._free: OrderedDict[int, None] = OrderedDict((block_id, None) for block_id in range(first, num_blocks))
        self._cached: dict[int, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def get_cached_block(self, block_hash: int, token_ids: Sequence[int]) -> KVCacheBlock | None:
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == tuple(token_ids) else None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks with only {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue's tail in the given order."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise BlockIntegrityError(f"block {block.block_id} freed with ref_cnt={block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_block(self, block: KVCacheBlock, block_hash: int, token_ids: Sequence[int]) -> None:
        """Publish a full block under its chained hash; an existing entry for the hash wins."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached.setdefault(block_hash, block.block_id)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block)
        self.uncache([block])

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Withdraw blocks from the prefix cache (their KV is not what the hash promises); they
        stay allocated to whoever holds them."""
        for block in blocks:
            if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their KV, but are no longer findable)."""
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self._cached.clear()

    def check_integrity(self, expect_all_free: bool = False) -> None:
        """Raise ``BlockIntegrityError`` if the free queue, ref counts or cache map disagree."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            if block is self.null_block:
                if block.ref_cnt or in_free or block.block_hash is not None:
                    raise BlockIntegrityError(f"the null block has ref_cnt={block.ref_cnt}, in free queue={in_free}")
                continue
            if block.ref_cnt < 0 or (block.ref_cnt == 0) != in_free:
                raise BlockIntegrityError(f"block {block.block_id}: ref_cnt={block.ref_cnt}, in free queue={in_free}")
        for block_hash, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise BlockIntegrityError(f"cache entry {block_hash} points at block {block_id} with another hash")
        if expect_all_free and self.num_free_blocks != self.num_blocks:
            leaked = [b.block_id for b in self.blocks if b.ref_cnt > 0]
            raise BlockIntegrityError(f"{len(leaked)} blocks still referenced when all should be free: {leaked[:16]}")
