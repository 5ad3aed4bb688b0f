"""Prometheus metrics of the ingress, with vLLM's names: latencies measured here as the client
sees them, and the pools' replica stats (reported through ``record_routing_stats``) exposed
with a ``stage`` label."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from duet.messages import ReplicaStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class RouterMetrics:
    """One registry per ingress replica."""

    def __init__(
        self,
        model_name: str,
        pool_stats: Callable[[], dict[str, list[ReplicaStats]]],
        admission,
        orchestrator,
        autoscaler: Callable[[], dict[str, dict]],
        role_changes: Callable[[], dict[str, int]] = dict,
    ) -> None:
        """``role_changes``: the changes of role the router made, by reason, and the sequences it
        had shed (under ``"shed"``)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time from arrival at the router to the first token.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time spent waiting for admission.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=self.registry).labels(model_name)
        self.success = Counter(
            "vllm:request_success", "Requests finished, by reason.", ["model_name", "finished_reason"], registry=self.registry
        )
        lora_labels = ["model_name", "lora_name"]
        self.lora_requests = Counter("duet:lora_requests", "Requests finished, by the LoRA adapter they named.", lora_labels, registry=self.registry)
        self.lora_prompt_tokens = Counter("duet:lora_prompt_tokens", "Prompt tokens, by LoRA adapter.", lora_labels, registry=self.registry)
        self.lora_generation_tokens = Counter("duet:lora_generation_tokens", "Tokens generated, by LoRA adapter.", lora_labels, registry=self.registry)
        self.rejected = Counter(
            "duet:requests_rejected", "Requests refused, by HTTP status.", ["model_name", "status"], registry=self.registry
        )
        running = Gauge("duet:admission_running_sequences", "Sequences admitted into the pools.", labels, registry=self.registry)
        running.labels(model_name).set_function(lambda: admission.num_running)
        queued = Gauge("duet:admission_queued_requests", "Requests waiting for admission.", labels, registry=self.registry)
        queued.labels(model_name).set_function(lambda: admission.num_queued)
        self.registry.register(_PoolCollector(model_name, pool_stats))
        self.registry.register(_RoutingCollector(model_name, orchestrator, autoscaler, role_changes))


