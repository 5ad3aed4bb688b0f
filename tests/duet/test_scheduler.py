"""The real Scheduler driven step by step by a fake runner: budgets, chunking, prefix hits, preemption, stops, diffs.

The fake runner samples one token for each request whose computed plus scheduled tokens
reach its ``num_tokens`` (the end of its prompt, or a decode step), like ``ModelRunner``.
"""

from collections.abc import Callable

from duet.kv_cache_manager import KVCacheManager
from duet.outputs import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from duet.request import Request, RequestStatus
from duet.sampling_params import SamplingParams
from duet.scheduler import Scheduler
from tests.duet.conftest import BLOCK_SIZE

EOS = 2
TOKEN = 7  # what the fake runner samples unless a test says otherwise


def _request(request_id: str, prompt: list[int] | int, **params) -> Request:
    """A request; an int prompt means that many tokens, distinct per request id so they never share a prefix."""
    if isinstance(prompt, int):
        base = 1000 * (1 + sum(map(ord, request_id)))
        prompt = list(range(base, base + prompt))
    params.setdefault("max_tokens", 16)
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id=EOS)


def _step(scheduler: Scheduler, sample: Callable[[Request], int] = lambda request: TOKEN) -> SchedulerOutput:
    """One engine step with a fake runner that samples ``sample(request)`` where a real one would."""
    output = scheduler.schedule()
    request_ids, sampled = [], []
    for request_id, num_scheduled in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        reaches_end = request.num_computed_tokens + num_scheduled >= request.num_tokens
        request_ids.append(request_id)
        sampled.append([sample(request)] if reaches_end else [])
    scheduler.update_from_output(output, RunnerOutput(request_ids, sampled))
    return output


def _run_until_done(scheduler: Scheduler, max_steps: int = 100, **kwargs) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, "scheduler made no progress"
        outputs.append(_step(scheduler, **kwargs))
    outputs.append(_step(scheduler, **kwargs))  # delivers the last finished ids to the runner
    return outputs


def _script(tokens_by_request: dict[str, list[int]]) -> Callable[[Request], int]:
    """A sampler that returns each request's tokens in order."""
    iterators = {request_id: iter(tokens) for request_id, tokens in tokens_by_request.items()}
    return lambda request: next(iterators[request.request_id])


# token budget and order


def test_token_budget_is_respected_and_running_requests_go_before_waiting_ones(make_scheduler):
    """Guards against over-filling a batch, and against new prompts starving requests already running."""
    scheduler = make_scheduler(max_num_batched_tokens=10)
    first, second, third = _request("a", 6), _request("b", 6), _request("c", 9)
    scheduler.add_request(first)
    scheduler.add_request(second)

    step1 = _step(scheduler)
    assert step1.num_scheduled_tokens == {"a": 6, "b": 4}

    scheduler.add_request(third)
    step2 = _step(scheduler)
    assert list(step2.num_scheduled_tokens.items()) == [("a", 1), ("b", 2), ("c", 7)]

    step3 = _step(scheduler)
    assert list(step3.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 2)]
    assert [r.num_output_tokens for r in (first, second, third)] == [3, 2, 1]
    for request_id in ("a", "b", "c"):
        scheduler.abort(request_id)


def test_running_requests_can_use_the_whole_budget_and_leave_nothing_for_waiting_ones(make_scheduler):
    """Guards against admitting a new request with a zero or negative budget (an empty chunk)."""
    scheduler = make_scheduler(max_num_batched_tokens=2)
    scheduler.add_request(_request("a", 1))
    scheduler.add_request(_request("b", 1))
    assert _step(scheduler).num_scheduled_tokens == {"a": 1, "b": 1}

    scheduler.add_request(_request("c", 1))
    output = _step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    for request_id in ("a", "b", "c"):
        scheduler.abort(request_id)


# chunked prefill


