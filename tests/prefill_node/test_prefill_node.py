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
