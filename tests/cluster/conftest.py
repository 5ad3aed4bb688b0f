"""The cluster tests' replicas, built from their parts without Serve."""

import pytest

from duet.cluster.replica import EngineReplica
from duet.config import EngineArgs
from duet.decode_node.role import DecodeRole
from duet.engine import LLMEngine


@pytest.fixture
def replica(tiny_llama_dir):
    """A decode replica with no peers (it moves nothing)."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=64, kv_transfer_config={"name": "decode-test"}))
    replica = EngineReplica("decode-test", DecodeRole(), engine)
    yield replica
    replica.loop.stop()
    engine.close()
