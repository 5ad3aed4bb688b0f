"""Workers as Ray actors: the executor a replica uses for ``distributed_executor_backend="ray"``.

Each rank's ``duet.worker.Worker`` runs in an actor of its own, placed in the caller's
placement group when it has one (a Serve replica with ``placement_group_bundles``), so a
replica and its workers are scheduled, and die, together. Every step goes to every rank; the
last rank's output is the step's. Tensor and pipeline parallel ranks are a later addition; the
actors, their placement and the step protocol are here.
"""

from __future__ import annotations

import dataclasses

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from duet.messages import KVEndpoint
from duet.outputs import RunnerOutput, SchedulerOutput
from duet.worker import Worker, WorkerConfig


class RayExecutor:
    def __init__(self, config: WorkerConfig) -> None:
        group = ray.util.get_current_placement_group()
        options = {"num_cpus": 0}
        if group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
        actor = ray.remote(Worker).options(**options)
        self.workers = [actor.remote(dataclasses.replace(config, rank=rank)) for rank in range(config.world_size)]
        self._endpoints = tuple(ray.get([worker.kv_endpoint.remote() for worker in self.workers]))

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        outputs = ray.get([worker.execute.remote(scheduler_output) for worker in self.workers])
        return outputs[-1]

    def kv_endpoints(self) -> tuple[KVEndpoint, ...]:
        return () if self._endpoints[0] is None else self._endpoints

    def forget(self, request_ids) -> None:
        ray.get([worker.forget.remote(request_ids) for worker in self.workers])

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
