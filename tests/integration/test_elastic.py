"""Pools that follow their load, and sequences that outlive their decode replica, on a real
cluster: applications of the tiny model deployed beside the session's, driven over HTTP.

- A decode replica stopped by a scale-down (an operator's pin through ``/duet/scale``, acted on
  by the pool's autoscaling policy and Serve) moves its live streams to the other replica by
  KV: greedy, seeded, stop-string and schema-constrained streams read on as if nothing had
  happened.
- Past ``router.max_migrations`` a stream ends with an error event, and nothing leaks.
- Prompt-heavy load grows the prefill pool; long outputs grow the decode pool; idle shrinks both
  to their minimum; every request completes with the offline engine's tokens; every decision a
  pool's policy published is justified by the numbers it published with it (what else grows
  depends on the machine's speed, so it is not asserted).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from tests.integration.client import (
    complete, complete_text, duet_status, greedy_body, metric, random_prompt, running_per_replica, settled, wait_for,
)

pytestmark = pytest.mark.slow

SMALL_POOL = {"ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}}
LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 150, "maxItems": 150}
# A tool whose one call is long (its arguments hold LONG_ARRAY): the call is under way when it moves.
LONG_CALL_TOOL = {"type": "object", "properties": {"values": LONG_ARRAY}, "required": ["values"], "additionalProperties": False}


def _moves_app(max_migrations: int) -> dict:
    """PD with two decode replicas that the test scales down to one while streams run."""
    # The pins decide: the policy holds a pinned size, and Serve's delays are short.
    decode_scaling = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 1,
                      "cooldown_s": 0}
    return {
        "mode": "pd",
        "engine": {"max_model_len": 1024, "num_kv_blocks": 8192, "max_num_seqs": 64},
        "prefill": SMALL_POOL,
        "decode": SMALL_POOL | {"autoscaling_config": decode_scaling},
        "router": {"ray_actor_options": {"num_cpus": 0}, "max_migrations": max_migrations},
        # Roles stay put: a decode replica lent to prefill for the burst of prompts holds no
        # streams, and Serve stops the newest replica whichever role it serves.
        "roles": {"move": False},
    }

def _pinned_at(url: str, pool: str, replicas: int) -> bool:
    """The pool's policy holds the pin (a scale-down decided before it may still be under way
    when it is set), and that many replicas run and report."""
    status = duet_status(url)["pools"][pool]
    record = status.get("autoscaler") or {}
    settled = (record.get("reason"), record.get("target"), record.get("running")) == ("pinned", replicas, replicas)
    return settled and len(status["stats"]) == replicas

def _scale(url: str, pool: str, replicas: int | None) -> None:
    response = httpx.post(f"{url}/duet/scale", json={"pool": pool, "replicas": replicas}, timeout=10)
    assert response.status_code == 200, response.text


async def _stream_text(client: httpx.AsyncClient, url: str, body: dict, token_ids: list[int]) -> tuple[str, list[int], list[dict]]:
    status, text, tokens, errors = await complete_text(client, url, body, token_ids)
    assert status == 200, errors
    return text, tokens, errors


def _streams_scaled_down_midway(url: str, bodies: list[dict]) -> list[tuple[str, list[int], list[dict]]]:
    """Run the streams on both decode replicas and scale the pool down to one meanwhile."""
    _scale(url, "decode", 2)
    wait_for(lambda: _pinned_at(url, "decode", 2), 120, "two decode replicas, pinned")

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            seen: list[list[int]] = [[] for _ in bodies]
            tasks = [asyncio.create_task(_stream_text(client, url, body, ids)) for body, ids in zip(bodies, seen)]
            # Scale down once both replicas report streams and every stream reads from its decode
            # replica (its second token: the first is the prefill replica's) or ended. A fixed wait
            # let short streams end first on a fast machine, and placed some on the leaving replica on a slow one.
            deadline = time.monotonic() + 60
            while True:
                await asyncio.sleep(0.2)
                decoding = all(len(ids) >= 2 or task.done() for ids, task in zip(seen, tasks))
                running = running_per_replica(url, "decode")
                if decoding and len(running) == 2 and all(running.values()):
                    break
                assert time.monotonic() < deadline, (
                    f"streams decoding on both replicas before the scale-down: {running}; tokens per stream {[len(ids) for ids in seen]}"
                )
            _scale(url, "decode", 1)
            return await asyncio.gather(*tasks)

    return asyncio.run(run())


def _late_stop(text: str) -> str:
    """Three characters first met past 90% of ``text``: the stream lives until after the move."""
    starts = [start for start in range(int(len(text) * 0.9), len(text) - 2) if text.find(text[start : start + 3]) == start]
    assert starts, "no stop string first met late in this output"
    return text[starts[0] : starts[0] + 3]


def _migrations(url: str) -> dict[str, float]:
    return {labels.split('how="')[1].split('"')[0]: value for labels, value in metric(url, "duet:migrations_total").items()}


def test_a_scale_down_moves_live_streams_by_kv_and_they_read_on_unchanged(cluster, tiny_offline, deploy):
    from duet import SamplingParams, StructuredOutputs
    from duet.tool_call_parser import parse_output
    from duet.tool_calls import Tool, tool_grammar

    url = deploy("moves", _moves_app(max_migrations=3))
    for wrong, field in (({"pool": "prefill", "replicas": 2}, "pool"), ({"pool": "decode", "replicas": 0}, "replicas")):
        response = httpx.post(f"{url}/duet/scale", json=wrong, timeout=10)  # a fixed pool; no pool of 0
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
    rng = random.Random(12)
    prompts = [random_prompt(rng, rng.randrange(20, 120)) for _ in range(8)]
    cases = []
    for index, prompt in enumerate(prompts):
        # Past EOS by ignore_eos: min_tokens would hold stop strings off too.
        sampling = {"ignore_eos": True} | ({"temperature": 0.8, "seed": 1000 + index} if index % 2 else {"temperature": 0.0})
        stop = None
        if index % 4 == 3:  # a stop string met late, after the move
            text = tiny_offline.llm.generate([prompt], SamplingParams(max_tokens=850, **sampling))[0].outputs[0].text
            stop = _late_stop(text)
        cases.append((prompt, sampling, stop))
    expected = [
        tiny_offline.llm.generate([prompt], SamplingParams(max_tokens=850, stop=[stop] if stop else None, **sampling))[0]
        .outputs[0]
        for prompt, sampling, stop in cases
    ]
    bodies = [
        {"model": "tiny", "prompt": prompt, "max_tokens": 850, "return_token_ids": True, "stream": True, **sampling}
        | ({"stop": [stop]} if stop else {})
        for prompt, sampling, stop in cases
    ]
    # Two streams under a schema whose state is the count of items so far: a matcher restarted
    # from the schema's root after the move would refuse the next token.
    for index, sampling in enumerate(({"temperature": 0.0}, {"temperature": 0.8, "seed": 7})):
        prompt = random_prompt(rng, 40 + index)
        params = SamplingParams(max_tokens=850, structured_outputs=StructuredOutputs(json=LONG_ARRAY), **sampling)
        expected.append(tiny_offline.llm.generate([prompt], params)[0].outputs[0])
        bodies.append(
            {"model": "tiny", "prompt": prompt, "max_tokens": 850, "return_token_ids": True, "stream": True, **sampling,
             "structured_outputs": {"json": LONG_ARRAY}}
        )

    # A tool call made valid by construction (the grammar a chat request with tools gets, in
    # Hermes' format), moved mid-call: its grammar's state goes with it.
    call_grammar = tool_grammar([Tool("record", LONG_CALL_TOOL)], "required", False)
    prompt = random_prompt(rng, 50)
    params = SamplingParams(max_tokens=850, temperature=0.0, structured_outputs=StructuredOutputs(grammar=call_grammar))
    expected.append(tiny_offline.llm.generate([prompt], params)[0].outputs[0])
    bodies.append(
        {"model": "tiny", "prompt": prompt, "max_tokens": 850, "return_token_ids": True, "stream": True, "temperature": 0.0,
         "structured_outputs": {"grammar": call_grammar}}
    )

    results = _streams_scaled_down_midway(url, bodies)

    for (text, tokens, errors), want in zip(results, expected):
        assert errors == []
        assert (text, tokens) == (want.text, want.token_ids)
    for text, _, _ in results[len(cases) : -1]:
        assert len(json.loads(text)) == LONG_ARRAY["minItems"]
    _, (call,) = parse_output(results[-1][0])
    assert call.name == "record" and len(json.loads(call.arguments)["values"]) == LONG_ARRAY["minItems"]
    migrations = _migrations(url)
    assert migrations["kv"] >= 1 and migrations["recompute"] == 0, migrations
    assert len(running_per_replica(url, "decode")) == 1
    assert settled(cluster, url)["ok"]


def test_a_stream_past_max_migrations_ends_with_an_error_event_and_leaks_nothing(cluster, tiny_offline, deploy):
    url = deploy("nomoves", _moves_app(max_migrations=0))
    rng = random.Random(13)
    prompts = [random_prompt(rng, 40) for _ in range(8)]
    expected = tiny_offline(prompts, 850)

    results = _streams_scaled_down_midway(url, [greedy_body(prompt, 850, stream=True) for prompt in prompts])

    failed = 0
    for (_, tokens, errors), want in zip(results, expected):
        if errors:
            failed += 1
            assert len(errors) == 1 and errors[0]["error"]["code"] == 503
            assert "max_migrations" in errors[0]["error"]["message"]
            assert tokens == want[: len(tokens)] and len(tokens) < len(want)
        else:
            assert tokens == want
    assert failed >= 1
    assert settled(cluster, url)["ok"]


class _Timeline:
    """Replicas reporting per pool, and each pool's latest autoscaling decision, sampled twice a
    second in the background, by phase."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.phase = "start"
        self.samples: list[tuple[str, int, int]] = []
        self.decisions: list[tuple[str, dict]] = []  # (phase, published record), each record once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        seen = set()
        while not self._stop.wait(0.5):
            try:
                pools = duet_status(self.url)["pools"]
            except httpx.HTTPError:
                continue
            self.samples.append((self.phase, len(pools["prefill"]["stats"]), len(pools["decode"]["stats"])))
            for pool in ("prefill", "decode"):
                record = pools[pool].get("autoscaler")
                key = record and (record["stage"], record["current"], record["target"], record["reason"], json.dumps(record["numbers"]))
                if record and key not in seen:
                    seen.add(key)
                    self.decisions.append((self.phase, record))

    def counts(self, phase: str, pool: str) -> list[int]:
        return [sample[1 if pool == "prefill" else 2] for sample in self.samples if sample[0] == phase]


