"""The workers' side of the KV connector: each worker sends and receives KV on its own cache.

The engine's scheduler names, in each step's ``SchedulerOutput.kv_connector``, the transfers
to expect, to start (a prompt's KV as the forward writes it, or a migrating sequence's KV as it
is) and to cancel; the worker calls ``start_step`` before its forward,
``on_layer_done`` after each layer (the sender ships runs of layers as they are written),
``end_step`` with what it sampled (a sent prompt's first token travels after its KV), and
reports ``poll()`` back in its ``RunnerOutput``.

With tensor parallelism each rank holds a range of the model's KV heads, with pipeline
parallelism each stage a range of its layers, on either side and in any layout: a sending rank
sends each receiving rank the heads of the layers they share (a head replicated on several
ranks of a stage goes from the first), straight from its cache, and reports a transfer once all
its parts have ended (at once when it holds no head to send); a receiving rank takes parts until
they cover its heads of its layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from duet.kernels.kv_quant import cache_bytes_view
from duet.kv_transfer.endpoint import NO_TOKEN, STREAM_START_TIMEOUT_S
from duet.kv_transfer.progress import LayerProgress
from duet.kv_transfer.receiver import KVReceiver
from duet.kv_transfer.sender import KVSender
from duet.kv_transfer.spec import KVSpec
from duet.messages import KVEndpoint
from duet.outputs import KVConnectorMetadata, KVTransferResult


class KVConnectorWorker:
    def __init__(self, kv_cache: torch.Tensor, arch, config) -> None:
        """``config`` is the worker's (``duet.worker.WorkerConfig``), ``arch`` the whole model's
        shape (the rank's cache holds its share of the KV heads, of its stage's layers)."""
        from duet.models.pipeline_parallel import stage_layers
        from duet.models.tensor_parallel import shard_heads

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
        stage, rank_in_stage = config.stage_and_rank
        shards = [
            shard_heads(arch.num_heads, arch.num_kv_heads, config.tensor_parallel_size, rank).kv_heads for rank in range(rank_in_stage + 1)
        ]
        own = shards[-1]
        kv_heads = (own.start, own.stop)
        # The heads this rank sends: its own, but those a lower rank of its stage also holds (and sends).
        self.sent_heads = (max([own.start] + [shard.stop for shard in shards[:-1]]), own.stop)
        held = stage_layers(arch.num_layers, config.pipeline_parallel_size, stage)
        self.layers = (held.start, held.stop)
        self.num_layers = len(held)  # what this cache holds, and the forward reports
        kv_cache = cache_bytes_view(kv_cache)  # the bytes travel as they are, whatever their dtype
        name = f"{transfer.name}.{config.rank}"
        where = dict(kv_heads=kv_heads, layers=self.layers, shared_memory=transfer.shared_memory)
        self.sender = KVSender(kv_cache, spec, host, transfer.timeout_s, name=name, **where)
        self.receiver = KVReceiver(kv_cache, spec, host, transfer.timeout_s, **where)
        self._sending: dict[str, LayerProgress] = {}  # this step's sends, by request
        self._sent_blocks: dict[str, slice] = {}  # of each, what of its block table goes
        self._parts: dict[int, tuple[int, list[KVTransferResult]]] = {}  # a send's parts: how many, and those ended
        self._ended: list[KVTransferResult] = []  # sends with no part: ended as they started
        self._block_table: Callable[[str], list[int]] = lambda request_id: []
        # Sends go as the forward writes each layer, or once it is done (beside other engines'
        # threads on shared cores, a sender running during the forward slows every thread of it).
        self.stream_layers = transfer.stream_layers

    @property
    def endpoint(self) -> KVEndpoint:
        return self.receiver.endpoint

    @property
    def streaming(self) -> bool:
        """Whether this step's forward must report its layers (a send starts in it, and its layers
        stream)."""
        return bool(self._sending) and self.stream_layers

    def start_step(self, metadata: KVConnectorMetadata, block_table: Callable[[str], list[int]]) -> None:
        for transfer_id in metadata.cancels:
            self.receiver.cancel(transfer_id)
            self.sender.cancel(transfer_id)
        for spec in metadata.receives:
            # The prompt may wait behind others on the prefill replica before its layers stream.
            self.receiver.expect(spec.transfer_id, spec.block_ids, STREAM_START_TIMEOUT_S)
        self._sending, self._sent_blocks = {}, {}
        self._block_table = block_table
        for spec in metadata.sends:
            parts = self._parts_of(spec.endpoints)
            if not parts:  # every head this rank holds goes from a lower rank (or no receiver holds its layers)
                self._ended.append(KVTransferResult(spec.transfer_id, True))
                continue
            if spec.block_ids is not None:  # a sequence's KV, computed before: it goes as it is
                progress = LayerProgress.complete(self.num_layers, spec.block_ids, NO_TOKEN)
            else:
                progress = self._sending[spec.request_id] = LayerProgress(self.num_layers)
                self._sent_blocks[spec.request_id] = slice(spec.first_block, spec.first_block + spec.num_blocks)
            self._parts[spec.transfer_id] = (len(parts), [])
            for endpoint, heads, layers in parts:
                self.sender.send(spec.transfer_id, endpoint, progress, spec.num_blocks, heads=heads, layers=layers)

    def _parts_of(self, endpoints: tuple[KVEndpoint, ...]) -> list[tuple[KVEndpoint, tuple[int, int], tuple[int, int]]]:
        """Each receiving worker that holds some of the heads this rank sends, of some of its
        layers, with those heads and layers."""
        spec, parts = self.receiver.spec, []
        for endpoint in endpoints:
            heads = _overlap(endpoint.kv_heads or (0, spec.num_kv_heads), self.sent_heads)
            layers = _overlap(endpoint.layers or (0, spec.num_layers), self.layers)
            if heads is not None and layers is not None:
                parts.append((endpoint, heads, layers))
        return parts

    def on_layer_done(self, layer: int) -> None:
        for request_id, progress in self._sending.items():
            progress.mark_ready(layer + 1, self._sent_block_ids(request_id) if layer == 0 else None)

    def _sent_block_ids(self, request_id: str) -> list[int]:
        return self._block_table(request_id)[self._sent_blocks[request_id]]

    def end_step(self, sampled: dict[str, list[int]]) -> None:
        for request_id, progress in self._sending.items():
            if not self.stream_layers:  # every layer is in now (streamed, each was marked as it was written)
                progress.mark_ready(self.num_layers, self._sent_block_ids(request_id))
            tokens = sampled.get(request_id)
            if tokens:
                progress.set_first_token(tokens[0])
        self._sending, self._sent_blocks = {}, {}

    def poll(self) -> list[KVTransferResult]:
        ended, self._ended = self._ended, []
        for part in self.sender.poll():
            num_parts, parts = self._parts[part.transfer_id]
            parts.append(part)
            if len(parts) == num_parts:
                del self._parts[part.transfer_id]
                ended.append(KVTransferResult.combine(parts))
        return self.receiver.poll() + ended

    def on_results(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever a transfer of this worker's ends (from the transfer's thread):
        its engine may then step at once, rather than at its next poll."""
        self.sender.on_report = self.receiver.on_report = wake

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def _overlap(one: tuple[int, int], other: tuple[int, int]) -> tuple[int, int] | None:
    low, high = max(one[0], other[0]), min(one[1], other[1])
    return (low, high) if low < high else None


def resolve_host(host: str) -> str:
    """A configured transfer address; ``auto`` is this node's address in the Ray cluster (each
    worker resolves it where it runs)."""
    if host != "auto":
        return host
    import ray

    return ray.util.get_node_ip_address()
