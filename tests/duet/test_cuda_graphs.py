"""The CUDA-graph buckets and which models and engines capture them; the replays themselves
run in ``tests/gpu`` (a CUDA device)."""

from __future__ import annotations

import pytest

from duet.config import ConfigError, EngineArgs
from duet.cuda_graphs import MAX_CAPTURED, capture_sizes


def test_buckets_cover_every_batch_the_engine_can_schedule():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(10_000)[-1] == MAX_CAPTURED
    for max_num_seqs in range(1, 70):
        sizes = capture_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs


def test_enforce_eager_is_a_boolean():
    assert EngineArgs(enforce_eager=True).enforce_eager
    with pytest.raises(ConfigError, match="enforce_eager"):
        EngineArgs(enforce_eager="no")
