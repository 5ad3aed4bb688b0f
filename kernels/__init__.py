"""Attention over paged KV and the KV-cache write: one dispatch point, by device.

CUDA tensors go to the Triton kernels; CPU tensors to the C++ kernels of ``cpu_ops`` (one for
decode-sized queries, one for prompt chunks), and to torch when the C++ kernels are
unavailable. Quantized caches (``kv_quant``) are written by torch on every device, and
attention over them runs in their Hadamard basis: ``rope_and_write_kv`` leaves the query
there (for free, in the C++ pass over it) and the output leaves it here.
"""

from __future__ import annotations

import sys

if __name__ != "duet.kernels":
    # Imported as a bare ``kernels``: the checkout's root is on sys.path (pytest's pythonpath, a
    # script run from the root, a Ray worker given the driver's path), and this folder would shadow
    # the Hugging Face distribution of that name, which transformers imports. Hand the import over
    # to whatever else on sys.path owns the name; where nothing does, the name is an empty namespace
    # package, as a folder without __init__.py would be (what transformers' probes take for "absent").
    def _hand_over(name: str) -> None:
        import importlib.machinery
        import importlib.util
        import os

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        if spec is None:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = []
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # the import statement returns what sys.modules holds at the end
        if spec.loader is None:
            return
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise

    _hand_over(__name__)

import torch

from duet.kernels import cpu_ops
from duet.kernels.kv_quant import is_quantized, rotate
from duet.kernels.metadata import AttentionMetadata
from duet.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.is_cuda and not is_quantized(key_cache):
        from duet.kernels.triton_attention import write_kv_cache_triton

        write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        write_kv_cache_torch(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Causal attention over paged KV; with ``window``, each query sees its last ``window`` keys
    (itself included); with ``softcap``, scores become ``softcap * tanh(score / softcap)``. A
    step whose every sequence is within the window computes as without one. On CPU a window
    reached is masked by the C++ kernels, and caps computed by the prompt kernel (short queries'
    caps in torch); caps and windows on a GPU (the Triton kernels have neither) in torch.
    ``batch_invariant``: every row through the C++ prompt kernel (``duet.models.batch_invariant``)."""
    if batch_invariant:
        attend = lambda *args: paged_attention_torch(  # noqa: E731
            *args, native_ops=cpu_ops.load(), window=window, softcap=softcap, batch_invariant=True
        )
    elif softcap is not None or (window is not None and metadata.max_seq_len > window):
        native_ops = None if query.is_cuda else cpu_ops.load()
        attend = lambda *args: paged_attention_torch(*args, native_ops=native_ops, window=window, softcap=softcap)  # noqa: E731
    else:
        attend = _attend
    if is_quantized(key_cache):  # the query is in the cache's basis already (rope_and_write_kv)
        return rotate(attend(query, key_cache, value_cache, metadata, scale))
    return attend(query, key_cache, value_cache, metadata, scale)


def _attend(query, key_cache, value_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    if query.is_cuda:
        from duet.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(query, key_cache, value_cache, metadata, scale)
    return paged_attention_torch(query, key_cache, value_cache, metadata, scale, native_ops=cpu_ops.load())
