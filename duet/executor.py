"""Executors run an engine's workers and return the last rank's output each step.

``UniprocExecutor`` runs one worker in the engine's own process. ``RayExecutor``
(``duet.cluster.ray_executor``, chosen with ``distributed_executor_backend="ray"``) runs
them as Ray actors, in the placement group of the replica that owns the engine.
"""

from __future__ import annotations

from duet.messages import KVEndpoint
from duet.outputs import RunnerOutput, SchedulerOutput
from duet.worker import Worker, WorkerConfig


class UniprocExecutor:
    failure: str | None = None  # the worker lives in this process: it cannot die alone

    def __init__(self, config: WorkerConfig) -> None:
        if config.world_size != 1:
            raise ValueError(f"the in-process executor runs one worker, not {config.world_size}")
        self.worker = Worker(config)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.worker.execute(scheduler_output)

    def check_lora(self, name: str, path: str) -> None:
        """Raise ``duet.lora.LoRAError`` if the adapter at ``path`` does not fit the model."""
        self.worker.check_lora(name, path)

    def kv_endpoints(self) -> tuple[KVEndpoint, ...]:
        """Each rank's KV receiver, in rank order (empty without a KV connector)."""
        endpoint = self.worker.kv_endpoint()
        return () if endpoint is None else (endpoint,)

    def forget(self, request_ids) -> None:
        self.worker.forget(request_ids)

    def on_kv_results(self, wake) -> None:
        """Call ``wake`` whenever a KV transfer of the worker's ends (``KVConnectorWorker.on_results``)."""
        self.worker.on_kv_results(wake)

    def check_health(self) -> None:
        """The worker lives in this process: it is up while the engine is."""

    def close(self) -> None:
        self.worker.close()
