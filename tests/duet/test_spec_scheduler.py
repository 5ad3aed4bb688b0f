"""The scheduler's side of speculation, driven by hand: drafts in the token budget, computed
counts after partial acceptance, slots of rejected drafts freed, stops inside an accepted run."""

from duet.kv_cache_manager import KVCacheManager
from duet.outputs import RunnerOutput
from duet.request import Request, RequestStatus
from duet.sampling_params import SamplingParams
from duet.scheduler import Scheduler

BLOCK_SIZE = 4
EOS = 2


def _scheduler(budget: int = 64, lookahead: int = 0, num_blocks: int = 32) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK_SIZE, True), 8, budget, 128, True, lookahead)


def _decoding_request(scheduler: Scheduler, request_id: str = "a", prompt_len: int = 6, **params) -> Request:
    """A request past its prompt step, holding its first sampled token (id 50)."""
    request = Request(request_id, list(range(100, 100 + prompt_len)), SamplingParams(temperature=0.0, **params), EOS)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, RunnerOutput([request_id], [[50]]))
    return request


def _step(scheduler: Scheduler, sampled: dict[str, list[int]], drafts: dict[str, list[int]] | None = None):
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    scheduler.update_from_output(output, RunnerOutput(ids, [sampled.get(i, []) for i in ids], draft_token_ids=drafts or {}))
    return output


def test_drafts_are_scheduled_after_the_last_token_and_count_against_the_budget():
    scheduler = _scheduler()
    request = _decoding_request(scheduler)
    request.spec_token_ids = [60, 61, 62]
    output = _step(scheduler, {"a": [60, 61, 70]})
    assert output.num_scheduled_tokens == {"a": 4}
    assert output.scheduled_spec_token_ids == {"a": [60, 61, 62]}
    # Two drafts kept, the third rejected and replaced: its KV slot does not count as computed.
    assert request.output_token_ids == [50, 60, 61, 70]
    assert request.num_computed_tokens == 6 + 3
    assert scheduler.spec_stats.num_drafts == 1
    assert scheduler.spec_stats.num_accepted_tokens == 2
    assert scheduler.spec_stats.accepted_per_position == [1, 1, 0]


def test_a_tight_budget_cuts_drafts_from_the_end():
    scheduler = _scheduler(budget=3)
    request = _decoding_request(scheduler, prompt_len=3)
    request.spec_token_ids = [60, 61, 62, 63]
    output = _step(scheduler, {"a": [60, 61, 71]})
    assert output.scheduled_spec_token_ids == {"a": [60, 61]}
    assert request.num_computed_tokens == 3 + 3


def test_blocks_holding_only_rejected_drafts_are_freed():
    scheduler = _scheduler()
    manager = scheduler.kv_cache_manager
    request = _decoding_request(scheduler, prompt_len=7)  # 8 tokens: exactly 2 blocks
    request.spec_token_ids = [60, 61, 62, 63, 64]
    _step(scheduler, {"a": [80]})  # 9 tokens in 3 blocks; the draft slots' block is kept
    assert len(manager.req_to_blocks["a"]) == 3
    request.spec_token_ids = [60, 61, 62, 63, 64]
    free_before = manager.num_free_blocks
    output = _step(scheduler, {"a": [81]})
    assert output.num_scheduled_tokens == {"a": 6}
    # Slots up to position 13 took a 4th block; all drafts were rejected, so 10 tokens fit in 3.
    assert len(manager.req_to_blocks["a"]) == 3
    assert manager.num_free_blocks == free_before
    manager.check_integrity()


def test_lookahead_reserves_slots_for_drafting_past_the_last_token():
    scheduler = _scheduler(lookahead=3)
    request = Request("a", list(range(100, 108)), SamplingParams(temperature=0.0), EOS)
    scheduler.add_request(request)
    output = scheduler.schedule()
    # 8 prompt tokens fill 2 blocks; the proposer may write 3 draft slots more, in a third.
    assert len(output.new_requests[0].block_ids) == 3
    scheduler.update_from_output(output, RunnerOutput(["a"], [[50]], draft_token_ids={"a": [60, 61]}))
    assert request.spec_token_ids == [60, 61]


def test_eos_inside_an_accepted_run_stops_there_and_frees_everything():
    scheduler = _scheduler()
    request = _decoding_request(scheduler)
    request.spec_token_ids = [60, EOS, 62]
    _step(scheduler, {"a": [60, EOS, 62, 63]})
    assert request.output_token_ids == [50, 60, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_cache_manager.num_free_blocks == 32


def test_preemption_drops_pending_drafts():
    scheduler = _scheduler(num_blocks=4)
    first = _decoding_request(scheduler, "a", prompt_len=6)
    second = _decoding_request(scheduler, "b", prompt_len=6)
    first.spec_token_ids = [60, 61, 62, 63, 64, 65]
    second.spec_token_ids = [60]
    output = scheduler.schedule()
    assert output.preempted_request_ids == {"b"}
    assert second.spec_token_ids == [] and second.num_computed_tokens == 0


def test_drafts_stop_short_of_phi3s_rope_switch_and_the_sequence_restarts_long_past_it():
    """Phi-3's longrope (switch at 10 tokens here): a step of a sequence computed short never
    reaches position 10 (drafts are cut there), and once the sequence passes 10 tokens it is
    computed again from its first token, every token rotated by its new length, under the
    cache key of that length."""
    keys = {}
    scheduler = Scheduler(
        KVCacheManager(32, BLOCK_SIZE, True), 8, 64, 128, True, 0, rope_recompute_past=10,
        rope_cache_key=lambda length: keys.setdefault(length, 1 if length > 10 else None),
    )
    request = _decoding_request(scheduler)
    request.spec_token_ids = [60, 61, 62, 63, 64]
    output = _step(scheduler, {"a": [60, 61, 62, 70]})
    assert output.num_scheduled_tokens == {"a": 4} and output.scheduled_spec_token_ids == {"a": [60, 61, 62]}
    assert request.num_computed_tokens == 10 and request.num_tokens == 11 and request.prompt_len == 6
    output = _step(scheduler, {})
    assert output.preempted_request_ids == {"a"} and request.cache_key == 1 and scheduler.num_preemptions == 0
    output = _step(scheduler, {"a": [65]})
    assert [new.request_id for new in output.new_requests] == ["a"] and output.new_requests[0].prompt_len == 11
    assert output.num_scheduled_tokens == {"a": 11} and request.output_token_ids[-1] == 65
