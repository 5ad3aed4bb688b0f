"""KVCacheManager: prefix lookups in whole blocks, slot allocation, freeing, hit counters."""

from duet.kv_cache_manager import KVCacheManager
from duet.request import Request
from duet.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _manager(num_blocks: int, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, enable_caching=enable_caching)


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=8), eos_token_id=None)


def _ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def _admit(manager: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a whole prompt: look up hits, allocate, mark the prompt computed."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new_blocks is not None
    manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
    request.num_computed_tokens = request.num_tokens
    return manager.block_ids(request.request_id)


def _decode_one(manager: KVCacheManager, request: Request, token_id: int) -> list[int]:
    """One decode step: the sampled token is appended, then gets a slot."""
    request.append_output_token_ids([token_id])
    new_blocks = manager.allocate_slots(request, 1)
    assert new_blocks is not None
    request.num_computed_tokens += 1
    return _ids(new_blocks)


def test_longest_cached_prefix_is_found_in_whole_blocks():
    """Guards against the lookup stopping early, skipping a miss, or counting a partial block as a hit."""
    manager = _manager(num_blocks=8)
    cached = _request("a", list(range(10, 23)))  # 13 tokens: blocks 0, 1, 2 full, block 3 partial
    assert _admit(manager, cached) == [0, 1, 2, 3]

    # Shares blocks 0 and 1, differs inside block 2, then matches again: only the first two count.
    query = _request("b", list(range(10, 18)) + [99, 19, 20, 21, 22, 23, 24])
    hits, num_hit_tokens = manager.get_computed_blocks(query)

    assert _ids(hits) == [0, 1]
    assert num_hit_tokens == 8
    assert [block.ref_cnt for block in hits] == [1, 1]  # a lookup takes no reference
    manager.check_integrity()


def test_last_prompt_token_is_never_served_from_cache():
    """Guards against a full-prompt hit that leaves nothing to compute, so there are no logits to sample from."""
    manager = _manager(num_blocks=8)
    prompt = list(range(10, 18))  # exactly 2 full blocks
    _admit(manager, _request("a", prompt))

    hits, num_hit_tokens = manager.get_computed_blocks(_request("b", prompt))
    assert _ids(hits) == [0]
    assert num_hit_tokens == 4

    hits, num_hit_tokens = manager.get_computed_blocks(_request("c", prompt + [50]))
    assert _ids(hits) == [0, 1]
    assert num_hit_tokens == 8


def test_admission_with_hits_shares_them_and_allocates_the_rest():
    """Guards against copying hit blocks instead of sharing them, or allocating slots for the hit tokens again."""
    manager = _manager(num_blocks=8)
    first = _request("a", list(range(10, 20)))  # 10 tokens: blocks 0, 1 full, block 2 partial
    assert _admit(manager, first) == [0, 1, 2]

    second = _request("b", list(range(10, 18)) + [60, 61, 62, 63, 64])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    new_blocks = manager.allocate_slots(second, second.num_tokens - num_hit_tokens, hits)

    assert _ids(new_blocks) == [3, 4]
    assert manager.block_ids("b") == [0, 1, 3, 4]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 1, 1, 1]
    manager.check_integrity()


def test_allocate_returns_none_and_changes_nothing_when_blocks_are_short():
    """Guards against a failed allocation that still takes some blocks or registers the request."""
    manager = _manager(num_blocks=3)
    holder = _request("a", list(range(10, 18)))
    _admit(manager, holder)
    before = [(block.ref_cnt, block.block_hash) for block in manager.block_pool.blocks]

    hungry = _request("b", list(range(30, 39)))  # 9 tokens need 3 blocks, 1 is free
    assert manager.allocate_slots(hungry, hungry.num_tokens) is None

    assert [(block.ref_cnt, block.block_hash) for block in manager.block_pool.blocks] == before
    assert manager.num_free_blocks == 1
    assert "b" not in manager.req_to_blocks
    manager.check_integrity()