def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks(make_scheduler):
    """Guards against a long prompt overrunning the budget, or sampling from a mid-prompt chunk."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = _request("a", 21, max_tokens=2)
    scheduler.add_request(request)

    chunks, computed, outputs = [], [], []
    for _ in range(4):
        chunks.append(_step(scheduler).num_scheduled_tokens.get("a"))
        computed.append(request.num_computed_tokens)
        outputs.append(list(request.output_token_ids))

    assert chunks == [8, 8, 5, 1]
    assert computed == [8, 16, 21, 22]
    assert outputs == [[], [], [TOKEN], [TOKEN, TOKEN]]
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_without_chunked_prefill_a_prompt_larger_than_the_remaining_budget_waits(make_scheduler):
    """Guards against chunking when the user disabled it, and against later arrivals overtaking the waiting prompt."""
    scheduler = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    scheduler.add_request(_request("a", 6, max_tokens=4))
    scheduler.add_request(_request("b", 6, max_tokens=1))
    scheduler.add_request(_request("c", 2, max_tokens=1))

    step1 = _step(scheduler)
    assert step1.num_scheduled_tokens == {"a": 6}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]

    step2 = _step(scheduler)
    assert list(step2.num_scheduled_tokens.items()) == [("a", 1), ("b", 6), ("c", 2)]
    _run_until_done(scheduler)


def test_max_num_seqs_caps_the_running_batch(make_scheduler):
    """Guards against admitting more sequences than the runner's batch (and its buffers) was sized for."""
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.add_request(_request("a", 3, max_tokens=1))
    scheduler.add_request(_request("b", 3, max_tokens=3))
    scheduler.add_request(_request("c", 3, max_tokens=1))

    step1 = _step(scheduler)
    assert step1.num_scheduled_tokens == {"a": 3, "b": 3}
    assert [r.request_id for r in scheduler.running] == ["b"]  # a finished after its first token

    step2 = _step(scheduler)
    assert list(step2.num_scheduled_tokens.items()) == [("b", 1), ("c", 3)]
    _run_until_done(scheduler)


# prefix caching


def test_prefix_hit_skips_cached_blocks_and_schedules_only_the_rest(make_scheduler):
    """Guards against recomputing a cached prefix, or admitting a hit without counting its tokens as computed."""
    scheduler = make_scheduler()
    shared = list(range(500, 508))
    first = _request("a", shared + [1, 2], max_tokens=1)
    second = _request("b", shared + [3, 4, 5], max_tokens=1)
    scheduler.add_request(first)
    step1 = _step(scheduler)
    assert step1.num_scheduled_tokens == {"a": 10}
    assert step1.new_requests[0].block_ids == [0, 1, 2]

    scheduler.add_request(second)
    step2 = scheduler.schedule()

    assert step2.num_scheduled_tokens == {"b": 3}
    assert second.num_computed_tokens == 8
    assert second.num_cached_tokens == 8
    (new,) = step2.new_requests
    assert (new.block_ids, new.num_computed_tokens) == ([0, 1, 3], 8)
    assert step2.finished_request_ids == {"a"}
    scheduler.update_from_output(step2, RunnerOutput(["b"], [[TOKEN]]))
    assert second.is_finished
    assert (scheduler.kv_cache_manager.prefix_cache_queries, scheduler.kv_cache_manager.prefix_cache_hits) == (21, 8)


# preemption


def _three_running_and_one_waiting(make_scheduler) -> Scheduler:
    """6 blocks, all held by a, b, c (8-token prompts, 2 blocks each); d waits for a seat."""
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=3)
    for request_id in ("a", "b", "c", "d"):
        scheduler.add_request(_request(request_id, 8, max_tokens=2))
    step1 = _step(scheduler)
    assert [(new.request_id, new.block_ids) for new in step1.new_requests] == [
        ("a", [0, 1]),
        ("b", [2, 3]),
        ("c", [4, 5]),
    ]
    return scheduler


def test_out_of_blocks_preempts_the_newest_running_request_by_recompute(make_scheduler):
    """Guards against preempting the request that asked (or the oldest), against a victim keeping blocks or
    progress, and against queueing it behind later arrivals."""
    scheduler = _three_running_and_one_waiting(make_scheduler)
    first, second, newest = (scheduler.requests[request_id] for request_id in ("a", "b", "c"))

    step2 = _step(scheduler)  # a and b each need a 3rd block; none is free

    assert step2.preempted_request_ids == {"c"}
    assert step2.num_scheduled_tokens == {"a": 1, "b": 1}
    # The victim's blocks were freed tail first (5, then 4), so the older requests get them in that order.
    assert [(c.request_id, c.new_block_ids) for c in step2.cached_requests] == [("a", [5]), ("b", [4])]
    assert newest.status == RequestStatus.PREEMPTED
    assert newest.num_computed_tokens == 0
    assert newest.output_token_ids == [TOKEN]  # recompute keeps what was generated
    assert newest.num_preemptions == 1
    assert scheduler.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    assert scheduler.kv_cache_manager.block_ids("c") == []
    assert first.is_finished and second.is_finished


