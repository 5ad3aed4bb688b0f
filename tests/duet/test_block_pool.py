"""BlockPool: allocation order, reference counts, eviction order, the prefix cache, integrity checks."""

import pytest

from duet.block_pool import BlockIntegrityError, BlockPool, hash_block_tokens
from duet.kv_cache_manager import KVCacheManager
from duet.request import Request
from duet.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def _cache(pool: BlockPool, block, tokens, parent=None) -> int:
    """Publish ``block`` as a full block holding ``tokens`` after ``parent``; return its hash."""
    block_hash = hash_block_tokens(parent, tokens)
    pool.cache_block(block, block_hash, tokens)
    return block_hash


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=4), eos_token_id=None)


def test_fresh_pool_hands_out_blocks_in_id_order():
    """Guards against a free queue not seeded in id order (e.g. a set): block tables would be unpredictable."""
    pool = BlockPool(num_blocks=5, enable_caching=True)

    first = pool.get_new_blocks(3)
    second = pool.get_new_blocks(2)

    assert _ids(first) == [0, 1, 2]
    assert _ids(second) == [3, 4]
    assert [block.ref_cnt for block in first + second] == [1, 1, 1, 1, 1]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    pool.check_integrity()


def test_asking_for_more_blocks_than_are_free_raises_and_takes_nothing():
    """Guards against a partial allocation that pops some blocks before noticing the pool is short."""
    pool = BlockPool(num_blocks=3, enable_caching=True)
    pool.get_new_blocks(2)

    with pytest.raises(ValueError, match="asked for 2 blocks with only 1 free"):
        pool.get_new_blocks(2)

    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_shared_block_returns_to_the_free_queue_only_after_its_last_reference():
    """Guards against freeing a shared block on the first release, which would hand live KV to another request."""
    pool = BlockPool(num_blocks=2, enable_caching=True)
    (shared,) = pool.get_new_blocks(1)
    _cache(pool, shared, [1, 2, 3, 4])
    pool.touch([shared])
    assert shared.ref_cnt == 2
    assert pool.num_free_blocks == 1

    pool.free_blocks([shared])
    assert shared.ref_cnt == 1
    assert pool.num_free_blocks == 1
    assert _ids(pool.get_new_blocks(1)) == [1]

    pool.free_blocks([shared])
    assert shared.ref_cnt == 0
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_blocks_are_reused_least_recently_freed_first():
    """Guards against a LIFO free list, which evicts the most recently used (most likely reused) prefixes first."""
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(4)

    pool.free_blocks([blocks[2], blocks[0]])
    pool.free_blocks([blocks[3], blocks[1]])

    assert _ids(pool.get_new_blocks(4)) == [2, 0, 3, 1]
    pool.check_integrity(expect_all_free=False)


def test_manager_frees_a_request_tail_first_so_its_prefix_is_evicted_last():
    """Guards against freeing head-first, which evicts a finished prompt's shared prefix before its private tail."""
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_caching=True)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks and one token
    first = _request("a", prompt)
    assert _ids(manager.allocate_slots(first, first.num_tokens)) == [0, 1, 2, 3]

    manager.free(first)
    pool = manager.block_pool
    # Free queue is now 3, 2, 1, 0: two fresh blocks take the last, uncached one and the third prompt block.
    assert _ids(pool.get_new_blocks(2)) == [3, 2]
    assert pool.num_evictions == 1

    again = _request("b", prompt)
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert _ids(hits) == [0, 1]
    assert num_hit_tokens == 8


