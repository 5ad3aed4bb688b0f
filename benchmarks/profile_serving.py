"""The serving path's CPU, for ``duet profile --serving``: what everything on the machine but the
engines takes of its cores while a config serves (the router, Serve's proxy and controller,
Ray's own processes, and in each engine replica's process the threads beside its engine's:
messages, streaming, the KV transfer), as ``base + per request + per prompt token + per
streamed token``.

The config is brought up on a local cluster (``duet up``'s), and every process's CPU time, and
in each engine replica's process every thread's, is read before and after each window: idle
(the least of ``IDLE_WINDOWS``: a burst of background work only adds), then ``REQUESTS``
requests at once of ``SHORT_PROMPT`` tokens for one token each, of ``LONG_PROMPT`` for one, and
of ``SHORT_PROMPT`` for ``LONG_OUTPUT``. A replica's engine is its
``num_threads`` busiest threads (its engine thread and the intra-op threads it computes with);
the rest of its threads, and every other process but this one (the benchmark client), are the
serving path. The idle window gives the base; least squares share the rest among requests,
prompt tokens and streamed tokens. Then ``LATENCY_REQUESTS`` requests of ``SHORT_PROMPT``
tokens and as many of ``LONG_PROMPT``, one at a time on the idle cluster: the difference of
their median times to the first token, over that of the engine's steps for such prompts (the
profile's fit), is how much slower a served engine computes than the profile's engine alone
(``engine_factor``, 1 at least: on the 2-core EPYC Zen 4 the same offline prompt took 0.69-0.85 s
with the cluster down and 0.84-0.89 s with it up and idle); the short prompts' median less
their step at that speed is the path's own latency a request (the router's calls to the pools,
the token's way back). ``duet simulate`` stretches every engine step by the factor and adds the
latency before a request reaches the router's admission.

``duet simulate`` takes those cores from the engines' (``sim_model.cpu_stretch``): on two cores
of a Xeon the serving path took 0.2-0.36 cores idle and more under load, first, as the
scheduler gives threads that run in short bursts their turn before long-running ones.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import statistics
import time

IDLE_S = 4.0
IDLE_WINDOWS = 3
REQUESTS = 24
SHORT_PROMPT, LONG_PROMPT = 32, 256
LONG_OUTPUT = 64
LATENCY_REQUESTS = 8
_REPLICA = re.compile(r"ServeReplica:[^:\s]+:(\w+)")


def reading() -> dict[int, tuple[str, float, dict[int, float]]]:
    """Every process's title, CPU seconds and, for Serve replicas, each thread's CPU seconds."""
    import psutil

    found = {}
    for process in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        try:
            title = " ".join(process.info["cmdline"] or []) or process.name()
            times = process.info["cpu_times"]
            if times is None:  # not ours to read
                continue
            threads = {thread.id: thread.user_time + thread.system_time for thread in process.threads()} if "ServeReplica" in title else {}
            found[process.info["pid"]] = (title, times.user + times.system, threads)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def serving_seconds(before: dict, after: dict, engine_threads: dict[str, int], exclude: set[int]) -> float:
    """CPU seconds spent between two ``reading``s outside the engines: in every process but
    ``exclude``, less, in an engine replica's (``ServeReplica:<app>:<pool>``, ``engine_threads``
    its pool's threads), its pool's number of busiest threads."""
    spent = 0.0
    for pid, (title, total, threads) in after.items():
        if pid in exclude:
            continue
        _, total_before, threads_before = before.get(pid, (title, 0.0, {}))
        used = total - total_before
        match = _REPLICA.search(title)
        if match and match.group(1) in engine_threads:
            deltas = sorted((cpu - threads_before.get(tid, 0.0) for tid, cpu in threads.items()), reverse=True)
            used -= sum(deltas[: engine_threads[match.group(1)]])
        spent += max(0.0, used)
    return spent


def fit(idle: tuple[float, float], loads: list[tuple[float, float, int, int, int]]) -> dict[str, float]:
    """The figures from the windows: ``idle`` (seconds, CPU seconds) gives ``base_cores``; each
    of ``loads`` (seconds, CPU seconds, requests, prompt tokens, streamed tokens) what it spent
    beyond the base, which least squares share into ``per_request_s``, ``per_prompt_token_s`` and
    ``per_token_s``, each kept at zero or above."""
    from duet.benchmarks.profile import nonnegative_least_squares

    base = max(0.0, idle[1] / idle[0])
    rows = [[float(requests), float(prompt), float(tokens)] for _, _, requests, prompt, tokens in loads]
    extra = [spent - base * seconds for seconds, spent, *_ in loads]
    per_request, per_prompt_token, per_token = nonnegative_least_squares(rows, extra)
    return {"base_cores": base, "per_request_s": per_request, "per_prompt_token_s": per_prompt_token, "per_token_s": per_token}


def measure(config_path: str, engine_threads: dict[str, int], model: str, prompt_steps: dict[int, float], log=print) -> dict:
    """``config_path`` brought up and measured; the samples and the fit. ``prompt_steps``: the
    engine's step for a ``SHORT_PROMPT``- and a ``LONG_PROMPT``-token prompt alone, by its tokens
    (the first pool a prompt meets)."""
    from duet.benchmarks.serve import WARM_UP_OUTPUT, WARM_UP_PROMPT, run_load
    from duet.benchmarks.workloads import SAFE_TOKEN_RANGE, TurnSpec
    from duet.cluster.deploy import down, up

    log(f"serving path: bringing up {config_path} ...")
    url = up(config_path).urls[0]
    me = {os.getpid()}
    rng = random.Random(0)

    def sessions(prompt: int, output: int) -> list[list[TurnSpec]]:
        # random prompts, as duet bench serve's: where a config drafts, its chunks carry as many
        # tokens as they do on that workload
        return [[TurnSpec([rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(prompt)], output)] for _ in range(REQUESTS)]

    def window(label: str, load: list[list[TurnSpec]] | None) -> tuple:
        before, started = reading(), time.perf_counter()
        if load is None:
            time.sleep(IDLE_S)
        else:
            results, _ = asyncio.run(run_load(url, model, load, 0.0, 0.0, 0, None, f"serving path: {label}"))
        seconds = time.perf_counter() - started
        spent = serving_seconds(before, reading(), engine_threads, me)
        if load is None:
            log(f"serving path: {label}: {spent:.2f} CPU s in {seconds:.1f} s")
            return seconds, spent
        # run_load's own warm-up request (WARM_UP_PROMPT tokens, WARM_UP_OUTPUT out) is in the window too
        requests = len(results) + 1
        prompt = sum(len(turn.prompt) for session in load for turn in session) + WARM_UP_PROMPT
        tokens = sum(result.output_tokens for result in results) + WARM_UP_OUTPUT
        log(f"serving path: {label}: {spent:.2f} CPU s in {seconds:.1f} s, {requests} requests, {prompt} prompt tokens, {tokens} streamed")
        return seconds, spent, requests, prompt, tokens

    try:
        window("warm-up", sessions(SHORT_PROMPT, 1))
        idle = min((window("idle", None) for _ in range(IDLE_WINDOWS)), key=lambda sample: sample[1] / sample[0])
        loads = [
            window(f"{SHORT_PROMPT}-token prompts, 1 token each", sessions(SHORT_PROMPT, 1)),
            window(f"{LONG_PROMPT}-token prompts, 1 token each", sessions(LONG_PROMPT, 1)),
            window(f"{SHORT_PROMPT}-token prompts, {LONG_OUTPUT} tokens each", sessions(SHORT_PROMPT, LONG_OUTPUT)),
        ]
        ttfts = {}
        for prompt in (SHORT_PROMPT, LONG_PROMPT):
            one_at_a_time = [[session[0] for session in sessions(prompt, 1)[:LATENCY_REQUESTS]]]  # a session's turns
            alone, _ = asyncio.run(run_load(url, model, one_at_a_time, 0.0, 0.0, 0, None, f"serving path: {prompt}-token prompts alone"))
            ttfts[prompt] = [result.ttft for result in alone if result.ok]
            if not ttfts[prompt]:
                raise RuntimeError(f"no request served alone on {config_path}: {alone[0].error}")
    finally:
        down()
    medians = {prompt: statistics.median(times) for prompt, times in ttfts.items()}
    figures = fit(idle, loads) | served_engine(medians, prompt_steps)
    log(f"serving path: alone, the first token in {medians[SHORT_PROMPT] * 1e3:.0f} / {medians[LONG_PROMPT] * 1e3:.0f} ms "
        f"(median, {SHORT_PROMPT} / {LONG_PROMPT} tokens), the profile's steps {prompt_steps[SHORT_PROMPT] * 1e3:.0f} / "
        f"{prompt_steps[LONG_PROMPT] * 1e3:.0f} ms: served engines x{figures['engine_factor']:.2f}, {figures['latency_s'] * 1e3:.0f} ms of latency")
    samples = {"idle": idle, "loads": loads, "ttfts": ttfts[SHORT_PROMPT], "ttfts_long": ttfts[LONG_PROMPT], "prompt_step_s": prompt_steps[SHORT_PROMPT],
               "long_prompt_step_s": prompt_steps[LONG_PROMPT]}
    return {"config": config_path, "samples": samples, "fit": figures}


def served_engine(medians: dict[int, float], prompt_steps: dict[int, float]) -> dict[str, float]:
    """``engine_factor`` and ``latency_s`` from the median times to a lone request's first token
    and the profile's steps, both by prompt tokens (``SHORT_PROMPT``, ``LONG_PROMPT``): the
    factor the times' difference over the steps' (1 at least), the latency what the short
    prompt's time leaves of its step at that speed (0 at least)."""
    steps = prompt_steps[LONG_PROMPT] - prompt_steps[SHORT_PROMPT]
    factor = max(1.0, (medians[LONG_PROMPT] - medians[SHORT_PROMPT]) / steps) if steps > 0 else 1.0
    return {"engine_factor": factor, "latency_s": max(0.0, medians[SHORT_PROMPT] - factor * prompt_steps[SHORT_PROMPT])}
