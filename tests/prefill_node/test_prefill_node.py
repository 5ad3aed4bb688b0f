"""The prefill node pins a request's blocks after its first token, and unpins them on every way out."""

from __future__ import annotations

from duet import SamplingParams
from duet.config import EngineArgs
from duet.prefill_node.node import PrefillNode

PROMPT = list(range(100, 137))  # 37 tokens: 3 blocks, the last one partial


def _first_result(node: PrefillNode):
    for _ in range(50):
        results = node.step()
        if results:
            return results[0]
    raise AssertionError("no first token after 50 steps")


def test_dropped_handle_and_aborted_request_leave_no_pinned_blocks(tiny_llama_dir):
    """Guards against leaking blocks when a client leaves before (or after) its KV is pulled."""
    node = PrefillNode(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=32, max_model_len=512), "prefill-t")
    try:
        node.submit("kept", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
        result = _first_result(node)
        assert result.finish_reason is None and result.handle.num_kv_tokens == len(PROMPT)
        assert [len(blocks) for blocks in node.engine.kv_cache_manager.pinned.values()] == [3]
        node.drop(result.handle.transfer_id)
        assert node.engine.kv_cache_manager.pinned == {}

        node.submit("gone", PROMPT[::-1], SamplingParams(temperature=0.0, max_tokens=8))
        node.abort("gone")
        assert node.step() == []

        node.submit("short", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
        done = _first_result(node)
        assert (done.finish_reason, done.handle) == ("length", None)
        node.check_integrity()  # every block free: nothing tracked, nothing pinned
    finally:
        node.close()


def test_first_token_text_is_held_back_like_the_decode_replica_holds_it(tiny_llama_dir):
    """Guards against the client receiving, from the prefill replica, the start of a stop string
    that the decode replica's text later cuts off."""
    node = PrefillNode(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=32, max_model_len=512), "prefill-s")
    try:
        node.submit("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
        free = _first_result(node)
        node.drop(free.handle.transfer_id)
        assert free.text  # the tiny model's first token decodes to visible text
        node.submit("held", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, stop=["x" * (len(free.text) + 3)]))
        held = _first_result(node)
        node.drop(held.handle.transfer_id)
        assert (held.first_token_id, held.text) == (free.first_token_id, "")
    finally:
        node.close()


def test_a_request_aborted_while_its_kv_waits_to_be_pulled_unpins_it(tiny_llama_dir):
    """Guards the prefill leak of the hostile-input run (4 of 728 blocks held for good): the
    router's call was cancelled just as the first token came back, so the abort found the
    request's KV waiting to be pulled and kept it pinned, and no one ever dropped it. The
    integrity check did not see it: it skipped the all-free check while anything was pinned."""
    node = PrefillNode(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=32, max_model_len=512), "prefill-a")
    try:
        node.submit("late", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
        assert _first_result(node).handle is not None
        node.abort("late")
        assert node.engine.kv_cache_manager.pinned == {}
        node.check_integrity()
        assert node.engine.kv_cache_manager.num_free_blocks == 32
    finally:
        node.close()


def test_kv_never_pulled_is_unpinned_after_the_transfer_timeout(tiny_llama_dir, monkeypatch):
    """If the router never comes back for a handle (it died), the KV does not stay pinned."""
    import time

    node = PrefillNode(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=32, max_model_len=512), "prefill-u", transfer_timeout_s=0.2)
    try:
        node.submit("orphan", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
        assert _first_result(node).handle is not None
        assert node.has_work
        time.sleep(0.3)
        node.step()
        assert node.engine.kv_cache_manager.pinned == {} and not node.has_work
        node.check_integrity()
    finally:
        node.close()


def test_a_failed_step_on_the_prefill_node_fails_only_its_culprit_and_pins_nothing(tiny_llama_dir):
    """Guards the prefill replica after a step raised: its requests restart (their blocks were
    pinned then, as if finished, and the pin of the rerun replaced that map entry: those blocks
    were never freed). Now only the request that fails alone gets an error; the other gets its
    first token and a handle, and every block comes back."""
    node = PrefillNode(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=32, max_model_len=512), "prefill-f")
    build = node.engine.runner._sampling_metadata

    def poisoned(request_ids):
        if "bad" in request_ids:
            raise ValueError("Overflow when unpacking long long")
        return build(request_ids)

    node.engine.runner._sampling_metadata = poisoned
    try:
        node.submit("good", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
        node.submit("bad", PROMPT[::-1], SamplingParams(temperature=0.0, max_tokens=8))
        results = {}
        for _ in range(50):
            results |= {result.request_id: result for result in node.step()}
            if len(results) == 2:
                break
        assert results["bad"].error == "the engine failed on this request (ValueError: Overflow when unpacking long long)"
        assert results["good"].error is None and results["good"].handle is not None
        assert list(node.engine.kv_cache_manager.pinned) == ["good"]
        node.drop(results["good"].handle.transfer_id)
        node.check_integrity()
        assert node.engine.kv_cache_manager.num_free_blocks == 32
    finally:
        node.close()
