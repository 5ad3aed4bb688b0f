"""The scheduler side of the KV connector, driven step by step with a fake runner: when a
transfer starts, which blocks it holds and until when, what is cancelled, and how a request
whose prompt KV arrives joins the batch. Exact block ids throughout."""

from __future__ import annotations


from duet.messages import KVDestination, KVEndpoint
from duet.outputs import KVTransferResult, RunnerOutput
from duet.request import RequestStatus
from tests.duet.scheduler_driver import TOKEN, new_request, step

DESTINATION = KVDestination(77, (KVEndpoint("127.0.0.1", 1234),), "decode-x")


def _report(scheduler, *results: KVTransferResult):
    """A step in which the workers report transfers (and nothing is scheduled)."""
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, RunnerOutput([], [], kv_results=list(results)))


def test_a_sent_prompt_ships_in_its_last_chunk_and_its_blocks_wait_for_the_send(make_scheduler):
    """Guards the prefill side: the send starts with the step that computes the prompt's last
    chunk (its layers travel as that forward writes them); the request ends with its first token
    but its blocks stay held, under the transfer's id, until the workers report the send done."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = new_request("p", 10, max_tokens=16)
    request.kv_send, request.remote_decode = DESTINATION, True
    scheduler.add_request(request)
    first = step(scheduler)
    assert (first.num_scheduled_tokens, first.kv_connector.sends) == ({"p": 8}, [])
    second = step(scheduler)
    assert second.num_scheduled_tokens == {"p": 2}
    assert [(s.request_id, s.transfer_id, s.num_blocks) for s in second.kv_connector.sends] == [("p", 77, 3)]
    assert request.status == RequestStatus.FINISHED_REMOTE and request.finish_reason is None
    assert request.output_token_ids == [TOKEN]
    assert {key: [b.block_id for b in blocks] for key, blocks in scheduler.kv_cache_manager.held.items()} == {77: [0, 1, 2]}
    assert not scheduler.requests and scheduler.has_unfinished_requests()  # a transfer is in flight
    _report(scheduler, KVTransferResult(77, True))
    assert scheduler.kv_cache_manager.held == {} and not scheduler.has_unfinished_requests()


def test_an_aborted_send_is_cancelled_and_holds_its_blocks_until_the_sender_lets_go(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = new_request("p", 10)
    request.kv_send, request.remote_decode = DESTINATION, True
    scheduler.add_request(request)
    step(scheduler)
    output = scheduler.schedule()  # the last chunk: the send starts...
    assert output.kv_connector.sends
    scheduler.abort("p")  # ...and the client leaves before the step's results
    cancelled, _ = _report(scheduler)
    assert cancelled.kv_connector.cancels == [77]
    assert list(scheduler.kv_cache_manager.held) == [77]
    _report(scheduler, KVTransferResult(77, False, error="cancelled", cancelled=True))
    assert scheduler.kv_cache_manager.held == {} and scheduler.kv_connector.counters.cancelled == 1


def test_a_received_prompt_waits_with_its_blocks_and_joins_with_its_first_token(make_scheduler):
    """Guards the decode side: blocks reserved at once (the destination must be ready before
    the prefill starts), named to the workers next step; when the KV is in, the request joins
    the batch with the prefill's first token (not reported again) and decodes from there."""
    scheduler = make_scheduler()
    request = new_request("d", 9, max_tokens=3)
    assert scheduler.add_remote_request(request, 5)
    assert (request.status, scheduler.kv_cache_manager.block_ids("d")) == (RequestStatus.WAITING_FOR_REMOTE_KV, [0, 1, 2])
    announced, _ = _report(scheduler)
    assert [(s.request_id, s.transfer_id, s.block_ids) for s in announced.kv_connector.receives] == [("d", 5, [0, 1, 2])]
    assert announced.num_scheduled_tokens == {}
    _, changed = _report(scheduler, KVTransferResult(5, True, first_token_id=42))
    assert changed == [] and request.output_token_ids == [42] and request.num_emitted_tokens == 1
    decode = step(scheduler)
    assert decode.num_scheduled_tokens == {"d": 1}  # the first token's KV; the prompt's is in
    assert (decode.new_requests[0].output_token_ids, decode.new_requests[0].num_computed_tokens) == ([42], 9)
    assert request.output_token_ids == [42, TOKEN]
    step(scheduler)
    assert request.finish_reason == "length" and scheduler.kv_cache_manager.num_free_blocks == 32


