"""``duet bench soak``: mixed load on a cluster for a given time, then the ledger.

Requests arrive as a Poisson process at ``--rate``: short and long prompts, streamed or not,
``n`` of 1 to 3, some with stop strings, greedy or seeded sampling (the cluster's decode pool
speculates if its config says so), and a share cancelled by their client part-way (a stream
closed after a few events, a plain request given up after a while). With ``--kill-every-s`` a
random replica of either pool is killed that often (Serve starts another).

When the time is up and every request has ended, it checks the ledger and prints it:

- every request ended exactly once, as completed, cancelled by its client, rejected with 429
  or 503 and ``Retry-After``, or failed with a reason (an OpenAI error body or event);
- a completed request has ``n`` choices, each finished exactly once with the tokens it should
  have (``length``: ``max_tokens``; ``stop``: no more), and streams end with one ``[DONE]``;
- greedy requests of the same prompt got the same tokens, whatever their batch or replica;
- the router counted as many finished choices (by reason) and rejections as the clients saw;
- every replica's ``check_integrity()`` passes and KV usage is back to 0 (no leaked block).

A PNG shows latency over time, in-flight requests and KV usage, with the kills marked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from duet.benchmarks.soak_ledger import Ledger, Outcome, check_choices

IDLE_CONFIRM_S = 2.0  # four pulls of the replicas' stats (every 0.5 s) with no block held

STOP_STRINGS = ("e", ".", " the", "\n")


@dataclass
class Job:
    """What one request asks."""

    index: int
    prompt: list[int]
    n: int
    max_tokens: int
    stream: bool
    greedy: bool
    stop: list[str]
    cancel_after: int | None  # token events (streams) or tenths of a second (plain requests) before giving up
    seed: int | None = None

    def body(self, model: str) -> dict:
        body = {
            "model": model, "prompt": self.prompt, "n": self.n, "max_tokens": self.max_tokens, "return_token_ids": True,
            "stream": self.stream, "temperature": 0.0 if self.greedy else 0.8,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.stop:
            body["stop"] = self.stop
        if self.seed is not None:
            body["seed"] = self.seed
        return body


def make_job(rng: random.Random, index: int, greedy_prompts: list[list[int]], args) -> Job:
    greedy = rng.random() < 0.4
    if greedy:  # a few prompts, asked again and again: their tokens must never differ
        prompt = rng.choice(greedy_prompts)
    else:
        length = rng.randint(*args.short_prompt) if rng.random() < 0.7 else rng.randint(*args.long_prompt)
        prompt = [rng.randrange(*args.token_range) for _ in range(length)]
    stream = rng.random() < 0.5
    cancel = rng.random() < args.cancel_share
    return Job(
        index=index, prompt=prompt, n=rng.choice((1, 1, 1, 2, 3)), max_tokens=rng.randint(*args.output_len), stream=stream,
        greedy=greedy, stop=[rng.choice(STOP_STRINGS)] if not greedy and rng.random() < 0.3 else [],
        cancel_after=rng.randint(1, 8) if cancel else None, seed=None if greedy else rng.randrange(2**31),
    )


async def send(client, url: str, model: str, job: Job) -> Outcome:
    started = time.perf_counter()
    outcome = Outcome(job.index, sent_at=started)
    try:
        if job.stream:
            await _stream(client, url, model, job, outcome)
        elif job.cancel_after is not None:
            try:
                await asyncio.wait_for(_plain(client, url, model, job, outcome), job.cancel_after / 10)
            except TimeoutError:
                outcome.status = "cancelled"
        else:
            await _plain(client, url, model, job, outcome)
    except Exception as error:  # noqa: BLE001 - a broken connection is a failure with a reason, not a crash
        outcome.status, outcome.reason = "failed", f"client: {type(error).__name__}: {error}"
    outcome.latency_s = time.perf_counter() - started
    return outcome


def _refused(response, outcome: Outcome, payload: dict) -> None:
    """A non-200 answer: rejected (429/503 with Retry-After) or failed, with its error body checked."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or not error.get("message") or "type" not in error:
        outcome.problems.append(f"status {response.status_code} without an OpenAI error body: {str(payload)[:200]}")
    outcome.http_status = response.status_code
    outcome.reason = (error or {}).get("message", "")
    if response.status_code in (429, 503):
        outcome.status = "rejected"
        if "retry-after" not in response.headers:
            outcome.problems.append(f"{response.status_code} without Retry-After")
    else:
        outcome.status = "failed"


