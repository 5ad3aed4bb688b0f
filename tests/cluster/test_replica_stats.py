"""What a replica reports (Serve's routing stats): its engine's parts whole, the names
``/duet/status`` shows, and a report that changes only in its time not sent anew."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from duet.block_pool import routing_block_hashes
from duet.cluster.autoscale import METRICS
from duet.cluster.operate import format_status
from duet.cluster.replica import EngineReplica
from duet.llm import LLM
from duet.messages import EngineRequest, KVDestination, LoRAStats, ReplicaStats
from duet.prefill_node.role import PrefillRole
from duet.sampling_params import SamplingParams
# What ``/duet/status`` shows of each replica (before its ``prefix_hashes`` count and ``age_s``):
# integration tests, benchmarks and ``duet status`` read these names.
STATUS_KEYS = {
    "stage", "replica_id", "node_id", "num_running", "num_waiting", "num_free_blocks", "num_blocks", "block_size", "num_preemptions",
    "prefix_cache_queries", "prefix_cache_hits", "kv_cache_dtype", "kv_dtype", "kv_bytes_per_block", "kv_usage",
    "tier_capacity_blocks", "tier_blocks", "tier_saved_blocks", "tier_restored_blocks", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_accepted_per_position", "transfer_bytes",
    "transfers", "transfer_failures", "transfers_cancelled", "transfer_seconds", "pending_transfers", "transfer_wire_bytes", "transfer_wire_seconds", "prompt_tokens_pending",
    "new_prompt_tokens_pending", "num_decoding_blocks", "num_decode_waiting", "prefill_tokens_per_s", "tokens_per_s",
    "tpot_s", "decode_only_tpot_s", "ttft_s", "output_tokens_per_s", "threads", "shared_cores", "core_wait_s",
    "integrity_failures", "worker_failure", "loras", "lora_loads", "lora_evictions",
    "prefix_hashes", "reported_at",
}


def _unfilled(cls) -> list[str]:
    """Fields of a stats class its owner could leave out (they have a default)."""
    return [f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]


def test_a_replicas_report_is_its_engines_parts_each_filled_by_its_owner(tiny_llama_dir):
    """Guards the typed report (#37): a replica's stats are its engine's parts, each made whole by
    its owner's ``stats()`` (no field has a default to leave unset, so a part missing a value
    fails where it is made, not in a live replica's report), and the prefill role's cached
    prefixes come from the engine's ``cached_prefixes``. The report crosses Serve as a dict and
    comes back equal; the autoscaling metrics carry the names the policies read; and the status
    JSON keeps its flat names."""
    speculation = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256, speculative_config=speculation)
    prompt = [5, 6, 7] * 24  # 4 full blocks; repeating, so n-grams draft
    for _ in range(2):  # the second finds the first's blocks in the prefix cache
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40))
    engine = llm.engine
    role = PrefillRole()
    role.admit(EngineRequest("r", prompt, SamplingParams(), kv_send=KVDestination(1, (), "decode")), engine.block_size)
    role.admit(EngineRequest("never-run", list(range(200, 264)), SamplingParams(), kv_send=KVDestination(2, (), "decode")), engine.block_size)
    replica = EngineReplica("prefill-test", role, engine)
    try:
        report = asyncio.run(replica.record_routing_stats())
        metrics = asyncio.run(replica.record_autoscaling_stats())
    finally:
        replica.loop.stop()
        engine.close()

    stats = ReplicaStats.from_dict(report)
    assert stats.to_dict() == report and ReplicaStats.from_dict(stats.to_dict()) == stats
    parts = [stats.scheduler, stats.kv, stats.transfer, stats.load, stats.spec, stats.lora]
    assert [_unfilled(type(part)) for part in parts] == [[]] * len(parts) and _unfilled(ReplicaStats) == []
    assert (stats.stage, stats.replica_id, stats.worker_failure, stats.integrity_failures) == ("prefill", "prefill-test", None, 0)
    assert abs(time.time() - stats.reported_at) < 60
    assert stats.prefix_hashes == routing_block_hashes(prompt, engine.block_size)
    assert (stats.scheduler.num_running, stats.scheduler.num_waiting, stats.scheduler.prompt_tokens_pending) == (0, 0, 0)
    kv = stats.kv
    assert (kv.num_free_blocks, kv.num_blocks, kv.block_size, kv.kv_cache_dtype) == (64, 64, engine.block_size, "auto")
    assert (kv.kv_dtype, kv.kv_bytes_per_block, kv.kv_usage) == (str(engine.kv_dtype).removeprefix("torch."), engine.kv_bytes_per_block, 0.0)
    assert 0 < kv.prefix_cache_hits <= kv.prefix_cache_queries
    assert stats.transfer == dataclasses.replace(stats.transfer, bytes=0, transfers=0, failures=0, cancelled=0, seconds=0.0, pending=0)
    assert stats.load.prefill_tokens_per_s > 0 and stats.load.tokens_per_s >= stats.load.prefill_tokens_per_s
    spec = stats.spec
    assert 0 < spec.num_drafts and spec.num_accepted_tokens <= spec.num_draft_tokens and spec.mean_accepted_length >= 1
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
    assert stats.lora == LoRAStats(held=[], max_loras=4, loads=0, evictions=0)

    assert list(metrics) == list(METRICS) and metrics["num_blocks"] == 64.0
    assert metrics["prefill_tokens_per_s"] == stats.load.prefill_tokens_per_s

    flat = stats.flat()
    assert set(flat) == STATUS_KEYS and flat["num_free_blocks"] == 64 and flat["spec_num_drafts"] == spec.num_drafts
    shown = flat | {"prefix_hashes": len(stats.prefix_hashes), "age_s": 0.1}  # as /duet/status sends it
    pools = {"prefill": {"replicas": 1, "stats": [shown]}}
    table = format_status({"url": "http://x", "model": "tiny", "pools": pools, "admission": {"running_sequences": 0, "queued_requests": 0}})
    assert "prefill-test" in table.splitlines()[2]


def test_a_decode_or_colocated_replica_reports_the_contexts_it_holds_still_cached(tiny_llama_dir):
    """A colocated or decode replica recalls the routing hashes of each prompt it computes and,
    once a sequence ends, of its prompt (computed there, or received) with its outputs, whose KV
    it computed (``KVCacheManager.finished_contexts``); it reports those its prefix cache still
    holds, so that a conversation's next turn, which resends that history, is computed there. A
    received prompt is not named before its sequence ends: the last report of a replica lost
    mid-stream drew its sequences' recomputing back to it."""
    from duet.decode_node.role import DecodeRole

    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256)
    engine, block_size = llm.engine, llm.engine.block_size
    prompt = list(range(10, 122))  # 7 full blocks; with 20 outputs, 8 (the routing depth past 4)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))  # the prompt cached: its one output has no KV
    engine.kv_cache_manager.finished_contexts.clear()
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)
    for role in (DecodeRole(colocated=True), DecodeRole()):
        request = EngineRequest("r", prompt, SamplingParams(), kv_receive=not role.colocated)
        role.admit(request, block_size)
        role.admit(EngineRequest("never-run", list(range(200, 264)), SamplingParams()), block_size)
        assert role.prefix_hashes(engine) == ([] if request.kv_receive else routing_block_hashes(prompt, block_size))
        output_ids = llm.generate([prompt], params)[0].outputs[0].token_ids
        whole = routing_block_hashes(prompt + output_ids, block_size)
        assert len(whole) == len(routing_block_hashes(prompt, block_size)) + 1
        assert role.prefix_hashes(engine) == whole and not engine.kv_cache_manager.finished_contexts