class _PoolCollector:
    """Turns the replicas' latest reported stats into metric families at scrape time."""

    def __init__(self, model_name: str, pool_stats: Callable[[], dict[str, list[ReplicaStats]]]) -> None:
        self.model_name = model_name
        self.pool_stats = pool_stats

    def describe(self):
        return []

    def collect(self):
        labels = ["model_name", "stage", "replica"]
        gauges = {
            "vllm:num_requests_running": ("Sequences running on the replica.", lambda s: s.scheduler.num_running),
            "vllm:num_requests_waiting": ("Sequences waiting on the replica.", lambda s: s.scheduler.num_waiting),
            "vllm:kv_cache_usage_perc": ("Fraction of KV blocks in use (1 = full).", lambda s: s.kv.kv_usage),
            "duet:kv_transfers_pending": ("Transfers reserved or accepted, not yet arrived.", lambda s: s.transfer.pending),
            "duet:kv_cache_blocks": ("KV blocks the replica's cache holds.", lambda s: s.kv.num_blocks),
            "duet:kv_cache_bytes_per_token": (
                "KV cache bytes a token takes on the replica: K and V of its layers (quantized rows with their scales).",
                lambda s: s.kv.kv_bytes_per_block / s.kv.block_size if s.kv.block_size else 0,
            ),
            "duet:kv_offload_blocks": ("KV blocks the second tier (kv_offload) holds.", lambda s: s.kv.tier_blocks),
            "duet:kv_offload_capacity_blocks": ("KV blocks the second tier can hold (0: none).", lambda s: s.kv.tier_capacity_blocks),
            "duet:lora_adapters_loaded": ("LoRA adapters the replica holds (at most its max_loras).", lambda s: len(s.lora.held)),
            "duet:spec_decode_mean_accepted_length": (
                "Tokens emitted per verified draft since start (accepted drafts plus one); 0 before any.",
                lambda s: s.spec.mean_accepted_length,
            ),
        }
        counters = {
            "vllm:num_preemptions": ("Preemptions by recompute.", lambda s: s.scheduler.num_preemptions),
            "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", lambda s: s.kv.prefix_cache_queries),
            "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", lambda s: s.kv.prefix_cache_hits),
            "duet:kv_offload_saved_blocks": ("Evicted KV blocks written to the second tier.", lambda s: s.kv.tier_saved_blocks),
            "duet:kv_offload_restored_blocks": (
                "KV blocks copied back from the second tier instead of recomputed.", lambda s: s.kv.tier_restored_blocks,
            ),
            "duet:kv_transfer_bytes": ("KV bytes sent (prefill) or received (decode).", lambda s: s.transfer.bytes),
            "duet:kv_transfers": ("KV transfers completed.", lambda s: s.transfer.transfers),
            "duet:kv_transfer_failures": ("KV transfers that failed.", lambda s: s.transfer.failures),
            "duet:kv_transfers_cancelled": ("KV transfers given up because their request was aborted.", lambda s: s.transfer.cancelled),
            "duet:kv_transfer_seconds": ("Seconds spent in KV transfers, announcement to acknowledgement.", lambda s: s.transfer.seconds),
            "duet:kv_transfer_wire_bytes": ("KV bytes sent by transfers whose wire time was measured.", lambda s: s.transfer.wire_bytes),
            "duet:kv_transfer_wire_seconds": (
                "Seconds KV sends took, less their waits for the forward computing what they send.", lambda s: s.transfer.wire_seconds,
            ),
            "duet:kv_integrity_failures": ("Idle KV bookkeeping checks that failed (blocks leaked).", lambda s: s.integrity_failures),
            "duet:lora_loads": ("LoRA adapters loaded after start (first use, or again after eviction).", lambda s: s.lora.loads),
            "duet:lora_evictions": ("LoRA adapters unloaded to load another, max_loras being held.", lambda s: s.lora.evictions),
            "vllm:spec_decode_num_drafts": ("Draft proposals verified (one per request per step).", lambda s: s.spec.num_drafts),
            "vllm:spec_decode_num_draft_tokens": ("Draft tokens verified.", lambda s: s.spec.num_draft_tokens),
            "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted.", lambda s: s.spec.num_accepted_tokens),
        }
        families = {name: GaugeMetricFamily(name, doc, labels=labels) for name, (doc, _) in gauges.items()}
        families |= {name: CounterMetricFamily(name, doc, labels=labels) for name, (doc, _) in counters.items()}
        replicas = GaugeMetricFamily("duet:pool_replicas", "Replicas reporting stats, per pool.", labels=["model_name", "stage"])
        cache_info = GaugeMetricFamily(
            "vllm:cache_config_info", "The replica's KV cache settings, as labels (value 1).",
            labels=[*labels, "cache_dtype", "block_size", "num_gpu_blocks"],
        )
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted (and every earlier one).",
            labels=[*labels, "position"],
        )
        for pool, stats_list in self.pool_stats().items():
            replicas.add_metric([self.model_name, pool], len(stats_list))
            for stats in stats_list:
                values = [self.model_name, pool, stats.replica_id]
                cache_info.add_metric([*values, stats.kv.kv_cache_dtype, str(stats.kv.block_size), str(stats.kv.num_blocks)], 1)
                for name, (_, read) in (gauges | counters).items():
                    families[name].add_metric(values, read(stats))
                for position, count in enumerate(stats.spec.accepted_per_position):
                    per_position.add_metric([*values, str(position)], count)
        yield replicas
        yield cache_info
        yield per_position
        yield from families.values()


