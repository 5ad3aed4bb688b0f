"""A 36-second ``duet bench soak`` on a real cluster (the ten-minute one is run by hand): mixed
load with client cancellations and a replica killed half-way, on a PD application of the tiny
model with n-gram speculation on two decode replicas. Guards the ledger: every request ends
exactly once with the tokens it should have or a reason, the router's counts agree with the
clients', and afterwards every replica's bookkeeping holds with no KV block in use."""

from __future__ import annotations

import asyncio

import pytest

from duet.benchmarks import soak

pytestmark = pytest.mark.slow

SOAK_APP = {
    "mode": "pd",
    "engine": {"max_model_len": 1024, "num_kv_blocks": 4096, "max_num_seqs": 32},
    "prefill": {"ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}},
    "decode": {
        "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1},
        "engine": {"num_threads": 1, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    },
    "router": {"ray_actor_options": {"num_cpus": 0}, "max_running_sequences": 24, "max_queued_requests": 8},
}


def test_mixed_load_with_a_replica_killed_keeps_the_ledger_exact(deploy, tmp_path):
    url = deploy("soak", SOAK_APP)
    args = soak.parser().parse_args([
        "--duration-s", "36", "--rate", "6", "--app", "soak", "--kill-every-s", "18", "--token-range", "3-49000",
        "--output-len", "4-32", "--seed", "1",
        # A leak never ends, so a generous bound still finds one. The release itself is quick:
        # transfers queued for the killed replica fail as soon as its address refuses them
        # (kv_transfer/group.py's connect_store), not after the store client's retries.
        "--settle-s", "120",
    ])
    ledger = asyncio.run(soak.run(url, "tiny", args))
    print(ledger.report())
    ledger.plot(str(tmp_path / "soak.png"))
    counts = ledger.counts
    assert counts["completed"] > 60 and counts["cancelled"] > 0 and len(ledger.kills) == 1
    assert ledger.violations() == []