def test_a_decode_replica_that_computed_no_prompt_reports_no_prefixes(replica):
    stats = ReplicaStats.from_dict(asyncio.run(replica.record_routing_stats()))
    assert (stats.stage, stats.prefix_hashes, stats.kv.num_blocks) == ("decode", [], replica.engine.num_blocks)


def test_an_unchanged_report_is_sent_again_as_it_was_until_it_is_unchanged_report_s_old(replica, monkeypatch):
    """Serve sends every changed report to every router of the pool: an idle replica's report,
    new only in its time, would be one every half second from each replica. It is the last
    report again, time and all, until ``UNCHANGED_REPORT_S`` after it; a change is sent at once."""
    from duet import messages

    first = asyncio.run(replica.record_routing_stats())
    assert asyncio.run(replica.record_routing_stats()) == first
    now = time.time()
    monkeypatch.setattr(messages.time, "time", lambda: now + messages.UNCHANGED_REPORT_S)
    later = asyncio.run(replica.record_routing_stats())
    assert later["reported_at"] >= first["reported_at"] + messages.UNCHANGED_REPORT_S
    assert later | {"reported_at": first["reported_at"]} == first
    replica.integrity_failures += 1  # a change
    changed = asyncio.run(replica.record_routing_stats())
    assert changed["integrity_failures"] == 1 and changed["reported_at"] == later["reported_at"]
    monkeypatch.setattr(messages.time, "time", lambda: now + messages.UNCHANGED_REPORT_S + 1)
    assert asyncio.run(replica.record_routing_stats())["reported_at"] == later["reported_at"]