def _unjustified(record: dict) -> str | None:
    """What is wrong with a published decision whose reason its own numbers do not bear out
    (``duet.cluster.autoscale``'s rules, restated); None when they do."""
    reason = record["reason"].removesuffix(", bounded")
    numbers, current = record["numbers"], record["current"]
    if reason == "prompt_backlog":
        ok = numbers["prompt_backlog"] > numbers["per_replica"] * current
    elif reason == "kv_usage":
        ok = numbers["kv_used_blocks"] > numbers["blocks_per_replica"] * numbers["kv_target"] * current
    elif reason == "waiting":
        ok = numbers["waiting"] > 0
    elif reason in ("ttft", "ttft_decode_bound"):
        ok = numbers["ttft_s"] > numbers["ttft_target_s"]
    elif reason == "tpot":
        ok = numbers["tpot_s"] > numbers["tpot_target_s"]
    elif reason == "low_load":
        ok = record["target"] < current
    else:  # steady, cooldown, awaiting metrics: no change made
        ok = record["target"] == current or reason.startswith(("cooldown", "awaiting_metrics"))
    return None if ok else f"{record['stage']}: {reason} with {numbers} ({current} -> {record['target']})"


async def _load(url: str, prompt_len: int, max_tokens: int, concurrency: int, until, max_s: float, rng: random.Random) -> list:
    """``concurrency`` clients sending fresh random prompts, one after another, until ``until()``
    holds (then a few seconds more) or ``max_s`` passed: (prompt, result)s."""
    results = []
    deadline = time.monotonic() + max_s

    async def client_loop(client):
        while time.monotonic() < deadline:
            prompt = random_prompt(rng, prompt_len)
            results.append((prompt, await complete(client, url, greedy_body(prompt, max_tokens, stream=True))))

    async def watch():
        nonlocal deadline
        while time.monotonic() < deadline and not until():
            await asyncio.sleep(0.5)
        deadline = min(deadline, time.monotonic() + 3)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await asyncio.gather(watch(), *(client_loop(client) for _ in range(concurrency)))
    return results


