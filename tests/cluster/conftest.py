"""The cluster tests' replicas, built from their parts without Serve."""

import pytest

from duet.cluster.replica import EngineReplica
from duet.config import EngineArgs
from duet.decode_node.role import DecodeRole
from duet.engine import LLMEngine
from tests.cluster.replica_pair import DirectPeers


@pytest.fixture
def replica(tiny_llama_dir):
    """A decode replica with no peers (it moves nothing)."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=64, kv_transfer_config={"name": "decode-test"}))
    replica = EngineReplica("decode-test", DecodeRole(), engine)
    yield replica
    replica.loop.stop()
    engine.close()


def _decode_pair(tiny_llama_dir, **engine_kwargs):
    """Two decode replicas that can move sequences to one another by KV, over a real pair."""
    made = []

    def make(name: str, peers: DirectPeers) -> EngineReplica:
        engine = LLMEngine(
            EngineArgs(
                model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512, kv_transfer_config={"name": name, "timeout_s": 20.0},
                **engine_kwargs,
            )
        )
        made.append(EngineReplica(name, DecodeRole(), engine, peers))
        return made[-1]

    leaving_peers, staying_peers = DirectPeers(), DirectPeers()
    leaving, staying = make("leaving", leaving_peers), make("staying", staying_peers)
    leaving_peers.other, staying_peers.other = staying, leaving
    yield leaving, staying
    for replica in made:
        for task in replica._tasks:
            task.cancel()
        replica.loop.stop()
        replica.engine.close()


@pytest.fixture
def decode_pair(tiny_llama_dir):
    yield from _decode_pair(tiny_llama_dir)


@pytest.fixture
def speculating_pair(tiny_llama_dir):
    """The pair, drafting with a draft model (the tiny Llama itself: its drafts are mostly kept)."""
    config = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3, "adaptive": False}
    yield from _decode_pair(tiny_llama_dir, speculative_config=config)
