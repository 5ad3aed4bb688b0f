"""The real Scheduler driven step by step by a fake runner (``scheduler_driver``): budgets,
chunking, prefix hits, preemption."""

from duet.outputs import RunnerOutput
from duet.request import RequestStatus
from duet.scheduler import Scheduler
from tests.duet.scheduler_driver import TOKEN, new_request, run_until_done, step


# token budget and order


def test_token_budget_is_respected_and_running_requests_go_before_waiting_ones(make_scheduler):
    """Guards against over-filling a batch, and against new prompts starving requests already running."""
    scheduler = make_scheduler(max_num_batched_tokens=10)
    first, second, third = new_request("a", 6), new_request("b", 6), new_request("c", 9)
    scheduler.add_request(first)
    scheduler.add_request(second)

    step1 = step(scheduler)
    assert step1.num_scheduled_tokens == {"a": 6, "b": 4}

    scheduler.add_request(third)
    step2 = step(scheduler)
    assert list(step2.num_scheduled_tokens.items()) == [("a", 1), ("b", 2), ("c", 7)]

    step3 = step(scheduler)
    assert list(step3.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 2)]
    assert [r.num_output_tokens for r in (first, second, third)] == [3, 2, 1]
    for request_id in ("a", "b", "c"):
        scheduler.abort(request_id)


def test_running_requests_can_use_the_whole_budget_and_leave_nothing_for_waiting_ones(make_scheduler):
    """Guards against admitting a new request with a zero or negative budget (an empty chunk)."""
    scheduler = make_scheduler(max_num_batched_tokens=2)
    scheduler.add_request(new_request("a", 1))
    scheduler.add_request(new_request("b", 1))
    assert step(scheduler).num_scheduled_tokens == {"a": 1, "b": 1}

    scheduler.add_request(new_request("c", 1))
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    for request_id in ("a", "b", "c"):
        scheduler.abort(request_id)


# chunked prefill


def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks(make_scheduler):
    """Guards against a long prompt overrunning the budget, or sampling from a mid-prompt chunk."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = new_request("a", 21, max_tokens=2)
    scheduler.add_request(request)

    chunks, computed, outputs = [], [], []
    for _ in range(4):
        chunks.append(step(scheduler).num_scheduled_tokens.get("a"))
        computed.append(request.num_computed_tokens)
        outputs.append(list(request.output_token_ids))

    assert chunks == [8, 8, 5, 1]
    assert computed == [8, 16, 21, 22]
    assert outputs == [[], [], [TOKEN], [TOKEN, TOKEN]]
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_without_chunked_prefill_a_prompt_larger_than_the_remaining_budget_waits(make_scheduler):
    """Guards against chunking when the user disabled it, and against later arrivals overtaking the waiting prompt."""
    scheduler = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    scheduler.add_request(new_request("a", 6, max_tokens=4))
    scheduler.add_request(new_request("b", 6, max_tokens=1))
    scheduler.add_request(new_request("c", 2, max_tokens=1))

    step1 = step(scheduler)
    assert step1.num_scheduled_tokens == {"a": 6}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]

    step2 = step(scheduler)
    assert list(step2.num_scheduled_tokens.items()) == [("a", 1), ("b", 6), ("c", 2)]
    run_until_done(scheduler)


def test_max_num_seqs_caps_the_running_batch(make_scheduler):
    """Guards against admitting more sequences than the runner's batch (and its buffers) was sized for."""
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.add_request(new_request("a", 3, max_tokens=1))
    scheduler.add_request(new_request("b", 3, max_tokens=3))
    scheduler.add_request(new_request("c", 3, max_tokens=1))

    step1 = step(scheduler)
    assert step1.num_scheduled_tokens == {"a": 3, "b": 3}
    assert [r.request_id for r in scheduler.running] == ["b"]  # a finished after its first token

    step2 = step(scheduler)
    assert list(step2.num_scheduled_tokens.items()) == [("b", 1), ("c", 3)]
    run_until_done(scheduler)


# prefix caching


def test_prefix_hit_skips_cached_blocks_and_schedules_only_the_rest(make_scheduler):
    """Guards against recomputing a cached prefix, or admitting a hit without counting its tokens as computed."""
    scheduler = make_scheduler()
    shared = list(range(500, 508))
    first = new_request("a", shared + [1, 2], max_tokens=1)
    second = new_request("b", shared + [3, 4, 5], max_tokens=1)
    scheduler.add_request(first)
    step1 = step(scheduler)
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
        scheduler.add_request(new_request(request_id, 8, max_tokens=2))
    step1 = step(scheduler)
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

    step2 = step(scheduler)  # a and b each need a 3rd block; none is free

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
    step(scheduler)  # c is preempted; a and b finish

    step3 = step(scheduler)

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

    outputs = run_until_done(scheduler)
    assert [output.finished_request_ids for output in outputs] == [{"c"}, {"d"}]
    assert scheduler.num_preemptions == 1


def test_a_step_that_preempts_admits_nothing_from_the_waiting_queue(make_scheduler):
    """Guards against re-admitting the victim (or anyone) in the step that just ran out of blocks: a small
    leftover budget would let the victim back in as a chunk, thrashing its KV every step."""
    scheduler = make_scheduler(num_blocks=3, max_num_batched_tokens=5, enable_caching=False)
    older = new_request("a", 4, max_tokens=3)
    newest = new_request("b", 5, max_tokens=1)
    scheduler.add_request(older)
    scheduler.add_request(newest)
    assert step(scheduler).num_scheduled_tokens == {"a": 4, "b": 1}

    step2 = step(scheduler)  # a takes the last free block; b cannot grow and is the newest

    assert step2.preempted_request_ids == {"b"}
    assert step2.num_scheduled_tokens == {"a": 1}
    assert scheduler.kv_cache_manager.num_free_blocks == 1

    step3 = step(scheduler)  # b comes back as a 4-token chunk in the next step
    assert list(step3.num_scheduled_tokens.items()) == [("a", 1), ("b", 4)]
    assert step3.new_requests[0].request_id == "b"
    run_until_done(scheduler)
    assert older.output_token_ids == [TOKEN] * 3
    assert newest.output_token_ids == [TOKEN]


def test_newest_request_that_cannot_grow_preempts_itself_and_resumes_from_its_cached_prefix(make_scheduler):
    """Guards against preempting an older request when the newest is the one short of blocks, or losing its prefix."""
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    older = new_request("a", 6, max_tokens=3)
    newest = new_request("b", 12, max_tokens=2)
    scheduler.add_request(older)
    scheduler.add_request(newest)
    step1 = step(scheduler)
    assert [new.block_ids for new in step1.new_requests] == [[0, 1], [2, 3, 4]]

    step2 = step(scheduler)  # b needs a 4th block, none is free, and b is the newest
    assert step2.num_scheduled_tokens == {"a": 1}
    assert step2.preempted_request_ids == {"b"}
    assert older.status == RequestStatus.RUNNING

    step3 = step(scheduler)  # b's 3 cached blocks are hits in the free queue: no room for a 4th yet
    assert step3.num_scheduled_tokens == {"a": 1}
    assert older.is_finished
    assert newest.status == RequestStatus.PREEMPTED

    step4 = step(scheduler)
    assert step4.finished_request_ids == {"a"}
    assert step4.num_scheduled_tokens == {"b": 1}
    (resent,) = step4.new_requests
    assert (resent.block_ids, resent.num_computed_tokens) == ([2, 3, 4, 1], 12)
    assert newest.num_cached_tokens == 12
    assert newest.is_finished
    assert scheduler.num_preemptions == 1