def test_hits_sitting_in_the_free_queue_are_not_counted_as_allocatable():
    """Guards against counting free-queue hits as both hits and free blocks: the pool would raise mid-allocation."""
    manager = _manager(num_blocks=5)
    first = _request("a", list(range(10, 19)))  # 9 tokens: blocks 0, 1 cached, block 2 partial
    assert _admit(manager, first) == [0, 1, 2]
    manager.free(first)  # all 5 free, 2 of them the cached prefix; queue 3, 4, 2, 1, 0

    too_big = _request("b", list(range(10, 18)) + list(range(40, 53)))  # 21 tokens: 6 blocks, 2 of them hits
    hits, num_hit_tokens = manager.get_computed_blocks(too_big)
    assert (_ids(hits), num_hit_tokens) == ([0, 1], 8)
    assert manager.allocate_slots(too_big, too_big.num_tokens - num_hit_tokens, hits) is None
    assert manager.num_free_blocks == 5
    assert [block.ref_cnt for block in hits] == [0, 0]
    assert "b" not in manager.req_to_blocks

    just_fits = _request("c", list(range(10, 18)) + list(range(40, 52)))  # 20 tokens: 5 blocks, 2 of them hits
    hits, num_hit_tokens = manager.get_computed_blocks(just_fits)
    new_blocks = manager.allocate_slots(just_fits, just_fits.num_tokens - num_hit_tokens, hits)
    assert _ids(new_blocks) == [3, 4, 2]
    assert manager.block_ids("c") == [0, 1, 3, 4, 2]
    assert manager.num_free_blocks == 0
    manager.check_integrity()


def test_decoding_grows_by_exactly_one_block_at_each_block_boundary():
    """Guards against off-by-one slot math: allocating a block too early wastes KV, too late overwrites a neighbour."""
    manager = _manager(num_blocks=4)
    request = _request("a", [1, 2, 3, 4])
    assert _admit(manager, request) == [0]

    grown = [_decode_one(manager, request, token_id) for token_id in range(100, 106)]

    # Tokens 5..8 live in block 1, tokens 9..10 in block 2.
    assert grown == [[1], [], [], [], [2], []]
    assert manager.block_ids("a") == [0, 1, 2]
    manager.check_integrity()


def test_blocks_filled_by_decoded_tokens_join_the_prefix_cache():
    """Guards against caching prompt blocks only: a follow-up turn could not reuse the model's own answer."""
    manager = _manager(num_blocks=6)
    request = _request("a", [1, 2, 3, 4, 5, 6])
    _admit(manager, request)
    for token_id in (7, 8, 9):
        _decode_one(manager, request, token_id)

    follow_up = _request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    hits, num_hit_tokens = manager.get_computed_blocks(follow_up)
    assert _ids(hits) == [0, 1]
    assert num_hit_tokens == 8


def test_free_releases_every_block_and_keeps_shared_ones_for_the_other_holder():
    """Guards against leaks on free and against freeing a prefix block another request still reads."""
    manager = _manager(num_blocks=6)
    first = _request("a", list(range(10, 20)))
    second = _request("b", list(range(10, 20)))
    assert _admit(manager, first) == [0, 1, 2]
    assert _admit(manager, second) == [0, 1, 3]

    manager.free(first)
    manager.check_integrity()
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert manager.block_ids("a") == []

    manager.free(second)
    manager.check_integrity()
    manager.block_pool.check_integrity(expect_all_free=True)
    assert manager.req_to_blocks == {}


def test_freeing_an_unknown_request_is_a_no_op():
    """Guards against an abort of a request that never got blocks raising or corrupting the pool."""
    manager = _manager(num_blocks=2)
    manager.free(_request("never-scheduled", [1, 2, 3]))
    manager.block_pool.check_integrity(expect_all_free=True)


def test_prefix_cache_counters_count_prompt_tokens_queried_and_tokens_hit():
    """Guards against hit-rate metrics counting blocks instead of tokens, or missing misses."""
    manager = _manager(num_blocks=8)
    _admit(manager, _request("a", list(range(10, 20))))  # 10 tokens, no hit
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10, 0)

    _admit(manager, _request("b", list(range(10, 23))))  # 13 tokens, 8 hit
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (23, 8)


def test_caching_disabled_never_hits_and_counts_nothing():
    """Guards against prefix reuse when the user turned it off (e.g. to measure cold prefill)."""
    manager = _manager(num_blocks=8, enable_caching=False)
    prompt = list(range(10, 20))
    assert _admit(manager, _request("a", prompt)) == [0, 1, 2]

    assert manager.get_computed_blocks(_request("b", prompt)) == ([], 0)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    assert all(block.block_hash is None for block in manager.block_pool.blocks)