class _RoutingCollector:
    """Where the router sent sequences (their moves, the stages that computed their prompts) and
    the pools' autoscaling decisions, read at scrape time."""

    def __init__(self, model_name: str, orchestrator, autoscaler: Callable[[], dict[str, dict]], role_changes: Callable[[], dict[str, int]]) -> None:
        self.model_name = model_name
        self.orchestrator = orchestrator
        self.autoscaler = autoscaler
        self.role_changes = role_changes

    def describe(self):
        return []

    def collect(self):
        migrations = CounterMetricFamily(
            "duet:migrations", "Sequences moved between decode replicas, by how (kv, recompute).", labels=["model_name", "how"]
        )
        for how, count in self.orchestrator.migrations.items():
            migrations.add_metric([self.model_name, how], count)
        yield migrations
        channels = self.orchestrator.channels
        for name, count, text in (
            ("duet:channel_messages", channels.messages, "Messages read from the replicas' channels, a step's items for this router's sequences each."),
            ("duet:channel_items", channels.items, "Sequences' items (tokens, moves, errors) those messages carried."),
        ):
            counter = CounterMetricFamily(name, text, labels=["model_name"])
            counter.add_metric([self.model_name], count)
            yield counter
        balancer = self.orchestrator.balancer
        if balancer is not None:
            fallbacks = CounterMetricFamily(
                "duet:prefill_fallbacks", "Contexts computed on a decode replica because their prefill replica failed.", labels=["model_name"]
            )
            fallbacks.add_metric([self.model_name], self.orchestrator.prefill_fallbacks)
            yield fallbacks
            sends = CounterMetricFamily(
                "duet:history_sends",
                "Contexts a busy decode replica holding their history computed past it and sent to the replica that decoded them.",
                labels=["model_name"],
            )
            sends.add_metric([self.model_name], self.orchestrator.history_sends)
            yield sends
            pulls = CounterMetricFamily(
                "duet:history_pulls",
                "Of those, the sends of the cached history alone: the replica that decoded them computed the rest.",
                labels=["model_name"],
            )
            pulls.add_metric([self.model_name], self.orchestrator.history_pulls)
            yield pulls
            prefills = CounterMetricFamily(
                "duet:prompts_computed",
                "Prompts (and recomputed contexts) by the stage the router chose to compute them (fallbacks aside).",
                labels=["model_name", "stage"],
            )
            prefills.add_metric([self.model_name, "decode"], balancer.decisions[True])
            prefills.add_metric([self.model_name, "prefill"], balancer.decisions[False])
            yield prefills
            waited = CounterMetricFamily(
                "duet:contexts_waited",
                "Contexts the router held (no KV reserved) while the prefill pool's queue would have made them late and the decode pool had no room.",
                labels=["model_name"],
            )
            waited.add_metric([self.model_name], self.orchestrator.waiting_room.contexts_waited)
            yield waited
            roles = CounterMetricFamily(
                "duet:role_changes", "Replicas this router had take the other pool's role (or go home), by reason.", labels=["model_name", "reason"]
            )
            changes = self.role_changes()
            shed = changes.pop("shed", 0)
            for reason, count in changes.items():
                roles.add_metric([self.model_name, reason], count)
            yield roles
            sequences_shed = CounterMetricFamily(
                "duet:sequences_shed", "Sequences moved by KV from a busy replica serving decode to one less busy.", labels=["model_name"]
            )
            sequences_shed.add_metric([self.model_name], shed)
            yield sequences_shed
        target = GaugeMetricFamily("duet:autoscaler_target_replicas", "The pool's size its autoscaling policy decided.", labels=["model_name", "stage"])
        running = GaugeMetricFamily("duet:autoscaler_running_replicas", "The pool's running replicas as the policy saw them.", labels=["model_name", "stage"])
        decisions = CounterMetricFamily(
            "duet:autoscaler_decisions", "Changes of the pool's autoscaling decision, by reason.", labels=["model_name", "stage", "reason"]
        )
        planned = GaugeMetricFamily(
            "duet:autoscaler_planned_replicas", "The replicas a pool sized ahead (its profile) planned for the demand, before its bounds.",
            labels=["model_name", "stage"],
        )
        planned_rate = GaugeMetricFamily(
            "duet:autoscaler_planned_rate", "The arrivals per second the pool's plan was made for.", labels=["model_name", "stage"]
        )
        for stage, record in self.autoscaler().items():
            target.add_metric([self.model_name, stage], record["target"])
            running.add_metric([self.model_name, stage], record["running"])
            for reason, count in record["decisions"].items():
                decisions.add_metric([self.model_name, stage, reason], count)
            numbers = record.get("numbers") or {}
            if "planned" in numbers:
                planned.add_metric([self.model_name, stage], numbers["planned"])
                planned_rate.add_metric([self.model_name, stage], numbers["rate"])
        yield target
        yield running
        yield decisions
        yield planned
        yield planned_rate
        arrivals = self.orchestrator.arrivals.summary()[0]
        arrival_rate = GaugeMetricFamily(
            "duet:arrival_rate", "Requests per second this router took in over the last 10 s (what the planning autoscaler reads).",
            labels=["model_name"],
        )
        arrival_rate.add_metric([self.model_name], arrivals["requests"] / max(arrivals["seconds"], 1.0))
        yield arrival_rate
