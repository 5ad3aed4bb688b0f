"""The pools' replica stats as Prometheus families: each read from its part of the report."""

from __future__ import annotations

from duet.router.metrics import _PoolCollector
from tests.router.fake_serve import make_stats


def test_every_replica_metric_reads_its_value_from_the_typed_report():
    stats = make_stats(
        "decode", "d", num_running=2, num_waiting=1, num_free_blocks=25, num_blocks=100, kv_bytes_per_block=1600,
        num_preemptions=3, prefix_cache_queries=40, prefix_cache_hits=16, bytes=4096, transfers=2, failures=1, cancelled=1,
        seconds=0.5, pending=4, wire_bytes=2048, wire_seconds=0.25, num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6, accepted_per_position=[4, 2, 0],
        integrity_failures=1, tier_capacity_blocks=64, tier_blocks=40, tier_saved_blocks=50, tier_restored_blocks=7,
        held=["a", "b"], loads=5, evictions=3,
    )
    families = {family.name: family for family in _PoolCollector("m", lambda: {"decode": [stats]}).collect()}
    values = {name: family.samples[0].value for name, family in families.items() if family.samples}
    assert values == {
        "vllm:cache_config_info": 1, "vllm:num_requests_running": 2, "vllm:num_requests_waiting": 1,
        "vllm:kv_cache_usage_perc": 0.75, "duet:kv_transfers_pending": 4, "duet:kv_cache_blocks": 100,
        "duet:kv_cache_bytes_per_token": 100.0, "duet:spec_decode_mean_accepted_length": 2.5, "vllm:num_preemptions": 3,
        "vllm:prefix_cache_queries": 40, "vllm:prefix_cache_hits": 16, "duet:kv_transfer_bytes": 4096, "duet:kv_transfers": 2,
        "duet:kv_transfer_failures": 1, "duet:kv_transfers_cancelled": 1, "duet:kv_transfer_seconds": 0.5,
        "duet:kv_transfer_wire_bytes": 2048, "duet:kv_transfer_wire_seconds": 0.25,
        "duet:kv_integrity_failures": 1, "vllm:spec_decode_num_drafts": 4, "vllm:spec_decode_num_draft_tokens": 12,
        "vllm:spec_decode_num_accepted_tokens": 6, "duet:pool_replicas": 1,
        "vllm:spec_decode_num_accepted_tokens_per_pos": 4, "duet:kv_offload_blocks": 40, "duet:kv_offload_capacity_blocks": 64,
        "duet:kv_offload_saved_blocks": 50, "duet:kv_offload_restored_blocks": 7,
        "duet:lora_adapters_loaded": 2, "duet:lora_loads": 5, "duet:lora_evictions": 3,
    }
    assert families["vllm:cache_config_info"].samples[0].labels == {
        "model_name": "m", "stage": "decode", "replica": "d", "cache_dtype": "auto", "block_size": "16", "num_gpu_blocks": "100",
    }


def test_a_planned_pool_and_the_routers_arrivals_are_exported():
    from types import SimpleNamespace

    from duet.router.arrivals import ArrivalMeter
    from duet.router.metrics import _RoutingCollector

    now = [100.0]
    meter = ArrivalMeter(clock=lambda: now[0])
    now[0] = 200.0
    for _ in range(5):
        meter.end(meter.arrive(10, 4), finished=True)
    orchestrator = SimpleNamespace(
        migrations={}, channels=SimpleNamespace(messages=0, items=0), balancer=None, arrivals=meter,
    )
    records = {
        "decode": {"target": 2, "running": 1, "decisions": {"planned": 1}, "numbers": {"planned": 3, "rate": 1.5}},
        "prefill": {"target": 1, "running": 1, "decisions": {"steady": 1}, "numbers": {"prompt_backlog": 0}},
    }
    families = {family.name: family for family in _RoutingCollector("m", orchestrator, lambda: records, dict).collect()}
    assert [(sample.labels["stage"], sample.value) for sample in families["duet:autoscaler_planned_replicas"].samples] == [("decode", 3)]
    assert [sample.value for sample in families["duet:autoscaler_planned_rate"].samples] == [1.5]
    assert families["duet:arrival_rate"].samples[0].value == 0.5  # five in the last 10 s
