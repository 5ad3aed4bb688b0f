"""Workers as Ray actors: the executor of an engine with several tensor-parallel ranks, or of one
asked for ``distributed_executor_backend="ray"``.

Each rank's ``duet.worker.Worker`` runs in an actor of its own. In a Serve replica with
``placement_group_bundles`` the actors take the group's last ``world_size`` bundles (the first
is the replica's own), so a replica and its workers are scheduled, and die, together; outside
one (offline ``LLM``) they are pinned to the caller's node. The ranks meet at a ``TCPStore``
this executor hosts, on 127.0.0.1 when they all run on its node. Every step goes to every rank;
the last rank's output is the step's, with the KV transfers every rank has finished.

A rank that dies fails the step at once (its peers may be stuck in a collective until their
timeout: they are killed with the replica), and the executor stays failed: ``check_health``
says so, and Serve replaces the replica.
"""

from __future__ import annotations

import dataclasses
import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from duet.distributed import host_store
from duet.errors import WorkerDiedError
from duet.messages import KVEndpoint
from duet.outputs import KVTransferResult, RunnerOutput, SchedulerOutput
from duet.structured_output import build_before_serving
from duet.worker import Worker, WorkerConfig

LOOPBACK = "127.0.0.1"


class _WorkerActor(Worker):
    """A rank's worker. ``ping`` waits behind a running step (a threaded actor would answer at
    once, but runs its steps on a pool thread: 2.5x slower in OpenMP kernels, measured)."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        if self.runner.grammar is not None:  # before serving: its build stalls the whole process (duet.structured_output)
            build_before_serving(self.runner.grammar.tokenizer)

    def ping(self) -> bool:
        return True


HEALTH_TIMEOUT_S = 10.0  # well above the longest step


class RayExecutor:
    def __init__(self, config: WorkerConfig) -> None:
        if not ray.is_initialized():
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
        import torch

        world_size = config.world_size
        hosts, strategies, threads = _placement(world_size, max(1, torch.get_num_threads() // world_size))
        self._store = None
        self._kv_reports = RankReports(world_size)
        if world_size > 1:
            store_host = LOOPBACK if set(hosts) == {LOOPBACK} else ray.util.get_node_ip_address()
            self._store = host_store(store_host)
            config = dataclasses.replace(
                config, parallel_store=(store_host, self._store.port), ranks_share_memory=set(hosts) == {LOOPBACK}
            )
        actor = ray.remote(_WorkerActor)
        resources = {"num_cpus": 0, "num_gpus": 1 if config.device.startswith("cuda") else 0}
        self.workers = []
        for rank in range(world_size):
            num_threads = config.num_threads or threads[rank]
            options = actor.options(scheduling_strategy=strategies[rank], **resources)
            self.workers.append(options.remote(dataclasses.replace(config, rank=rank, host=hosts[rank], num_threads=num_threads)))
        self.failure: str | None = None
        try:
            self._endpoints = tuple(self._gather([worker.kv_endpoint.remote() for worker in self.workers]))
        except BaseException:  # a rank that failed to start leaves the others waiting for it in their groups
            for worker in self.workers:
                ray.kill(worker)
            raise

    def _gather(self, refs: list, timeout_s: float | None = None, errors: list | None = None) -> list:
        """Every rank's result; the first rank to die fails the call without waiting for the rest.
        With ``errors``, a rank whose call raised gets None and its error goes there."""
        if self.failure is not None:
            raise WorkerDiedError(self.failure)
        pending, results = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not ready:
                raise TimeoutError(f"{len(pending)} of {len(refs)} workers did not answer within {timeout_s} s")
            try:
                results[ready[0]] = ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as error:
                self.failure = f"worker rank {refs.index(ready[0])} died: {error}"
                raise WorkerDiedError(self.failure) from error
            except Exception as error:
                if errors is None:
                    raise
                errors.append(error)
                results[ready[0]] = None
        return [results[ref] for ref in refs]

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        shared = ray.put(scheduler_output)
        errors: list[Exception] = []
        outputs = self._gather([worker.execute.remote(shared) for worker in self.workers], errors=errors)
        if len(outputs) > 1:
            # Kept even when a rank failed the step: the others polled their reports, once.
            self._kv_reports.add([[] if output is None else output.kv_results for output in outputs])
        if errors:
            raise errors[0]
        output = outputs[-1]
        if len(outputs) > 1:
            output.kv_results = self._kv_reports.take()
        return output

    def kv_endpoints(self) -> tuple[KVEndpoint, ...]:
        return () if self._endpoints[0] is None else self._endpoints

    def on_kv_results(self, wake) -> None:
        """Nothing: the ranks' transfers end in their own processes, and the engine learns of
        them at its next step or busy poll (``duet.engine_loop.BUSY_POLL_S``)."""

    def check_lora(self, name: str, path: str) -> None:
        """Raise ``duet.lora.LoRAError`` if the adapter at ``path`` does not fit every rank's part
        of the model (its heads and features at tensor-parallel ranks, its layers at pipeline stages)."""
        self._gather([worker.check_lora.remote(name, path) for worker in self.workers])

    def forget(self, request_ids) -> None:
        self._gather([worker.forget.remote(request_ids) for worker in self.workers])

    def check_health(self) -> None:
        """Raise ``WorkerDiedError`` if a rank has died (found by a step, or by a ping now)."""
        self._gather([worker.ping.remote() for worker in self.workers], timeout_s=HEALTH_TIMEOUT_S)

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker)


def _placement(world_size: int, threads_here: int) -> tuple[list[str], list, list[int]]:
    """Per rank: the address its collectives listen on, where its actor is scheduled, and its
    torch threads (its bundle's CPUs; without a placement group, a share of the caller's)."""
    group = ray.util.get_current_placement_group()
    here = ray.get_runtime_context().get_node_id()
    if group is None:
        return [LOOPBACK] * world_size, [NodeAffinitySchedulingStrategy(here, soft=False)] * world_size, [threads_here] * world_size
    table = ray.util.placement_group_table(group)
    bundle_nodes = table["bundles_to_node_id"]
    if len(bundle_nodes) < world_size:
        raise ValueError(f"the replica's placement group has {len(bundle_nodes)} bundles, fewer than its {world_size} workers")
    first = len(bundle_nodes) - world_size  # the replica's own bundle, if any, comes first
    strategies = [
        PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=first + rank) for rank in range(world_size)
    ]
    threads = [max(1, round(table["bundles"][first + rank].get("CPU", 1))) for rank in range(world_size)]
    nodes = [bundle_nodes[first + rank] for rank in range(world_size)]
    if all(node == here for node in nodes):
        return [LOOPBACK] * world_size, strategies, threads
    addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return [addresses[node] for node in nodes], strategies, threads


class RankReports:
    """The ranks' reports of KV transfers, combined: a transfer has ended once it has on every
    rank (each moves its own heads), failed if it failed on any; a rank's report waits here for
    the others', and a transfer that ended in a step another rank failed waits for the next."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._parts: dict[int, list[KVTransferResult]] = {}
        self._ended: list[KVTransferResult] = []

    def add(self, per_rank: list[list[KVTransferResult]]) -> None:
        for results in per_rank:
            for result in results:
                parts = self._parts.setdefault(result.transfer_id, [])
                parts.append(result)
                if len(parts) == self.world_size:
                    del self._parts[result.transfer_id]
                    self._ended.append(KVTransferResult.combine(parts))

    def take(self) -> list[KVTransferResult]:
        ended, self._ended = self._ended, []
        return ended
