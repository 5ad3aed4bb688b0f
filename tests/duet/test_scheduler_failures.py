"""The real Scheduler driven step by step by a fake runner (``scheduler_driver``): a failed step,
its requests rerun one at a time, the suspect failed alone."""

from duet.outputs import RunnerOutput
from tests.duet.conftest import BLOCK_SIZE
from tests.duet.scheduler_driver import TOKEN, new_request, run_until_done, step


# a failed step


def test_a_failed_step_withdraws_the_blocks_it_published_and_reruns_its_requests_one_at_a_time(make_scheduler):
    """Guards the engine state after a step raised: before, the runner and scheduler disagreed
    (KeyError on every later step), and blocks published for KV never computed stayed findable
    in the prefix cache. The step's requests restart (first in line) as suspects, each run alone
    until it passes a step; a prefix computed by an earlier step is still a hit."""
    scheduler = make_scheduler()
    shared = list(range(500, 508))
    first = new_request("a", shared + [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=3)
    scheduler.add_request(first)
    step(scheduler)  # a: 16 tokens, blocks 0-3 published, first token sampled
    second = new_request("b", shared + [9, 9, 9, 9], max_tokens=3)
    third = new_request("c", 6, max_tokens=3)
    scheduler.add_request(second)
    scheduler.add_request(third)
    failed = scheduler.schedule()
    assert failed.num_scheduled_tokens == {"a": 1, "b": 4, "c": 6}
    assert scheduler.kv_cache_manager.block_pool.is_cached(fresh := _hash_of(shared + [9] * 4, 3))

    assert scheduler.reset_step(failed) == []

    assert not scheduler.kv_cache_manager.block_pool.is_cached(fresh)  # b's third block was never computed
    assert scheduler.kv_cache_manager.block_pool.is_cached(_hash_of(shared, 2))  # a computed these
    assert [request.request_id for request in scheduler.waiting] == ["a", "b", "c"]
    assert scheduler.suspects == ["a", "b", "c"] and not scheduler.running
    alone = scheduler.schedule()
    assert alone.num_scheduled_tokens == {"a": 1}  # 16 prompt tokens hit, its output token recomputed
    assert [new.request_id for new in alone.new_requests] == ["a"]
    scheduler.update_from_output(alone, RunnerOutput(["a"], [[TOKEN]]))
    assert scheduler.suspects == ["b", "c"]
    assert step(scheduler).num_scheduled_tokens == {"b": 4}  # its shared block is still a hit
    assert step(scheduler).num_scheduled_tokens == {"c": 6}
    assert scheduler.suspects == []
    run_until_done(scheduler)
    assert [r.output_token_ids for r in (first, second, third)] == [[TOKEN] * 3] * 3


def test_a_step_that_fails_with_one_suspect_alone_fails_that_request_only(make_scheduler):
    """The request a failure follows is the one failed (finish reason 'error'); the others,
    rerun alone before and after it, finish normally and no block is leaked."""
    scheduler = make_scheduler()
    good, bad = new_request("good", 5, max_tokens=2), new_request("bad", 5, max_tokens=2)
    scheduler.add_request(good)
    scheduler.add_request(bad)
    assert scheduler.reset_step(scheduler.schedule()) == []
    step(scheduler)  # good passes alone
    assert scheduler.suspects == ["bad"]
    failed = scheduler.reset_step(scheduler.schedule())
    assert failed == [bad] and bad.finish_reason == "error"
    assert scheduler.suspects == [] and "bad" not in scheduler.requests
    run_until_done(scheduler)
    assert good.output_token_ids == [TOKEN, TOKEN]


def test_a_request_failed_alone_withdraws_the_blocks_it_never_computed(make_scheduler):
    """Guards against stale KV read as a prefix hit: a suspect's step publishes its full blocks
    as it allocates them; when that step failed before computing them, the request was failed
    with its hashes left in the cache, and the same prompt sent again hit them."""
    scheduler = make_scheduler()
    good, bad = new_request("good", 5, max_tokens=2), new_request("bad", 13, max_tokens=2)
    scheduler.add_request(good)
    scheduler.add_request(bad)
    assert scheduler.reset_step(scheduler.schedule()) == []
    step(scheduler)  # good passes alone
    alone = scheduler.schedule()
    assert alone.num_scheduled_tokens == {"bad": 13}
    assert scheduler.kv_cache_manager.block_pool.is_cached(_hash_of(bad.prompt_token_ids, 3))
    assert scheduler.reset_step(alone) == [bad]
    assert not scheduler.kv_cache_manager.block_pool.is_cached(_hash_of(bad.prompt_token_ids, 1))
    again = new_request("again", bad.prompt_token_ids, max_tokens=2)
    scheduler.add_request(again)
    run_until_done(scheduler)
    assert again.num_cached_tokens == 0 and again.output_token_ids == [TOKEN, TOKEN]


def test_a_suspect_that_needs_the_blocks_of_the_others_held_still_gets_them(make_scheduler):
    """Guards against a replica that stopped after a failed step: while its suspects rerun one
    by one, the other running requests are held still; a suspect that needed their blocks gave
    way to itself, again and again, and nothing ever freed one. The others give way now."""
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=8)
    decoding = new_request("c", 16, max_tokens=8)
    scheduler.add_request(decoding)
    step(scheduler)
    step(scheduler)  # c decodes, holding 5 of the 8 blocks
    prompt = new_request("a", 20, max_tokens=4)  # 5 blocks
    scheduler.add_request(prompt)
    assert scheduler.reset_step(scheduler.schedule()) == []
    assert scheduler.suspects == ["c", "a"]
    run_until_done(scheduler, max_steps=40)
    assert (decoding.output_token_ids, prompt.output_token_ids) == ([TOKEN] * 8, [TOKEN] * 4)


def test_a_prompt_one_token_short_of_its_end_is_not_frozen_for_a_move(make_scheduler):
    """Guards a live migration by KV of a request still in its prompt: a chunk that ended one
    token short looked like a sequence between two decode steps; its move shipped KV never
    computed, and the destination appended no token as its first (the request then failed)."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = new_request("m", 9, max_tokens=2)
    scheduler.add_request(request)
    step(scheduler)
    assert request.num_computed_tokens == 8 and scheduler.freeze("m") is None
    step(scheduler)
    assert scheduler.freeze("m") == [TOKEN]
    scheduler.unfreeze("m")
    run_until_done(scheduler)
    assert request.output_token_ids == [TOKEN, TOKEN]


def _hash_of(token_ids: list[int], num_blocks: int) -> int:
    from duet.block_pool import hash_block_tokens

    parent = None
    for index in range(num_blocks):
        parent = hash_block_tokens(parent, token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
    return parent
