"""Which blocks each request holds; prefix-cache lookups, in the pool and in a second tier behind
it (``duet.kv_tier``). Hides both from the scheduler."""

from __future__ import annotations

from collections import deque

from duet.block_pool import BlockIntegrityError, BlockPool, KVCacheBlock, chain_root, hash_block_tokens
from duet.kv_tier import KVTier, TierBlock
from duet.messages import KVCacheStats
from duet.outputs import KVTierOps
from duet.request import Request

FINISHED_CONTEXTS = 256  # ended sequences kept for a replica to read (``KVCacheManager.finished_contexts``)


class KVCacheManager:
    """Maps requests to block lists and keeps their full blocks published in the prefix cache.

    ``window``: how far back every layer's queries see (``LlamaArch.kv_window``; None: some
    layer sees all). A query at position p reads keys after p - window only, so the blocks
    wholly before a request's next query's window go back to the pool as it grows; its block
    table names the pool's null block in their place.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, tier: KVTier | None = None, window: int | None = None
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.tier = tier
        self.window = window
        on_evict = None if tier is None else lambda block: tier.save(block.block_id, block.block_hash, block.token_ids)
        self.block_pool = BlockPool(num_blocks, enable_caching, on_evict, null_block=window is not None)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_dropped: dict[str, int] = {}  # per request: its leading blocks now the null block
        self._req_to_hashes: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Blocks of requests that ended, kept (by transfer id) until a KV transfer lets go of them.
        self.held: dict[int, list[KVCacheBlock]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.finished_contexts: deque[tuple[list[int], str | None, str | None]] = deque(maxlen=FINISHED_CONTEXTS)  # remember_finished

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block of this hash is in the prefix cache (the pool or the tier)."""
        return self.block_pool.is_cached(block_hash) or (self.tier is not None and block_hash in self.tier)

    def take_tier_ops(self) -> KVTierOps:
        """The copies the workers make between the pool and the tier before the coming step."""
        return KVTierOps() if self.tier is None else self.tier.take_ops()

    def stats(self, kv_cache_dtype: str, kv_dtype: str, kv_bytes_per_block: int) -> KVCacheStats:
        """Its blocks and prefix cache lookups, with what the engine made its blocks hold: the
        dtype setting, the dtype it resolved to, and a block's bytes; and its tier's blocks."""
        tier = self.tier
        return KVCacheStats(
            num_free_blocks=self.num_free_blocks,
            num_blocks=self.block_pool.num_blocks,
            block_size=self.block_size,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            kv_cache_dtype=kv_cache_dtype,
            kv_dtype=kv_dtype,
            kv_bytes_per_block=kv_bytes_per_block,
            tier_capacity_blocks=0 if tier is None else tier.capacity_blocks,
            tier_blocks=0 if tier is None else tier.num_blocks,
            tier_saved_blocks=0 if tier is None else tier.num_saved,
            tier_restored_blocks=0 if tier is None else tier.num_restored,
        )

    def _block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Chained hashes of the request's full blocks among its first ``num_tokens`` tokens."""
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for index in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else chain_root(request.lora, request.lora_path, request.cache_key)
            hashes.append(hash_block_tokens(parent, request.all_token_ids[index * bs : (index + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock | TierBlock], int]:
        """The longest cached prefix of the request, as blocks (the pool's, or the tier's hits to
        be copied back) and a token count. With a window, a prefix counts as cached when the
        blocks its next query reads are: the null block stands for those before.

        The last prompt token is never served from cache: its logits are needed to sample; nor
        is any token of a request that asks for its prompt's logprobs.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_cached_tokens = request.num_tokens - 1
        hashes = self._block_hashes(request, max_cached_tokens)
        bs = self.block_size
        blocks: list[KVCacheBlock | TierBlock | None] = []
        best, last_miss = 0, -1  # the longest hit: every block its next query's window reads is cached
        for index, block_hash in enumerate(hashes):
            token_ids = request.all_token_ids[index * bs : (index + 1) * bs]
            block = self.block_pool.get_cached_block(block_hash, token_ids)
            if block is None and self.tier is not None:
                block = self.tier.lookup(block_hash, token_ids)
            if block is None:
                if self.window is None:  # every block before a hit is read
                    break
                last_miss = index
            elif last_miss < self.blocks_before_window((index + 1) * bs):
                best = index + 1
            blocks.append(block)
        # With a window, a hit's blocks before it may have been evicted: the null block stands there.
        first_read = self.blocks_before_window(best * bs)
        return [self.block_pool.null_block] * first_read + blocks[first_read:best], best * bs

    def blocks_before_window(self, num_computed_tokens: int) -> int:
        """How many leading blocks no query from position ``num_computed_tokens`` on reads: each
        sees the keys after its position less the window. 0 without a window."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def most_blocks_held(self, num_slots: int, largest_step: int) -> int:
        """The most blocks a request of ``num_slots`` slots, computed at most ``largest_step`` at a
        time, holds at once: all of them, or with a window those of a step and of the window before it."""
        whole = -(-num_slots // self.block_size)
        return whole if self.window is None else min(whole, -(-(self.window - 1 + largest_step) // self.block_size) + 1)

    def num_dropped_blocks(self, request_id: str) -> int:
        """How many of the request's leading blocks are the null block (their keys out of every window)."""
        return self._num_dropped.get(request_id, 0)

    def num_held_blocks(self, request_id: str) -> int:
        """The pool's blocks the request holds (not counting the null block in its table)."""
        return len(self.req_to_blocks.get(request_id, ())) - self._num_dropped.get(request_id, 0)

    def _drop_passed_blocks(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Return to the pool the request's blocks that passed out of every layer's window, tail
        first as ``free`` does (a cached one stays findable until evicted)."""
        dropped = self._num_dropped.get(request.request_id, 0)
        passed = min(self.blocks_before_window(request.num_computed_tokens), len(blocks))
        if passed <= dropped:
            return
        freed = blocks[dropped:passed]
        blocks[dropped:passed] = [self.block_pool.null_block] * (passed - dropped)
        self._num_dropped[request.request_id] = passed
        self.block_pool.free_blocks(reversed(freed))

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup (not every retry of a request left waiting)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock | TierBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for ``num_new_tokens`` more tokens of KV, or return None.

        ``new_computed_blocks`` are prefix-cache hits found by ``get_computed_blocks`` for a
        request not yet holding blocks; their tokens count as computed. A tier hit takes a new
        block, which the coming step's copies fill before its forward.
        """
        computed = new_computed_blocks or []
        held = self.req_to_blocks.get(request.request_id, [])
        if held and self.window is not None:
            self._drop_passed_blocks(request, held)
        num_computed_tokens = request.num_computed_tokens + len(computed) * self.block_size
        total_tokens = num_computed_tokens + num_new_tokens
        if not computed and held and -(-total_tokens // self.block_size) <= len(held):
            # a step of a sequence under way within the blocks it holds: only a block it filled to cache
            self._cache_full_blocks(request, held, min(total_tokens, request.num_tokens))
            return []
        null = self.block_pool.null_block
        num_null_hits = sum(1 for block in computed if block is null)
        pool_hits = [block for block in computed if isinstance(block, KVCacheBlock) and block is not null]
        tier_hits = [block for block in computed if isinstance(block, TierBlock)]
        num_required = -(-total_tokens // self.block_size) - len(held) - len(pool_hits) - num_null_hits
        # Hits sitting in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for block in pool_hits if block.ref_cnt == 0)
        if num_required > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        self.block_pool.touch(pool_hits)
        if tier_hits:
            self.tier.pin(tier_hits)  # before the evictions below save into the tier
        new_blocks = self.block_pool.get_new_blocks(max(num_required, 0))
        fresh = iter(new_blocks)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        for hit in computed:
            if isinstance(hit, TierBlock):
                block = next(fresh)
                self.tier.restore(hit, block.block_id)
                blocks.append(block)
            else:
                blocks.append(hit)
        blocks.extend(fresh)
        if num_null_hits:
            self._num_dropped[request.request_id] = num_null_hits
        self._cache_full_blocks(request, blocks, min(total_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        bs = self.block_size
        already = self._num_cached_blocks.get(request.request_id, 0)
        if num_tokens // bs <= already:  # no block filled since
            return
        hashes = self._block_hashes(request, num_tokens)
        for index in range(already, num_tokens // bs):  # (the pool never caches its null block)
            self.block_pool.cache_block(blocks[index], hashes[index], request.all_token_ids[index * bs : (index + 1) * bs])
        self._num_cached_blocks[request.request_id] = max(already, num_tokens // bs)

    def allocate_for_transfer(self, request: Request, num_tokens: int, num_skipped: int = 0) -> list[KVCacheBlock] | None:
        """Blocks for KV that another replica will send; published to the prefix cache only
        by ``cache_received`` once the KV has arrived, so no one reads them half-written. The
        first ``num_skipped`` (``blocks_before_window``) are the null block: no transfer fills them."""
        num_blocks = -(-num_tokens // self.block_size) - num_skipped
        if num_blocks > self.block_pool.num_free_blocks:
            return None
        blocks = self.block_pool.get_new_blocks(num_blocks)
        self.req_to_blocks[request.request_id] = [self.block_pool.null_block] * num_skipped + blocks
        if num_skipped:
            self._num_dropped[request.request_id] = num_skipped
        return blocks

    def remember_finished(self, request: Request) -> None:
        """Keep an ended sequence that decoded (not a prefill replica's, ended at its first token)
        and did not fail: its tokens, adapter and folder, whose KV stays cached till evicted, the
        latest ``FINISHED_CONTEXTS``. A decode replica names them to its router at its next report."""
        if self.enable_caching and request.error is None and request.num_output_tokens > 1:
            self.finished_contexts.append((list(request.all_token_ids), request.lora, request.lora_path))

    def cache_received(self, request: Request) -> None:
        self._cache_full_blocks(request, self.req_to_blocks[request.request_id], request.num_computed_tokens)

    def hold(self, request: Request, key: int) -> None:
        """Keep the request's blocks (and their KV) past its end, under ``key``, until
        ``release(key)``: a transfer may still be reading or writing them."""
        self.held[key] = self.req_to_blocks.pop(request.request_id, [])
        self._forget(request.request_id)

    def release(self, key: int) -> None:
        self.block_pool.free_blocks(reversed(self.held.pop(key, [])))

    def uncache_uncomputed(self, request: Request) -> None:
        """Withdraw from the prefix cache the request's blocks past its computed tokens: they were
        published when allocated, for a step that then failed before computing their KV."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        self.block_pool.uncache(blocks[request.num_computed_tokens // self.block_size :])

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted before its prefix."""
        self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(request.request_id, [])))
        self._forget(request.request_id)

    def _forget(self, request_id: str) -> None:
        self._req_to_hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self._num_dropped.pop(request_id, None)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first ``num_tokens`` positions, tail first: the slots
        of rejected draft tokens. Those blocks hold no full block of real tokens, so none is cached."""
        blocks = self.req_to_blocks.get(request.request_id)
        num_kept = -(-num_tokens // self.block_size)
        if blocks and len(blocks) > num_kept:
            extra = blocks[num_kept:]
            del blocks[num_kept:]
            self.block_pool.free_blocks(reversed(extra))

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def check_integrity(self) -> None:
        """Pool invariants, and every held block's ref count covers the requests holding it."""
        self.block_pool.check_integrity(expect_all_free=False)
        holders: dict[int, int] = {}
        null = self.block_pool.null_block
        for blocks in [*self.req_to_blocks.values(), *self.held.values()]:
            for block in blocks:
                if block is null:
                    continue
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks:
            if block is null:
                continue
            if block.ref_cnt != holders.get(block.block_id, 0):
                raise BlockIntegrityError(
                    f"block {block.block_id} has ref_cnt={block.ref_cnt} but {holders.get(block.block_id, 0)} holders"
                )