def test_freed_cached_block_stays_a_hit_until_it_is_reallocated():
    """Guards against eager eviction on free (losing reusable prefixes) and against stale hits after reuse."""
    pool = BlockPool(num_blocks=2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    tokens = [5, 6, 7, 8]
    block_hash = _cache(pool, block, tokens)
    pool.free_blocks([block])

    assert pool.get_cached_block(block_hash, tokens) is block
    assert pool.num_evictions == 0

    # Block 1 leaves the queue first; the second allocation reaches the cached block.
    assert _ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(block_hash, tokens) is block
    assert _ids(pool.get_new_blocks(1)) == [0]

    assert pool.get_cached_block(block_hash, tokens) is None
    assert block.block_hash is None and block.token_ids is None
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_touch_pulls_a_free_cached_block_out_of_the_free_queue():
    """Guards against a prefix hit that stays in the free queue and is handed out again while in use."""
    pool = BlockPool(num_blocks=2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    block_hash = _cache(pool, block, [1, 2, 3, 4])
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2

    pool.touch([pool.get_cached_block(block_hash, [1, 2, 3, 4])])

    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 1
    assert _ids(pool.get_new_blocks(1)) == [1]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.get_cached_block(block_hash, [1, 2, 3, 4]) is block
    pool.check_integrity()


def test_duplicate_hash_keeps_the_first_cached_block():
    """Guards against a duplicate overwriting the cache entry, and against its eviction dropping the first's."""
    pool = BlockPool(num_blocks=3, enable_caching=True)
    first, duplicate = pool.get_new_blocks(2)
    tokens = [9, 9, 9, 9]
    block_hash = _cache(pool, first, tokens)
    _cache(pool, duplicate, tokens)

    assert pool.get_cached_block(block_hash, tokens) is first

    pool.free_blocks([duplicate])
    assert _ids(pool.get_new_blocks(2)) == [2, 1]  # reallocating the duplicate evicts nothing from the cache
    assert pool.get_cached_block(block_hash, tokens) is first
    assert pool.num_evictions == 0
    pool.check_integrity()


def test_hash_collision_with_different_tokens_is_a_miss():
    """Guards against trusting the hash alone: a collision would serve one prompt another prompt's KV."""
    pool = BlockPool(num_blocks=1, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    forged_hash = 12345
    pool.cache_block(block, forged_hash, [1, 2, 3, 4])

    assert pool.get_cached_block(forged_hash, [1, 2, 3, 5]) is None
    assert pool.get_cached_block(forged_hash, [1, 2, 3, 4]) is block


def test_caching_disabled_publishes_nothing():
    """Guards against prefix reuse leaking in when the user turned prefix caching off."""
    pool = BlockPool(num_blocks=1, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    block_hash = _cache(pool, block, [1, 2, 3, 4])

    assert block.block_hash is None
    assert pool.get_cached_block(block_hash, [1, 2, 3, 4]) is None


def test_double_free_raises():
    """Guards against a ref count going negative and a block sitting twice in the free queue."""
    pool = BlockPool(num_blocks=2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])

    with pytest.raises(BlockIntegrityError, match="block 0 freed with ref_cnt=0"):
        pool.free_blocks([block])
    assert pool.num_free_blocks == 2


def test_check_integrity_detects_a_ref_count_that_disagrees_with_the_free_queue():
    """Guards against bookkeeping drift going unnoticed: a block in use with ref_cnt 0 would be lost forever."""
    pool = BlockPool(num_blocks=2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.check_integrity()

    block.ref_cnt = 0

    with pytest.raises(BlockIntegrityError, match="block 0: ref_cnt=0, in free queue=False"):
        pool.check_integrity()


def test_check_integrity_detects_a_cache_entry_pointing_at_a_rehashed_block():
    """Guards against the cache map and a block's own hash disagreeing, which would make eviction miss the entry."""
    pool = BlockPool(num_blocks=1, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    _cache(pool, block, [1, 2, 3, 4])

    block.block_hash = 999

    with pytest.raises(BlockIntegrityError, match="points at block 0 with another hash"):
        pool.check_integrity()


def test_expect_all_free_reports_leaked_blocks():
    """Guards against leaks hiding behind a consistent pool: idle engines must have every block free."""
    pool = BlockPool(num_blocks=3, enable_caching=True)
    _, leaked = pool.get_new_blocks(2)
    pool.free_blocks([pool.blocks[0]])

    pool.check_integrity()
    with pytest.raises(BlockIntegrityError, match=r"1 blocks still referenced when all should be free: \[1\]"):
        pool.check_integrity(expect_all_free=True)

    pool.free_blocks([leaked])
    pool.check_integrity(expect_all_free=True)


def test_hash_chains_the_parent_so_equal_blocks_under_different_prefixes_differ():
    """Guards against hashing a block's tokens alone, which would reuse KV computed under another prefix."""
    tokens = [7, 7, 7, 7]
    parent_a = hash_block_tokens(None, [1, 2, 3, 4])
    parent_b = hash_block_tokens(None, [1, 2, 3, 5])

    assert hash_block_tokens(parent_a, tokens) == hash_block_tokens(parent_a, list(tokens))
    assert hash_block_tokens(parent_a, tokens) != hash_block_tokens(parent_b, tokens)
    assert hash_block_tokens(None, tokens) != hash_block_tokens(parent_a, tokens)


def test_same_second_block_under_a_different_first_block_is_not_a_hit():
    """Guards against the prefix cache matching a later block whose earlier context differs (end to end)."""
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, enable_caching=True)
    first = _request("a", [1, 2, 3, 4, 7, 7, 7, 7, 0])
    manager.allocate_slots(first, first.num_tokens)

    other_prefix = _request("b", [1, 2, 3, 5, 7, 7, 7, 7, 0])
    assert manager.get_computed_blocks(other_prefix) == ([], 0)

    same_prefix = _request("c", [1, 2, 3, 4, 7, 7, 7, 7, 0])
    hits, num_hit_tokens = manager.get_computed_blocks(same_prefix)
    assert _ids(hits) == [0, 1]
    assert num_hit_tokens == 8
    manager.free(first)
    manager.check_integrity()
