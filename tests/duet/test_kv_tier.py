"""The second KV tier's index and copies: what the pool evicts is saved, a later lookup past the
pool's hits finds it, the copies run in the order that keeps every block's KV right."""

import pytest
import torch

from duet.config import ConfigError, KVOffloadConfig
from duet.kv_cache_manager import KVCacheManager
from duet.kv_tier import KVTier, KVTierStore, TierBlock
from duet.outputs import KVTierOps
from duet.request import Request
from duet.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=8), eos_token_id=None)


def _admit(manager: KVCacheManager, request: Request):
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return hits, num_hit_tokens


def test_the_index_keeps_the_most_recently_used_and_never_overwrites_a_pinned_slot():
    tier = KVTier(2)
    tier.save(10, block_hash=1, token_ids=(1, 2))
    tier.save(11, block_hash=2, token_ids=(3, 4))
    assert tier.take_ops().saves == [(10, 0), (11, 1)]
    tier.save(12, block_hash=1, token_ids=(1, 2))  # already held: no write, now the most recent
    assert not tier.take_ops()
    tier.save(13, block_hash=3, token_ids=(5, 6))  # evicts hash 2, the least recently used
    assert tier.take_ops().saves == [(13, 1)]
    assert 2 not in tier and 1 in tier and 3 in tier
    assert tier.lookup(1, (1, 9)) is None  # a hash's tokens are checked
    hit = tier.lookup(3, (5, 6))
    tier.pin([hit])
    tier.save(14, block_hash=4, token_ids=(7, 8))  # takes slot 0 (hash 1), not the pinned slot 1
    tier.restore(hit, 20)
    tier.save(15, block_hash=5, token_ids=(9, 9))  # slot 0 again: the pinned one is never taken
    ops = tier.take_ops()
    assert ops.saves == [(14, 0), (15, 0)] and ops.loads == [(1, 20)]  # saves run in order: 15's KV stays
    assert 4 not in tier and 5 in tier and tier.num_saved == 5 and tier.num_restored == 1
    tier.save(16, block_hash=6, token_ids=(0, 0))  # the pin ended with the step: hash 3 in slot 1 is the oldest
    assert tier.take_ops().saves == [(16, 1)] and 3 not in tier


def test_a_prompt_evicted_from_the_pool_comes_back_from_the_tier():
    tier = KVTier(16)
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_caching=True, tier=tier)
    first = _request("a", list(range(9)))  # two full blocks and one partial
    _admit(manager, first)
    first_blocks = manager.block_ids("a")
    manager.free(first)
    other = _request("b", list(range(100, 113)))  # four blocks: every block of "a" is evicted
    _admit(manager, other)
    saves = manager.take_tier_ops().saves
    assert sorted(block for block, _ in saves) == sorted(first_blocks[:2])  # the full, hashed ones
    manager.free(other)

    again = _request("c", list(range(9)) + [50, 51, 52])
    hits, num_hit_tokens = _admit(manager, again)
    assert num_hit_tokens == 8 and all(isinstance(hit, TierBlock) for hit in hits)
    ops = manager.take_tier_ops()
    slots_saved = {slot for _, slot in saves}
    assert {slot for slot, _ in ops.loads} == slots_saved
    assert [block for _, block in ops.loads] == manager.block_ids("c")[:2]  # restored in the prompt's order
    assert manager.is_cached(hits[0].block_hash)
    manager.check_integrity()
    stats = manager.stats("auto", "float32", 64)
    assert (stats.tier_capacity_blocks, stats.tier_saved_blocks, stats.tier_restored_blocks) == (16, 4, 2)


def test_a_steps_restores_keep_their_slots_from_that_steps_saves():
    tier = KVTier(2)
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE, enable_caching=True, tier=tier)
    first = _request("a", list(range(9)))
    _admit(manager, first)
    manager.free(first)
    filler = _request("b", list(range(100, 109)))
    _admit(manager, filler)  # evicts both of "a"'s full blocks: the tier is full
    manager.free(filler)
    assert len(manager.take_tier_ops().saves) == 2
    again = _request("c", list(range(9)))
    hits, _ = _admit(manager, again)
    assert all(isinstance(hit, TierBlock) for hit in hits)
    ops = manager.take_tier_ops()
    # Restoring evicts "b"'s blocks, but the only slots are the ones this step loads from.
    assert len(ops.loads) == 2 and ops.saves == []
    assert tier.num_blocks == 2 and manager.is_cached(hits[0].block_hash)
    manager.check_integrity()


