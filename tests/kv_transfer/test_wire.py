"""A run of layers packed and unpacked with its checksum taken in the same pass (the C++ kernel,
``wire.pack_summed`` and ``wire.unpack_summed``): the same bytes and the same checksum as
torch's gather and scatter with ``faults.checksum`` read apart, for the layouts a transfer takes
(a range of heads, block ids in runs and scattered, bf16 and one-byte caches)."""

from __future__ import annotations

import pytest
import torch

from duet.kernels import cpu_ops
from duet.kv_transfer.faults import checksum
from duet.kv_transfer.wire import block_ops, pack_layers, pack_summed, packed_shape, unpack_layers, unpack_summed

needs_kernels = pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ CPU kernels do not build here")

# The kernel copies eight words at a time, then one: blocks of 64 words, of 10 (8 + 2) and of 3.
LAYOUTS = [
    pytest.param(torch.float32, slice(None), [5, 6, 7, 8, 2, 40, 41, 3], (16, 8), id="fp32-all-heads"),
    pytest.param(torch.bfloat16, slice(1, 3), [9, 1, 30, 31, 32, 33, 34], (4, 10), id="bf16-two-of-four-heads"),
    pytest.param(torch.uint8, slice(3, 4), [44, 0, 17], (4, 6), id="bytes-last-head"),
]


def _cache(dtype: torch.dtype, generator: torch.Generator, block: tuple[int, int] = (16, 8)) -> torch.Tensor:
    shape = (6, 2, 4, 48, *block)  # layers, K/V, heads, blocks, block size, head dim
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=dtype, generator=generator)
    return torch.randn(shape, generator=generator).to(dtype)


@needs_kernels
@pytest.mark.parametrize(("dtype", "heads", "block_ids", "block"), LAYOUTS)
def test_a_run_packed_with_its_checksum_is_torchs_gather_and_sum(dtype, heads, block_ids, block):
    cache = _cache(dtype, torch.Generator().manual_seed(1), block)
    ops = block_ops(cache)
    num_heads = len(range(*heads.indices(cache.shape[2])))
    expected = pack_layers(cache, 1, 4, block_ids, heads)
    out = torch.full(packed_shape(cache, 1, 4, len(block_ids), num_heads), 7, dtype=dtype)
    total = pack_summed(cache, 1, 4, block_ids, heads, out, ops)
    assert torch.equal(out, expected)
    assert total == checksum(expected)


@needs_kernels
@pytest.mark.parametrize(("dtype", "heads", "block_ids", "block"), LAYOUTS)
def test_a_run_unpacked_with_its_checksum_is_torchs_scatter_and_sum(dtype, heads, block_ids, block):
    generator = torch.Generator().manual_seed(2)
    cache = _cache(dtype, generator, block)
    num_heads = len(range(*heads.indices(cache.shape[2])))
    packed = _cache(dtype, generator, block)[2:5, :, :num_heads, : len(block_ids)].contiguous()
    expected = cache.clone()
    unpack_layers(expected, 2, 5, block_ids, packed, heads)
    total = unpack_summed(cache, 2, 5, block_ids, packed, heads, block_ops(cache))
    assert torch.equal(cache, expected)  # the other blocks, heads and layers untouched
    assert total == checksum(packed)


def test_without_the_kernel_the_torch_path_packs_unpacks_and_sums():
    generator = torch.Generator().manual_seed(3)
    cache = _cache(torch.float32, generator)
    block_ids = [3, 4, 11]
    out = torch.empty(packed_shape(cache, 0, 2, len(block_ids)))
    assert pack_summed(cache, 0, 2, block_ids, slice(None), out, None) is None  # its checksum is the sender's to take
    assert torch.equal(out, pack_layers(cache, 0, 2, block_ids))
    target = torch.zeros_like(cache)
    assert unpack_summed(target, 0, 2, [20, 21, 22], out, slice(None), None) == checksum(out)
    assert torch.equal(target[0:2, :, :, 20:23], out)


@needs_kernels
def test_a_flipped_bit_changes_the_checksum_taken_in_the_copy():
    cache = _cache(torch.float32, torch.Generator().manual_seed(4))
    ops = block_ops(cache)
    out = torch.empty(packed_shape(cache, 0, 6, 4))
    total = pack_summed(cache, 0, 6, [1, 2, 3, 9], slice(None), out, ops)
    out.view(torch.int32)[3, 1, 2, 2, 5, 6] ^= 1 << 17
    target = torch.zeros_like(cache)
    assert unpack_summed(target, 0, 6, [30, 31, 32, 33], out, slice(None), ops) != total


def test_blocks_the_kernel_cannot_take_go_by_torch():
    odd = torch.zeros(2, 2, 1, 4, 3, 1, dtype=torch.uint8)  # a 3-byte block
    assert block_ops(odd) is None
    assert block_ops(torch.zeros(2, 2, 1, 4, 16, 8).transpose(0, 1)) is None  # not the cache's own layout