def test_blocks_before_every_window_go_back_as_a_sequence_grows():
    """Guards the window's arithmetic and its bookkeeping: with a 6-key window a query at p reads
    keys p-5..p, so the blocks wholly before the next query's window return to the pool (the
    table names the null block there, and the runner learns how many); a cached one stays a
    prefix hit; the sequence never holds more than its window's blocks and its step's; freeing
    it returns every block once, and the null block is never handed out."""
    manager = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, enable_caching=True, window=6)
    assert manager.num_free_blocks == 11
    request = _request("a", list(range(10, 19)))  # 9 tokens: blocks of positions 0-3, 4-7, 8
    assert _admit(manager, request) == [1, 2, 3]
    assert manager.blocks_before_window(9) == 1  # the next query (position 9) reads keys 4-9
    held = []
    for token_id in range(40, 60):  # to 29 tokens: 8 blocks' worth
        _decode_one(manager, request, token_id)
        held.append(manager.num_held_blocks("a"))
        manager.check_integrity()
    table = manager.block_ids("a")
    dropped = manager.num_dropped_blocks("a")
    assert dropped == manager.blocks_before_window(28) == 5 and table[:dropped] == [0] * dropped
    assert 0 not in table[dropped:] and len(table) == 8
    assert max(held) <= 3  # a 6-key window and one new token span at most 3 blocks of 4
    assert manager.most_blocks_held(29, 1) == 3 and manager.most_blocks_held(29, 8) == 5  # validate's bound
    assert _manager(num_blocks=12).most_blocks_held(29, 1) == 8  # without a window: every block
    assert manager.num_free_blocks == 11 - 3  # (the null block was never handed out)
    again = _request("b", list(range(10, 19)))  # the first blocks went back cached: still hits
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 8 and _ids(hits) == [1, 2]
    manager.free(request)
    manager.check_integrity()
    assert manager.num_free_blocks == 11 and manager.num_dropped_blocks("a") == 0


def test_a_transfer_past_the_window_skips_the_blocks_nobody_reads():
    """Guards the receiving side: a 13-token context with a 6-key window needs keys 8 on for its
    next step, so the first two blocks are the null block and only the rest is allocated."""
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, enable_caching=True, window=6)
    request = _request("a", list(range(10, 23)))
    skipped = manager.blocks_before_window(13)
    assert skipped == 2
    new_blocks = manager.allocate_for_transfer(request, 13, skipped)
    assert len(new_blocks) == 2 and manager.block_ids("a")[:2] == [0, 0] and manager.num_held_blocks("a") == 2
    request.num_computed_tokens = 13
    manager.cache_received(request)  # the null block is never published
    assert not manager.block_pool.null_block.block_hash
    manager.check_integrity()
    manager.free(request)
    assert manager.num_free_blocks == 5
    manager.check_integrity()


def test_a_windowed_prefix_hit_needs_only_the_blocks_its_window_reads():
    """Guards the windowed lookup: a 17-token prompt cached in blocks 1-4 loses its first two
    blocks to eviction; its next query (position 16) reads keys 11-16 only, so blocks 3 and 4
    still make a 16-token hit, with the null block before them; a window that reaches back
    into an evicted block (position 12 reads keys 7 on) does not count."""
    manager = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, enable_caching=True, window=6)
    first = _request("a", list(range(10, 27)))
    assert _admit(manager, first) == [1, 2, 3, 4, 5]
    manager.free(first)
    manager.block_pool.uncache([manager.block_pool.blocks[1], manager.block_pool.blocks[2]])  # as evicted
    again = _request("b", list(range(10, 27)))
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 16 and _ids(hits) == [0, 0, 3, 4]
    assert manager.allocate_slots(again, 1, hits) is not None
    assert manager.block_ids("b")[:4] == [0, 0, 3, 4] and manager.num_dropped_blocks("b") == 2
    assert manager.num_held_blocks("b") == 3
    manager.check_integrity()
    shorter = _request("c", list(range(10, 23)))  # 13 tokens: a hit of 12 would read keys 7-12
    hits, num_hit_tokens = manager.get_computed_blocks(shorter)
    assert num_hit_tokens == 0 and hits == []
    manager.free(again)
    manager.check_integrity()
    assert manager.num_free_blocks == 11
    plain = _manager(num_blocks=12)  # without a window, a hit needs every block before it
    cached = _request("a", list(range(10, 27)))
    _admit(plain, cached)
    plain.free(cached)
    plain.block_pool.uncache([plain.block_pool.blocks[0]])
    assert plain.get_computed_blocks(_request("b", list(range(10, 27)))) == ([], 0)
