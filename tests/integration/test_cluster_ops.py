"""Operating the cluster: metrics, ``duet status``, client disconnects."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.integration.client import metric

pytestmark = pytest.mark.slow


def _metric_values(cluster, name: str) -> dict[str, float]:
    """``{labels: value}`` for one metric of the PD application's /metrics."""
    return metric(cluster.url, name)


def _wait_for(condition, timeout_s: float, interval_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(interval_s)
    return condition()


def _busy(cluster) -> bool:
    usage = _metric_values(cluster, "vllm:kv_cache_usage_perc")
    running = _metric_values(cluster, "vllm:num_requests_running")
    return any(usage.values()) or any(running.values())


def test_metrics_carry_vllm_names_and_a_stage_label(cluster):
    client = cluster.client()
    prompt = "Summarise the plot of Romeo and Juliet in two sentences, please, for a school report."
    for _ in range(2):  # the second prefill finds the prompt's blocks in the prefix cache
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    time.sleep(1.5)  # replicas report stats every 0.5 s
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    for family in (
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "duet:kv_transfer_bytes_total", "duet:kv_transfer_seconds_total",
    ):
        assert family in text, family
    hits = _metric_values(cluster, "vllm:prefix_cache_hits_total")
    assert any('stage="prefill"' in labels and value > 0 for labels, value in hits.items())
    sent = _metric_values(cluster, "duet:kv_transfer_bytes_total")
    assert any('stage="decode"' in labels and value > 0 for labels, value in sent.items())
    # Sends measure their wire time (the cost of a pull, #40); receives measure none.
    wire_bytes = _metric_values(cluster, "duet:kv_transfer_wire_bytes_total")
    wire_seconds = _metric_values(cluster, "duet:kv_transfer_wire_seconds_total")
    assert any('stage="prefill"' in labels and value > 0 and wire_seconds[labels] > 0 for labels, value in wire_bytes.items())
    assert all(wire_bytes[labels] <= value for labels, value in sent.items())
    tiers = _metric_values(cluster, "duet:kv_offload_capacity_blocks")  # kv_offload reached both pools' engines
    assert {stage for stage in ("prefill", "decode") if any(f'stage="{stage}"' in labels and value > 0 for labels, value in tiers.items())} == {
        "prefill", "decode",
    }


def test_speculation_on_the_decode_pool_is_exact_and_counted(cluster):
    """Greedy text that quotes the prompt: n-gram drafts are accepted, the output is the
    colocated application's (no speculation), and the decode pool's counters show it."""
    text = "The lighthouse keeper climbed the narrow stairs every night and polished the great lens until it shone."
    messages = [{"role": "user", "content": f"Repeat this sentence exactly: {text}"}]
    answers = [
        client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, temperature=0)
        for client in (cluster.client(), cluster.client(colocated=True))
    ]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    time.sleep(1.5)
    drafts = _metric_values(cluster, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric_values(cluster, "vllm:spec_decode_num_accepted_tokens_total")
    assert any('stage="decode"' in labels and value > 0 for labels, value in accepted.items()), accepted
    assert sum(accepted.values()) <= sum(drafts.values())
    per_position = _metric_values(cluster, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert any('position="0"' in labels for labels in per_position)
    mean_length = _metric_values(cluster, "duet:spec_decode_mean_accepted_length")
    assert any('stage="decode"' in labels and value > 1 for labels, value in mean_length.items())


def test_status_lists_pools_and_replicas(cluster, capsys, monkeypatch):
    from duet.cluster.cli import main

    monkeypatch.setenv("DUET_ADMIN_API_KEY", cluster.admin_key)
    assert main(["status", "--url", cluster.url]) == 0
    out = capsys.readouterr().out
    # pool, replica, its node, the role it serves, running, waiting
    assert re.search(r"^prefill\s+\S+\s+[0-9a-f]{8}\s+(prefill|decode)\s+\d+\s+\d+", out, re.M)
    assert re.search(r"^decode\s+\S+\s+[0-9a-f]{8}\s+(prefill|decode)\s+\d+\s+\d+", out, re.M)


def test_client_disconnect_frees_the_blocks_in_both_pools(cluster):
    assert _wait_for(lambda: not _busy(cluster), 30), "cluster busy before the test"
    body = {
        "model": "smollm2", "prompt": "Write a very long essay about the history of the bicycle.",
        "max_tokens": 600, "ignore_eos": True, "stream": True,
    }
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{cluster.url}/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            # Keep reading (so the request stays alive) until the stats show it holding blocks.
            for _ in range(100):
                line = next(lines)
                if line.startswith("data: "):
                    json.loads(line[6:])
                    if _busy(cluster):
                        break
            else:
                pytest.fail("the streaming request was never seen holding blocks")
    # Leaving the `with` closed the connection with ~590 tokens still to go.
    assert _wait_for(lambda: not _busy(cluster), 30), "blocks still held after the client went away"
