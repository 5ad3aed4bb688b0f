"""Fixtures of the engine core's tests."""

import pytest

from duet.kv_cache_manager import KVCacheManager
from duet.scheduler import Scheduler

BLOCK_SIZE = 4


@pytest.fixture
def make_scheduler():
    """Build schedulers; after the test, their KV bookkeeping must hold and idle ones must hold no block."""
    made: list[Scheduler] = []

    def make(
        num_blocks: int = 32,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 128,
        enable_chunked_prefill: bool = True,
        enable_caching: bool = True,
    ) -> Scheduler:
        manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)
        scheduler = Scheduler(manager, max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.kv_cache_manager.check_integrity()
        if not scheduler.has_unfinished_requests():
            scheduler.kv_cache_manager.block_pool.check_integrity(expect_all_free=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray of two CPUs for the tests that start workers as actors; shut down after the module."""
    import ray

    from tests.conftest import pin_cpu_rules

    pin_cpu_rules()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()