def test_each_pool_follows_its_own_load(cluster, tiny_offline, deploy):
    scaling = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 3, "metrics_interval_s": 0.5,
               "look_back_period_s": 2, "cooldown_s": 2}
    url = deploy("elastic", {
        "mode": "pd",
        # 8 streams of 32 + 400 tokens, started one after another, hold ~116 of 512 blocks on average (Serve's look-back
        # mean swings 75-165): well past the 0.1 below at every sample, so the decision holds through upscale_delay_s.
        "engine": {"max_model_len": 1024, "num_kv_blocks": 512, "max_num_seqs": 64},
        "prefill": SMALL_POOL | {"autoscaling_config": scaling | {"prompt_tokens_per_replica": 400}},
        "decode": SMALL_POOL | {"autoscaling_config": scaling | {"kv_usage": 0.1}},
        "router": {"ray_actor_options": {"num_cpus": 0}, "max_running_sequences": 16},
        # Each pool's own policy decides: a replica lent to the other role would answer its load first, as soon as the
        # machine's speed makes the other role spare.
        "roles": {"move": False},
    })
    rng = random.Random(14)
    decode_tokens = 400
    with _Timeline(url) as timeline:
        # Each phase lasts until its pool has grown (a replica takes 5-90 s to start on a busy 2-core machine:
        # eight clients leave it cores to start on), and at least long enough for the other pool to grow if it would.
        def grown(pool: str):
            return lambda: len(timeline.counts(timeline.phase, pool)) > 20 and timeline.counts(timeline.phase, pool)[-1] == 2

        timeline.phase = "prompt-heavy"
        prompt_heavy = asyncio.run(_load(url, 500, 1, concurrency=8, until=grown("prefill"), max_s=180, rng=rng))
        timeline.phase = "decode-heavy"
        decode_heavy = asyncio.run(_load(url, 32, decode_tokens, concurrency=8, until=grown("decode"), max_s=180, rng=rng))
        timeline.phase = "idle"
        wait_for(lambda: len(timeline.counts("idle", "prefill")) > 4 and timeline.counts("idle", "prefill")[-1] == 1
                  and timeline.counts("idle", "decode")[-1] == 1, 60, "both pools back to one replica")

    summary = [(phase, record["stage"], record["current"], record["target"], record["reason"]) for phase, record in timeline.decisions]
    assert max(timeline.counts("prompt-heavy", "prefill")) == 2, summary
    assert max(timeline.counts("decode-heavy", "decode")) == 2, summary
    reasons = {(phase, record["stage"], record["reason"].removesuffix(", bounded")) for phase, record in timeline.decisions}
    assert {("prompt-heavy", "prefill", "prompt_backlog"), ("prompt-heavy", "prefill", "ttft")} & reasons, summary
    assert {("decode-heavy", "decode", reason) for reason in ("kv_usage", "waiting", "tpot")} & reasons, summary
    assert [problem for _, record in timeline.decisions if (problem := _unjustified(record))] == []
    for results, max_tokens in ((prompt_heavy, 1), (decode_heavy, decode_tokens)):
        prompts = [prompt for prompt, _ in results]
        for (prompt, (status, tokens, errors)), want in zip(results, tiny_offline(prompts, max_tokens)):
            assert (status, errors) == (200, [])
            assert tokens == want
    assert len(prompt_heavy) >= 50 and len(decode_heavy) >= 8
    assert settled(cluster, url)["ok"]