def test_the_store_copies_saves_before_loads_whatever_the_step_holds():
    cache = torch.arange(2 * 2 * 1 * 3 * 2 * 2, dtype=torch.float32).view(2, 2, 1, 3, 2, 2)
    original = cache.clone()
    store = KVTierStore(cache, capacity_blocks=2)
    store.apply(KVTierOps(saves=[(0, 1), (2, 0)]))
    # Block 0 is saved before slot 1 (block 0's old KV) is loaded into block 2.
    store.apply(KVTierOps(saves=[(1, 0)], loads=[(1, 2)]))
    assert torch.equal(cache[:, :, :, 2], original[:, :, :, 0])
    assert torch.equal(store.store[:, :, :, 0], original[:, :, :, 1])


def test_a_disk_tier_maps_a_file_that_leaves_nothing_behind(tmp_path):
    cache = torch.randn(1, 2, 1, 4, 2, 3)
    store = KVTierStore(cache, capacity_blocks=3, path=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # unlinked at once; the mapping stays
    store.apply(KVTierOps(saves=[(3, 2)]))
    store.apply(KVTierOps(loads=[(2, 0)]))
    assert torch.equal(cache[:, :, :, 0], cache[:, :, :, 3])


def test_settings_that_cannot_work_fail_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="kv_offload.tier"):
        KVOffloadConfig(tier="gpu")
    with pytest.raises(ConfigError, match="kv_offload.path"):
        KVOffloadConfig(tier="disk")
    with pytest.raises(ConfigError, match="kv_offload.size_gib"):
        KVOffloadConfig(size_gib=0)
    with pytest.raises(ConfigError, match="unknown settings"):
        KVOffloadConfig.from_dict({"tier": "cpu", "size": 1})
    with pytest.raises(ConfigError, match="kv_offload.size_gib"):
        KVOffloadConfig(size_gib=1 << 20).check_fits()  # a petabyte of host memory
    with pytest.raises(ConfigError, match="kv_offload.path"):
        KVOffloadConfig(tier="disk", path=str(tmp_path / "missing")).check_fits()
    with pytest.raises(ConfigError, match="kv_offload.size_gib"):
        KVOffloadConfig(tier="disk", size_gib=1 << 20, path=str(tmp_path)).check_fits()
    assert KVOffloadConfig(size_gib=1 / 1024).num_blocks(4096) == 256
    with pytest.raises(ConfigError, match="kv_offload.dtype='int4'"):
        KVOffloadConfig(dtype="int4")
    assert KVOffloadConfig(dtype="int8").quantized and not KVOffloadConfig().quantized
    from duet.config import EngineArgs

    with pytest.raises(ConfigError, match="kv_offload.dtype=int8 compresses a float KV cache; kv_cache_dtype='int8'"):
        EngineArgs(model="m", kv_cache_dtype="int8", kv_offload={"dtype": "int8", "size_gib": 0.01})


@pytest.mark.parametrize("path", [False, True], ids=["host", "disk"])
def test_an_int8_tier_keeps_rows_as_the_int8_cache_does_and_restores_them_in_the_models_basis(tmp_path, path):
    """``dtype: int8``: a saved block's rows are the int8 KV cache's (``quantize_rows``: codes in
    the Hadamard basis and a byte of scale, 65 bytes a row of 64), and a restored one is those
    rows' values taken back to the model's basis (``rotate``), bit for bit; blocks not loaded
    are untouched."""
    from duet.kernels.kv_quant import dequantize_rows, quantize_rows, rotate

    cache = torch.randn(2, 2, 3, 6, 4, 64, generator=torch.Generator().manual_seed(0))
    original = cache.clone()
    store = KVTierStore(cache, capacity_blocks=3, path=str(tmp_path) if path else None, quantized=True)
    assert store.store.dtype == torch.int8 and store.store.shape == (2, 2, 3, 3, 4, 65)
    store.apply(KVTierOps(saves=[(4, 2), (1, 0)]))
    assert torch.equal(store.store[:, :, :, 2], quantize_rows(original[:, :, :, 4], torch.int8))
    store.apply(KVTierOps(loads=[(2, 0), (0, 5)]))
    for slot, block, source in ((2, 0, 4), (0, 5, 1)):
        expected = rotate(dequantize_rows(quantize_rows(original[:, :, :, source], torch.int8), torch.float32))
        assert torch.equal(cache[:, :, :, block], expected)
        assert (expected - original[:, :, :, source]).abs().max() < 0.05 * original[:, :, :, source].abs().max()
    assert torch.equal(cache[:, :, :, 1:5], original[:, :, :, 1:5])