async def _plain(client, url: str, model: str, job: Job, outcome: Outcome) -> None:
    response = await client.post(f"{url}/v1/completions", json=job.body(model))
    payload = response.json()
    if response.status_code != 200:
        _refused(response, outcome, payload)
        return
    choices = payload["choices"]
    if sorted(choice["index"] for choice in choices) != list(range(job.n)):
        outcome.problems.append(f"choices {[choice['index'] for choice in choices]} for n={job.n}")
    outcome.tokens = {choice["index"]: choice["token_ids"] for choice in choices}
    outcome.finish = {choice["index"]: [choice["finish_reason"]] for choice in choices}
    outcome.usage = payload["usage"]["completion_tokens"]
    outcome.ttft_s = time.perf_counter() - outcome.sent_at
    outcome.status = "completed"
    check_choices(outcome, job.n, job.max_tokens)


async def _stream(client, url: str, model: str, job: Job, outcome: Outcome) -> None:
    async with client.stream("POST", f"{url}/v1/completions", json=job.body(model)) as response:
        if response.status_code != 200:
            _refused(response, outcome, json.loads(await response.aread()))
            return
        events, done = 0, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            if done:
                outcome.problems.append("an event after [DONE]")
            event = json.loads(line[6:])
            if "error" in event:
                outcome.status, outcome.reason = "failed", event["error"].get("message", "")
                continue
            if event.get("usage"):
                outcome.usage = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                index = choice["index"]
                if outcome.finish.get(index):
                    outcome.problems.append(f"choice {index} has output after it finished")
                outcome.tokens.setdefault(index, []).extend(choice.get("token_ids") or [])
                if choice.get("finish_reason"):
                    outcome.finish.setdefault(index, []).append(choice["finish_reason"])
            if outcome.ttft_s is None and any(outcome.tokens.values()):
                outcome.ttft_s = time.perf_counter() - outcome.sent_at
            events += 1
            if job.cancel_after is not None and events >= job.cancel_after:
                outcome.status = "cancelled"
                return  # leaving the block closes the connection: the router must free its KV
        if outcome.status == "failed":
            return
        if done != 1:
            outcome.problems.append(f"the stream ended with {done} [DONE]")
        outcome.status = "completed"
        check_choices(outcome, job.n, job.max_tokens)


@dataclass
class Sample:
    at: float
    in_flight: int
    kv_usage: dict[str, float] = field(default_factory=dict)  # per replica


