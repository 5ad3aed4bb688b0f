"""The real Scheduler driven step by step by a fake runner (``scheduler_driver``): stops, aborts,
finished ids, the diffs sent to the runner, the prefix cache's counters."""

from duet.kv_cache_manager import KVCacheManager
from duet.outputs import CachedRequestData, NewRequestData, RunnerOutput
from duet.request import Request, RequestStatus
from duet.sampling_params import SamplingParams
from duet.scheduler import Scheduler
from tests.duet.scheduler_driver import EOS, TOKEN, new_request, run_until_done, scripted, step


# stop conditions


def _finish_alone(make_scheduler, request: Request, sample=lambda request: TOKEN, **scheduler_args) -> Request:
    scheduler = make_scheduler(**scheduler_args)
    scheduler.add_request(request)
    run_until_done(scheduler, sample=sample)
    return request


def test_eos_stops_the_request(make_scheduler):
    """Guards against generating past the end-of-sequence token."""
    request = _finish_alone(make_scheduler, new_request("a", 3), sample=scripted({"a": [5, EOS, 6]}))
    assert request.output_token_ids == [5, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.finish_reason == "stop"
    assert request.stop_reason is None


def test_ignore_eos_runs_to_max_tokens(make_scheduler):
    """Guards against ignore_eos being ignored (benchmarks rely on fixed-length outputs)."""
    request = _finish_alone(make_scheduler, new_request("a", 3, max_tokens=3, ignore_eos=True), sample=lambda r: EOS)
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids_stop_and_record_the_token(make_scheduler):
    """Guards against stop_token_ids being ignored, or the API reporting no stop_reason."""
    request = _finish_alone(
        make_scheduler, new_request("a", 3, stop_token_ids=[9, 11]), sample=scripted({"a": [5, 11, 6]})
    )
    assert request.output_token_ids == [5, 11]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 11


def test_max_tokens_stops_with_length(make_scheduler):
    """Guards against an off-by-one in the output length limit."""
    request = _finish_alone(make_scheduler, new_request("a", 3, max_tokens=3))
    assert request.output_token_ids == [TOKEN, TOKEN, TOKEN]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.finish_reason == "length"


def test_min_tokens_delays_eos_and_stop_tokens(make_scheduler):
    """Guards against stopping on eos or a stop token before min_tokens outputs exist."""
    request = _finish_alone(make_scheduler, new_request("a", 3, min_tokens=3), sample=lambda r: EOS)
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED

    request = _finish_alone(
        make_scheduler, new_request("b", 3, min_tokens=2, stop_token_ids=[9]), sample=scripted({"b": [9, 9, 5]})
    )
    assert request.output_token_ids == [9, 9]
    assert request.stop_reason == 9


def test_max_model_len_stops_with_length(make_scheduler):
    """Guards against a sequence growing past the model's positions when max_tokens is unset."""
    request = _finish_alone(make_scheduler, new_request("a", 6, max_tokens=None), max_model_len=8)
    assert request.output_token_ids == [TOKEN, TOKEN]
    assert request.num_tokens == 8
    assert request.status == RequestStatus.FINISHED_LENGTH


# abort and finished ids


def test_abort_running_request_frees_its_blocks_and_tells_the_runner_once(make_scheduler):
    """Guards against an aborted request leaking blocks, or the runner keeping (or re-dropping) its state."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = new_request("a", 21)
    scheduler.add_request(request)
    step(scheduler)  # mid-prompt: 8 of 21 tokens computed, 2 blocks held
    assert scheduler.kv_cache_manager.block_ids("a") == [0, 1]

    scheduler.abort("a")

    assert request.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.running == []
    assert scheduler.kv_cache_manager.num_free_blocks == 32
    assert step(scheduler).finished_request_ids == {"a"}
    assert step(scheduler).finished_request_ids == set()


def test_abort_waiting_request_removes_it_without_telling_the_runner(make_scheduler):
    """Guards against aborting only running requests, and against finishing ids the runner never saw."""
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(new_request("a", 3, max_tokens=2))
    scheduler.add_request(new_request("b", 3))
    step(scheduler)
    assert [r.request_id for r in scheduler.waiting] == ["b"]

    scheduler.abort("b")

    assert list(scheduler.waiting) == []
    assert "b" not in scheduler.requests
    outputs = run_until_done(scheduler)
    assert [output.finished_request_ids for output in outputs] == [set(), {"a"}]


def test_abort_preempted_request_holds_no_blocks_and_is_not_reported_finished(make_scheduler):
    """Guards against a preempted-then-aborted request being freed twice or reported to a runner that dropped it."""
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(new_request("a", 8, max_tokens=3))
    scheduler.add_request(new_request("b", 8, max_tokens=3))
    step(scheduler)
    assert step(scheduler).preempted_request_ids == {"b"}

    scheduler.abort("b")

    outputs = run_until_done(scheduler)
    assert [output.finished_request_ids for output in outputs] == [set(), {"a"}]


def test_finished_ids_reach_the_runner_exactly_once(make_scheduler):
    """Guards against the runner never freeing a finished request's state, or being told twice."""
    scheduler = make_scheduler()
    scheduler.add_request(new_request("a", 3, max_tokens=1))
    scheduler.add_request(new_request("b", 3, max_tokens=3))

    finished = [step(scheduler).finished_request_ids for _ in range(5)]

    assert finished == [set(), {"a"}, set(), {"b"}, set()]


def test_finished_ids_ride_on_an_otherwise_empty_output(make_scheduler):
    """Guards against dropping finished ids when nothing is left to compute: ``is_empty`` means no tokens, not
    nothing for the runner, so a caller that skips empty outputs leaks the runner's per-request state."""
    scheduler = make_scheduler()
    scheduler.add_request(new_request("a", 3))
    step(scheduler)
    scheduler.abort("a")

    output = scheduler.schedule()

    assert output.is_empty
    assert output.finished_request_ids == {"a"}
    assert scheduler.schedule().finished_request_ids == set()


# what the runner is sent


def test_new_requests_are_sent_whole_once_then_as_diffs_with_only_new_blocks(make_scheduler):
    """Guards against re-sending whole requests every step, or diffs that repeat or miss block ids."""
    scheduler = make_scheduler()
    scheduler.add_request(new_request("a", 3, max_tokens=6))
    prompt = list(scheduler.requests["a"].prompt_token_ids)

    step1 = step(scheduler)
    assert step1.new_requests == [
        NewRequestData("a", prompt, [], scheduler.requests["a"].sampling_params, [0], 0, prompt_len=len(prompt))
    ]
    assert step1.cached_requests == []

    diffs = []
    for _ in range(5):
        output = step(scheduler)
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
