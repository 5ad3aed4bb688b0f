"""The workers' side of the KV connector: each worker sends and receives KV on its own cache.

The engine's scheduler names, in each step's ``SchedulerOutput.kv_connector``, the transfers
to expect, to start (a prompt's KV as the forward writes it, or a migrating sequence's KV as it
is) and to cancel; the worker calls ``start_step`` before its forward,
``on_layer_done`` after each layer (the sender ships runs of layers as they are written),
``end_step`` with what it sampled (a sent prompt's first token travels after its KV), and
reports ``poll()`` back in its ``RunnerOutput``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from duet.kv_transfer.endpoint import NO_TOKEN, STREAM_START_TIMEOUT_S
from duet.kv_transfer.progress import LayerProgress
from duet.kv_transfer.receiver import KVReceiver
from duet.kv_transfer.sender import KVSender
from duet.kv_transfer.spec import KVSpec
from duet.messages import KVEndpoint
from duet.outputs import KVConnectorMetadata, KVTransferResult


class KVConnectorWorker:
    def __init__(self, kv_cache: torch.Tensor, arch, config) -> None:
        """``config`` is the worker's (``duet.worker.WorkerConfig``), ``arch`` its model's shape."""
        transfer = config.kv_transfer
        host = resolve_host(transfer.host)
        spec = KVSpec(
            model=config.model_path.rstrip("/").rsplit("/", 1)[-1],
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            block_size=config.block_size,
            kv_dtype=str(kv_cache.dtype).removeprefix("torch."),
        )
        self.rank = config.rank
        self.num_layers = arch.num_layers
        self.sender = KVSender(kv_cache, spec, host, transfer.timeout_s, name=f"{transfer.name}.{config.rank}")
        self.receiver = KVReceiver(kv_cache, spec, host, transfer.timeout_s)
        self._sending: dict[str, LayerProgress] = {}  # this step's sends, by request
        self._block_table: Callable[[str], list[int]] = lambda request_id: []

    @property
    def endpoint(self) -> KVEndpoint:
        return self.receiver.endpoint

    @property
    def streaming(self) -> bool:
        """Whether this step's forward must report its layers (a send starts in it)."""
        return bool(self._sending)

    def start_step(self, metadata: KVConnectorMetadata, block_table: Callable[[str], list[int]]) -> None:
        for transfer_id in metadata.cancels:
            self.receiver.cancel(transfer_id)
            self.sender.cancel(transfer_id)
        for spec in metadata.receives:
            # The prompt may wait behind others on the prefill replica before its layers stream.
            self.receiver.expect(spec.transfer_id, spec.block_ids, STREAM_START_TIMEOUT_S)
        self._sending = {}
        self._block_table = block_table
        for spec in metadata.sends:
            if spec.block_ids is not None:  # a sequence's KV, computed before: it goes as it is
                progress = LayerProgress.complete(self.num_layers, spec.block_ids, NO_TOKEN)
            else:
                progress = self._sending[spec.request_id] = LayerProgress(self.num_layers)
            self.sender.send(spec.transfer_id, spec.endpoints[self.rank], progress, spec.num_blocks)

    def on_layer_done(self, layer: int) -> None:
        for request_id, progress in self._sending.items():
            progress.mark_ready(layer + 1, self._block_table(request_id) if layer == 0 else None)

    def end_step(self, sampled: dict[str, list[int]]) -> None:
        for request_id, progress in self._sending.items():
            tokens = sampled.get(request_id)
            if tokens:
                progress.set_first_token(tokens[0])
        self._sending = {}

    def poll(self) -> list[KVTransferResult]:
        return self.receiver.poll() + self.sender.poll()

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def resolve_host(host: str) -> str:
    """A configured transfer address; ``auto`` is this node's address in the Ray cluster (each
    worker resolves it where it runs)."""
    if host != "auto":
        return host
    import ray

    return ray.util.get_node_ip_address()