def test_a_received_first_token_that_ends_the_request_ends_it_here_too(make_scheduler):
    scheduler = make_scheduler()
    request = new_request("d", 9, max_tokens=3)
    scheduler.add_remote_request(request, 5)
    _report(scheduler)
    _, changed = _report(scheduler, KVTransferResult(5, True, first_token_id=2))  # EOS
    assert changed == [request] and request.finish_reason == "stop"
    assert scheduler.kv_cache_manager.num_free_blocks == 32


def test_a_lost_prompt_kv_fails_the_request_and_frees_its_blocks(make_scheduler):
    scheduler = make_scheduler()
    request = new_request("d", 9)
    scheduler.add_remote_request(request, 5)
    _report(scheduler)
    _, changed = _report(scheduler, KVTransferResult(5, False, error="pair p->d/0 broke: timeout"))
    assert changed == [request] and request.status == RequestStatus.FINISHED_KV_LOST
    assert request.error == "the prompt's KV did not arrive: pair p->d/0 broke: timeout"
    assert scheduler.kv_cache_manager.num_free_blocks == 32 and scheduler.kv_connector.counters.failures == 1


def test_aborting_a_received_prompt_frees_at_once_unless_the_workers_know_of_it(make_scheduler):
    """Guards the decode leak of the hostile load: blocks of aborted transfers stayed held.
    Before the workers hear of the transfer nothing writes the blocks: they are free at once (a
    cancel still goes out, to drain an announcement that comes anyway); after, they are held
    until the receiver lets go."""
    scheduler = make_scheduler()
    early = new_request("early", 9)
    scheduler.add_remote_request(early, 5)
    scheduler.abort("early")
    assert scheduler.kv_cache_manager.num_free_blocks == 32
    output, _ = _report(scheduler)
    assert (output.kv_connector.receives, output.kv_connector.cancels) == ([], [5])
    late = new_request("late", 9)
    scheduler.add_remote_request(late, 6)
    _report(scheduler)
    scheduler.abort("late")
    assert list(scheduler.kv_cache_manager.held) == [6]
    output, _ = _report(scheduler, KVTransferResult(6, False, error="cancelled", cancelled=True))
    assert output.kv_connector.cancels == [6]
    assert scheduler.kv_cache_manager.held == {} and scheduler.kv_cache_manager.num_free_blocks == 32


def test_a_failed_step_cancels_its_send_and_reruns_the_prompt_without_one(make_scheduler):
    """The KV a failed step was shipping came from blocks it then gave back: the send is
    cancelled (the decode side recomputes), its blocks held until the sender lets go, and the
    request reruns to give its first token, sending nothing."""
    scheduler = make_scheduler()
    request = new_request("p", 10)
    request.kv_send, request.remote_decode = DESTINATION, True
    scheduler.add_request(request)
    failed = scheduler.schedule()
    assert failed.kv_connector.sends
    assert scheduler.reset_step(failed) == []
    assert list(scheduler.kv_cache_manager.held) == [77] and request.kv_send is None
    rerun = step(scheduler)
    assert rerun.kv_connector.cancels == [77] and rerun.kv_connector.sends == []
    assert request.status == RequestStatus.FINISHED_REMOTE and request.output_token_ids == [TOKEN]
    _report(scheduler, KVTransferResult(77, False, error="cancelled", cancelled=True))
    assert scheduler.kv_cache_manager.held == {} and scheduler.kv_cache_manager.num_free_blocks == 32


def test_reservations_that_fill_the_pool_leave_each_the_slots_of_its_first_step(make_scheduler):
    """Guards against a decode replica that stopped for good: reservations took every block,
    each prompt filling its blocks exactly, and once their KV was in, none could get the block of
    its first token; requests waiting for their KV or not yet running are never preempted, so
    nothing ever freed one. Now the first step's slot is reserved with the prompt's, and the
    workers are told only of the blocks the transfer fills."""
    scheduler = make_scheduler(num_blocks=8)
    first, second = new_request("a", 16, max_tokens=2), new_request("b", 16, max_tokens=2)
    assert scheduler.add_remote_request(first, 5)
    assert scheduler.kv_cache_manager.block_ids("a") == [0, 1, 2, 3, 4]
    assert not scheduler.add_remote_request(second, 6)  # 3 blocks left: the router tries another replica
    announced, _ = _report(scheduler)
    assert [(s.transfer_id, s.block_ids) for s in announced.kv_connector.receives] == [(5, [0, 1, 2, 3])]
    _report(scheduler, KVTransferResult(5, True, first_token_id=42))
    assert step(scheduler).num_scheduled_tokens == {"a": 1}
    assert first.output_token_ids == [42, TOKEN] and first.finish_reason == "length"