def test_preempted_request_resumes_first_is_resent_whole_and_finishes(make_scheduler):
    """Guards against a resumed request sent as a diff to a runner that dropped it, or never rescheduled (deadlock)."""
    scheduler = _three_running_and_one_waiting(make_scheduler)
    newest = scheduler.requests["c"]
    _step(scheduler)  # c is preempted; a and b finish

    step3 = _step(scheduler)

    assert step3.finished_request_ids == {"a", "b"}
    # c: its prompt plus its first output token, from scratch, ahead of d.
    assert list(step3.num_scheduled_tokens.items()) == [("c", 9), ("d", 8)]
    assert step3.cached_requests == []
    resent, _ = step3.new_requests
    assert resent.request_id == "c"
    assert resent.output_token_ids == [TOKEN]
    assert resent.num_computed_tokens == 0
    # Free queue after a then b finished tail first: 5, 1, 0, 4, 3, 2 (c's own cached blocks went to a and b: no hit).
    assert resent.block_ids == [5, 1, 0]
    assert step3.new_requests[1].block_ids == [4, 3]
    assert newest.status == RequestStatus.FINISHED_LENGTH
    assert newest.output_token_ids == [TOKEN, TOKEN]

    outputs = _run_until_done(scheduler)
    assert [output.finished_request_ids for output in outputs] == [{"c"}, {"d"}]
    assert scheduler.num_preemptions == 1


def test_a_step_that_preempts_admits_nothing_from_the_waiting_queue(make_scheduler):
    """Guards against re-admitting the victim (or anyone) in the step that just ran out of blocks: a small
    leftover budget would let the victim back in as a chunk, thrashing its KV every step."""
    scheduler = make_scheduler(num_blocks=3, max_num_batched_tokens=5, enable_caching=False)
    older = _request("a", 4, max_tokens=3)
    newest = _request("b", 5, max_tokens=1)
    scheduler.add_request(older)
    scheduler.add_request(newest)
    assert _step(scheduler).num_scheduled_tokens == {"a": 4, "b": 1}

    step2 = _step(scheduler)  # a takes the last free block; b cannot grow and is the newest

    assert step2.preempted_request_ids == {"b"}
    assert step2.num_scheduled_tokens == {"a": 1}
    assert scheduler.kv_cache_manager.num_free_blocks == 1

    step3 = _step(scheduler)  # b comes back as a 4-token chunk in the next step
    assert list(step3.num_scheduled_tokens.items()) == [("a", 1), ("b", 4)]
    assert step3.new_requests[0].request_id == "b"
    _run_until_done(scheduler)
    assert older.output_token_ids == [TOKEN] * 3
    assert newest.output_token_ids == [TOKEN]


def test_newest_request_that_cannot_grow_preempts_itself_and_resumes_from_its_cached_prefix(make_scheduler):
    """Guards against preempting an older request when the newest is the one short of blocks, or losing its prefix."""
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    older = _request("a", 6, max_tokens=3)
    newest = _request("b", 12, max_tokens=2)
    scheduler.add_request(older)
    scheduler.add_request(newest)
    step1 = _step(scheduler)
    assert [new.block_ids for new in step1.new_requests] == [[0, 1], [2, 3, 4]]

    step2 = _step(scheduler)  # b needs a 4th block, none is free, and b is the newest
    assert step2.num_scheduled_tokens == {"a": 1}
    assert step2.preempted_request_ids == {"b"}
    assert older.status == RequestStatus.RUNNING

    step3 = _step(scheduler)  # b's 3 cached blocks are hits in the free queue: no room for a 4th yet
    assert step3.num_scheduled_tokens == {"a": 1}
    assert older.is_finished
    assert newest.status == RequestStatus.PREEMPTED

    step4 = _step(scheduler)
    assert step4.finished_request_ids == {"a"}
    assert step4.num_scheduled_tokens == {"b": 1}
    (resent,) = step4.new_requests
    assert (resent.block_ids, resent.num_computed_tokens) == ([2, 3, 4, 1], 12)
    assert newest.num_cached_tokens == 12
    assert newest.is_finished
    assert scheduler.num_preemptions == 1