def metric_values(text: str, name: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


async def _watch(client, url: str, origin: float, in_flight: list[int], samples: list[Sample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            text = (await client.get(f"{url}/metrics", timeout=5)).text
            samples.append(Sample(time.perf_counter() - origin, in_flight[0], metric_values(text, "vllm:kv_cache_usage_perc")))
        except Exception:  # noqa: BLE001 - a missed sample is only a gap in the plot
            pass
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


def _kill_random_replica(app: str, rng: random.Random) -> str:
    import ray

    actors = [actor for actor in ray.util.list_named_actors(all_namespaces=True)
              if actor["name"].startswith(f"SERVE_REPLICA::{app}#") and ("#decode#" in actor["name"] or "#prefill#" in actor["name"])]
    victim = rng.choice(actors)
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    return victim["name"].split("::", 1)[1]


async def run(url: str, model: str, args, progress=None) -> Ledger:
    """Drive the load for ``args.duration_s``, wait for every request, and check the ledger."""
    import httpx

    rng = random.Random(args.seed)
    greedy_prompts = [[rng.randrange(*args.token_range) for _ in range(rng.randint(*args.short_prompt))] for _ in range(4)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=args.request_timeout_s, headers=headers, limits=limits) as client:
        ledger = Ledger(await _counters(client, url))
        origin = time.perf_counter()
        in_flight, samples, stop = [0], [], asyncio.Event()
        watcher = asyncio.create_task(_watch(client, url, origin, in_flight, samples, stop))
        tasks, next_kill = [], args.kill_every_s or float("inf")

        async def one(job: Job) -> None:
            in_flight[0] += 1
            try:
                ledger.add(job, await send(client, url, model, job))
            finally:
                in_flight[0] -= 1
                if progress is not None:
                    progress.update(1)

        index = 0
        while (now := time.perf_counter() - origin) < args.duration_s:
            if now >= next_kill:
                ledger.kills.append((now, _kill_random_replica(args.app, rng)))
                next_kill += args.kill_every_s
            tasks.append(asyncio.create_task(one(make_job(rng, index, greedy_prompts, args))))
            index += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
        ledger.drained_s = await _until_idle(client, url, args.settle_s)
        stop.set()
        await watcher
        ledger.samples = samples
        ledger.origin = origin
        ledger.integrity = (await client.get(f"{url}/duet/integrity", timeout=60)).json()
        ledger.final_kv_usage = metric_values((await client.get(f"{url}/metrics")).text, "vllm:kv_cache_usage_perc")
        ledger.counters_after = await _counters(client, url)
    return ledger


async def _counters(client, url: str) -> dict[str, dict[str, float]]:
    text = (await client.get(f"{url}/metrics", timeout=10)).text
    return {name: metric_values(text, name) for name in ("vllm:request_success_total", "duet:requests_rejected_total")}


async def _until_idle(client, url: str, timeout_s: float) -> float:
    """Seconds until no replica holds a KV block, and none has for ``IDLE_CONFIRM_S``. One empty
    reading is not idle: a CI run read every replica empty as its last client finished, then a
    decode replica holding 6 blocks (by requests it still tracked: the integrity check passed)."""
    began = time.perf_counter()
    idle_since = None
    while (now := time.perf_counter()) - began < timeout_s:
        usage = metric_values((await client.get(f"{url}/metrics", timeout=10)).text, "vllm:kv_cache_usage_perc")
        if usage and not any(usage.values()):
            idle_since = now if idle_since is None else idle_since
            if now - idle_since >= IDLE_CONFIRM_S:
                return idle_since - began
        else:
            idle_since = None
        await asyncio.sleep(0.5)
    return time.perf_counter() - began


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet bench soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/soak.yaml", help="brought up with `duet up` and taken down after")
    parser.add_argument("--url", default=None, help="drive a running cluster instead of --config")
    parser.add_argument("--app", default="duet", help="the Serve application's name (to find replicas to kill)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--short-prompt", type=_range, default=(8, 64), help="tokens, low-high")
    parser.add_argument("--long-prompt", type=_range, default=(200, 600), help="tokens, low-high (30%% of the random prompts)")
    parser.add_argument("--output-len", type=_range, default=(4, 48), help="max_tokens, low-high")
    parser.add_argument("--token-range", type=_range, default=(1000, 40000), help="prompt token ids, low-high")
    parser.add_argument("--cancel-share", type=float, default=0.15, help="share of requests their client gives up on")
    parser.add_argument("--kill-every-s", type=float, default=0.0, help="kill a random replica this often (0: never)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--settle-s", type=float, default=60.0, help="longest wait for KV usage to reach 0 at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--plot", default="soak.png")
    parser.add_argument("--json", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from tqdm import tqdm

    url = args.url
    if url is None:
        from duet.cluster.deploy import up

        print(f"bringing up {args.config} ...", flush=True)
        url = up(args.config).urls[0]
    try:
        if args.kill_every_s:
            import ray

            if not ray.is_initialized():  # `duet up` in this process connected it already
                ray.init(address="auto", logging_level="ERROR")
        with tqdm(desc="requests ended", unit="req") as progress:
            ledger = asyncio.run(run(url, args.model, args, progress))
    finally:
        if args.url is None:
            from duet.cluster.deploy import down

            down()
    print(ledger.report())
    ledger.plot(args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(ledger.figures() | {"outcomes": [asdict(o) for o in ledger.outcomes]}, indent=1))
    return 0 if ledger.exact else 1
