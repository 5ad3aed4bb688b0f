"""Moving KV blocks between replicas over pairwise torch.distributed groups (NCCL or gloo)."""

from duet.kv_transfer.group import Endpoint
from duet.kv_transfer.handle import KVDestination, KVHandle
from duet.kv_transfer.spec import KVSpec, KVSpecMismatchError
from duet.kv_transfer.transfer import KVReceiver, KVSender, TransferResult

__all__ = ["Endpoint", "KVDestination", "KVHandle", "KVReceiver", "KVSender", "KVSpec", "KVSpecMismatchError", "TransferResult", "engine_kv_spec"]


def engine_kv_spec(engine) -> KVSpec:
    """The KV layout of an ``LLMEngine``, for the handshake."""
    arch = engine.model_config
    return KVSpec(
        model=engine.args.model,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        block_size=engine.block_size,
        kv_dtype=str(engine.runner.kv_cache.dtype).removeprefix("torch."),
    )