# stop conditions


def _finish_alone(make_scheduler, request: Request, sample=lambda request: TOKEN, **scheduler_args) -> Request:
    scheduler = make_scheduler(**scheduler_args)
    scheduler.add_request(request)
    _run_until_done(scheduler, sample=sample)
    return request


def test_eos_stops_the_request(make_scheduler):
    """Guards against generating past the end-of-sequence token."""
    request = _finish_alone(make_scheduler, _request("a", 3), sample=_script({"a": [5, EOS, 6]}))
    assert request.output_token_ids == [5, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.finish_reason == "stop"
    assert request.stop_reason is None


def test_ignore_eos_runs_to_max_tokens(make_scheduler):
    """Guards against ignore_eos being ignored (benchmarks rely on fixed-length outputs)."""
    request = _finish_alone(make_scheduler, _request("a", 3, max_tokens=3, ignore_eos=True), sample=lambda r: EOS)
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids_stop_and_record_the_token(make_scheduler):
    """Guards against stop_token_ids being ignored, or the API reporting no stop_reason."""
    request = _finish_alone(
        make_scheduler, _request("a", 3, stop_token_ids=[9, 11]), sample=_script({"a": [5, 11, 6]})
    )
    assert request.output_token_ids == [5, 11]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 11


def test_max_tokens_stops_with_length(make_scheduler):
    """Guards against an off-by-one in the output length limit."""
    request = _finish_alone(make_scheduler, _request("a", 3, max_tokens=3))
    assert request.output_token_ids == [TOKEN, TOKEN, TOKEN]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.finish_reason == "length"


def test_min_tokens_delays_eos_and_stop_tokens(make_scheduler):
    """Guards against stopping on eos or a stop token before min_tokens outputs exist."""
    request = _finish_alone(make_scheduler, _request("a", 3, min_tokens=3), sample=lambda r: EOS)
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED

    request = _finish_alone(
        make_scheduler, _request("b", 3, min_tokens=2, stop_token_ids=[9]), sample=_script({"b": [9, 9, 5]})
    )
    assert request.output_token_ids == [9, 9]
    assert request.stop_reason == 9


def test_max_model_len_stops_with_length(make_scheduler):
    """Guards against a sequence growing past the model's positions when max_tokens is unset."""
    request = _finish_alone(make_scheduler, _request("a", 6, max_tokens=None), max_model_len=8)
    assert request.output_token_ids == [TOKEN, TOKEN]
    assert request.num_tokens == 8
    assert request.status == RequestStatus.FINISHED_LENGTH


# abort and finished ids


def test_abort_running_request_frees_its_blocks_and_tells_the_runner_once(make_scheduler):
    """Guards against an aborted request leaking blocks, or the runner keeping (or re-dropping) its state."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = _request("a", 21)
    scheduler.add_request(request)
    _step(scheduler)  # mid-prompt: 8 of 21 tokens computed, 2 blocks held
    assert scheduler.kv_cache_manager.block_ids("a") == [0, 1]

    scheduler.abort("a")

    assert request.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.running == []
    assert scheduler.kv_cache_manager.num_free_blocks == 32
    assert _step(scheduler).finished_request_ids == {"a"}
    assert _step(scheduler).finished_request_ids == set()


def test_abort_waiting_request_removes_it_without_telling_the_runner(make_scheduler):
    """Guards against aborting only running requests, and against finishing ids the runner never saw."""
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(_request("a", 3, max_tokens=2))
    scheduler.add_request(_request("b", 3))
    _step(scheduler)
    assert [r.request_id for r in scheduler.waiting] == ["b"]

    scheduler.abort("b")

    assert list(scheduler.waiting) == []
    assert "b" not in scheduler.requests
    outputs = _run_until_done(scheduler)
    assert [output.finished_request_ids for output in outputs] == [set(), {"a"}]


def test_abort_preempted_request_holds_no_blocks_and_is_not_reported_finished(make_scheduler):
    """Guards against a preempted-then-aborted request being freed twice or reported to a runner that dropped it."""
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(_request("a", 8, max_tokens=3))
    scheduler.add_request(_request("b", 8, max_tokens=3))
    _step(scheduler)
    assert _step(scheduler).preempted_request_ids == {"b"}

    scheduler.abort("b")

    outputs = _run_until_done(scheduler)
    assert [output.finished_request_ids for output in outputs] == [set(), {"a"}]


def test_finished_ids_reach_the_runner_exactly_once(make_scheduler):
    """Guards against the runner never freeing a finished request's state, or being told twice."""
    scheduler = make_scheduler()
    scheduler.add_request(_request("a", 3, max_tokens=1))
    scheduler.add_request(_request("b", 3, max_tokens=3))

    finished = [_step(scheduler).finished_request_ids for _ in range(5)]

    assert finished == [set(), {"a"}, set(), {"b"}, set()]


def test_finished_ids_ride_on_an_otherwise_empty_output(make_scheduler):
    """Guards against dropping finished ids when nothing is left to compute: ``is_empty`` means no tokens, not
    nothing for the runner, so a caller that skips empty outputs leaks the runner's per-request state."""
    scheduler = make_scheduler()
    scheduler.add_request(_request("a", 3))
    _step(scheduler)
    scheduler.abort("a")

    output = scheduler.schedule()

    assert output.is_empty
    assert output.finished_request_ids == {"a"}
    assert scheduler.schedule().finished_request_ids == set()


# what the runner is sent


def test_new_requests_are_sent_whole_once_then_as_diffs_with_only_new_blocks(make_scheduler):
    """Guards against re-sending whole requests every step, or diffs that repeat or miss block ids."""
    scheduler = make_scheduler()
    scheduler.add_request(_request("a", 3, max_tokens=6))
    prompt = list(scheduler.requests["a"].prompt_token_ids)

    step1 = _step(scheduler)
    assert step1.new_requests == [
        NewRequestData("a", prompt, [], scheduler.requests["a"].sampling_params, [0], 0, prompt_len=len(prompt))
    ]
    assert step1.cached_requests == []

    diffs = []
    for _ in range(5):
        output = _step(scheduler)
        assert output.new_requests == []
        diffs.extend(output.cached_requests)

    # 4 tokens fill block 0; the 5th token (scheduled at step 3) opens block 1.
    assert diffs == [
        CachedRequestData("a", [], 3, 1),
        CachedRequestData("a", [1], 4, 1),
        CachedRequestData("a", [], 5, 2),
        CachedRequestData("a", [], 6, 2),
        CachedRequestData("a", [], 7, 2),
    ]
    assert scheduler.requests == {}


def test_prefix_cache_counters_count_a_waiting_request_once_when_admitted():
    """Guards against inflated hit-rate metrics: a request retried while blocked was counted every step."""
    # "first" holds all 3 blocks until it finishes, so "second" waits, looked up every step.
    manager = KVCacheManager(num_blocks=3, block_size=4, enable_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    first = Request("first", list(range(10, 18)), SamplingParams(max_tokens=2), eos_token_id=None)
    second = Request("second", list(range(30, 38)), SamplingParams(max_tokens=2), eos_token_id=None)
    scheduler.add_request(first)
    scheduler.add_request(second)
    for _ in range(4):
        output = scheduler.schedule()
        sampled = [[7] if scheduler.requests[r].num_computed_tokens + n == scheduler.requests[r].num_tokens else []
                   for r, n in output.num_scheduled_tokens.items()]
        scheduler.update_from_output(output, RunnerOutput(list(output.num_scheduled_tokens), sampled))
    assert manager.prefix_cache_queries == 16


# a failed step


def test_a_failed_step_withdraws_the_blocks_it_published_and_reruns_its_requests_one_at_a_time(make_scheduler):
    """Guards the engine state after a step raised: before, the runner and scheduler disagreed
    (KeyError on every later step), and blocks published for KV never computed stayed findable
    in the prefix cache. The step's requests restart (first in line) as suspects, each run alone
    until it passes a step; a prefix computed by an earlier step is still a hit."""
    scheduler = make_scheduler()
    shared = list(range(500, 508))
    first = _request("a", shared + [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=3)
    scheduler.add_request(first)
    _step(scheduler)  # a: 16 tokens, blocks 0-3 published, first token sampled
    second = _request("b", shared + [9, 9, 9, 9], max_tokens=3)
    third = _request("c", 6, max_tokens=3)
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
    assert _step(scheduler).num_scheduled_tokens == {"b": 4}  # its shared block is still a hit
    assert _step(scheduler).num_scheduled_tokens == {"c": 6}
    assert scheduler.suspects == []
    _run_until_done(scheduler)
    assert [r.output_token_ids for r in (first, second, third)] == [[TOKEN] * 3] * 3


def test_a_step_that_fails_with_one_suspect_alone_fails_that_request_only(make_scheduler):
    """The request a failure follows is the one failed (finish reason 'error'); the others,
    rerun alone before and after it, finish normally and no block is leaked."""
    scheduler = make_scheduler()
    good, bad = _request("good", 5, max_tokens=2), _request("bad", 5, max_tokens=2)
    scheduler.add_request(good)
    scheduler.add_request(bad)
    assert scheduler.reset_step(scheduler.schedule()) == []
    _step(scheduler)  # good passes alone
    assert scheduler.suspects == ["bad"]
    failed = scheduler.reset_step(scheduler.schedule())
    assert failed == [bad] and bad.finish_reason == "error"
    assert scheduler.suspects == [] and "bad" not in scheduler.requests
    _run_until_done(scheduler)
    assert good.output_token_ids == [TOKEN, TOKEN]


def test_a_request_failed_alone_withdraws_the_blocks_it_never_computed(make_scheduler):
    """Guards against stale KV read as a prefix hit: a suspect's step publishes its full blocks
    as it allocates them; when that step failed before computing them, the request was failed
    with its hashes left in the cache, and the same prompt sent again hit them."""
    scheduler = make_scheduler()
    good, bad = _request("good", 5, max_tokens=2), _request("bad", 13, max_tokens=2)
    scheduler.add_request(good)
    scheduler.add_request(bad)
    assert scheduler.reset_step(scheduler.schedule()) == []
    _step(scheduler)  # good passes alone
    alone = scheduler.schedule()
    assert alone.num_scheduled_tokens == {"bad": 13}
    assert scheduler.kv_cache_manager.block_pool.is_cached(_hash_of(bad.prompt_token_ids, 3))
    assert scheduler.reset_step(alone) == [bad]
    assert not scheduler.kv_cache_manager.block_pool.is_cached(_hash_of(bad.prompt_token_ids, 1))
    again = _request("again", bad.prompt_token_ids, max_tokens=2)
    scheduler.add_request(again)
    _run_until_done(scheduler)
    assert again.num_cached_tokens == 0 and again.output_token_ids == [TOKEN, TOKEN]


def test_a_suspect_that_needs_the_blocks_of_the_others_held_still_gets_them(make_scheduler):
    """Guards against a replica that stopped after a failed step: while its suspects rerun one
    by one, the other running requests are held still; a suspect that needed their blocks gave
    way to itself, again and again, and nothing ever freed one. The others give way now."""
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=8)
    decoding = _request("c", 16, max_tokens=8)
    scheduler.add_request(decoding)
    _step(scheduler)
    _step(scheduler)  # c decodes, holding 5 of the 8 blocks
    prompt = _request("a", 20, max_tokens=4)  # 5 blocks
    scheduler.add_request(prompt)
    assert scheduler.reset_step(scheduler.schedule()) == []
    assert scheduler.suspects == ["c", "a"]
    _run_until_done(scheduler, max_steps=40)
    assert (decoding.output_token_ids, prompt.output_token_ids) == ([TOKEN] * 8, [TOKEN] * 4)


def test_a_prompt_one_token_short_of_its_end_is_not_frozen_for_a_move(make_scheduler):
    """Guards a live migration by KV of a request still in its prompt: a chunk that ended one
    token short looked like a sequence between two decode steps; its move shipped KV never
    computed, and the destination appended no token as its first (the request then failed)."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = _request("m", 9, max_tokens=2)
    scheduler.add_request(request)
    _step(scheduler)
    assert request.num_computed_tokens == 8 and scheduler.freeze("m") is None
    _step(scheduler)
    assert scheduler.freeze("m") == [TOKEN]
    scheduler.unfreeze("m")
    _run_until_done(scheduler)
    assert request.output_token_ids == [TOKEN, TOKEN]


def _hash_of(token_ids: list[int], num_blocks: int) -> int:
    from duet.block_pool import hash_block_tokens

    parent = None
    for index in range(num_blocks):
        parent = hash_block_tokens(parent, token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
    return parent
