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
