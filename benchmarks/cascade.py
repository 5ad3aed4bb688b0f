"""Cascade attention's decode speed: a batch of sequences sharing a cached prefix, each
``cascade_attention`` setting side by side in one run.

    duet bench cascade [--batch 32] [--prefix-tokens 0,512,2048] [--modes off,auto]
                       [--new-tokens 48] [--rounds 2] [--dtype float32] [--json out.json]

For each prefix length: ``--batch`` prompts of random SmolLM2 tokens, that prefix and 24 tokens
of their own; the first prompt runs alone (its prefix cached), then the whole batch runs together
for ``--new-tokens`` greedy tokens. Prefix 0 shares nothing: each prompt is 512 tokens of its
own, to price the check for groups on steps that have none. One engine a setting, each round
taking the settings in turn on fresh prompts. Reports decode tokens/s (the batch over the
median step), each setting against the first, and how many groups the steps cascaded.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

OWN_TOKENS = 24
UNSHARED_CONTEXT = 512  # the tokens of each prompt where nothing is shared (prefix 0)


@dataclass
class Run:
    prefix_tokens: int
    mode: str
    round: int
    median_step_ms: float
    decode_tok_s: float
    groups: int


def _prompts(rng: random.Random, batch: int, prefix_tokens: int) -> list[list[int]]:
    from duet.benchmarks.workloads import SAFE_TOKEN_RANGE

    def tokens(count: int) -> list[int]:
        return [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(count)]

    if prefix_tokens == 0:
        return [tokens(UNSHARED_CONTEXT + OWN_TOKENS) for _ in range(batch)]
    prefix = tokens(prefix_tokens)
    return [prefix + tokens(OWN_TOKENS) for _ in range(batch)]


def measure(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """The batch's median step (seconds) over its decode, after the first prompt alone; and the
    groups its steps cascaded."""
    from duet import SamplingParams
    from duet.messages import EngineRequest

    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))
    planner = engine.executor.worker.runner.cascade
    groups_before = 0 if planner is None else planner.num_groups
    for index, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"cascade-{time.monotonic_ns()}-{index}", prompt, greedy))
    steps = []
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - began)
    groups = 0 if planner is None else planner.num_groups - groups_before
    return statistics.median(steps), groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duet bench cascade", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefix-tokens", default="0,512,2048")
    parser.add_argument("--modes", default="off,auto", help="cascade_attention settings, the first the baseline")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", help="also write every run here")
    args = parser.parse_args(argv)

    from duet import LLM

    modes = args.modes.split(",")
    prefixes = [int(tokens) for tokens in args.prefix_tokens.split(",")]
    engines = {
        mode: LLM(model="smollm2", dtype=args.dtype, cascade_attention=mode, max_num_seqs=args.batch, kv_cache_memory_gib=2.0)
        for mode in modes
    }
    rng = random.Random(0)
    runs = []
    for prefix_tokens in prefixes:
        for round_index in range(args.rounds):
            for mode in modes:
                step_s, groups = measure(engines[mode], _prompts(rng, args.batch, prefix_tokens), args.new_tokens)
                runs.append(Run(prefix_tokens, mode, round_index, step_s * 1e3, args.batch / step_s, groups))
                print(f"prefix {prefix_tokens:5d}  {mode:4s}  round {round_index}: step {step_s * 1e3:7.1f} ms, "
                      f"{args.batch / step_s:6.1f} tok/s, {groups} groups", flush=True)
    print(report(runs, modes, prefixes, args.batch, args.dtype))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(run) for run in runs], out, indent=2)
    return 0


def report(runs: list[Run], modes: list[str], prefixes: list[int], batch: int, dtype: str) -> str:
    """A row a prefix length: each setting's best decode tokens/s, and its ratio to the first's."""
    lines = [f"SmolLM2 {dtype}, batch {batch}: decode tok/s (best round)",
             "| prefix tokens | " + " | ".join(modes) + " | " + " | ".join(f"{mode} / {modes[0]}" for mode in modes[1:]) + " |",
             "|---" * (1 + 2 * len(modes) - 1) + "|"]
    for prefix_tokens in prefixes:
        best = {mode: max(run.decode_tok_s for run in runs if run.prefix_tokens == prefix_tokens and run.mode == mode) for mode in modes}
        ratios = [f"{best[mode] / best[modes[0]]:.2f}x" for mode in modes[1:]]
        lines.append(f"| {prefix_tokens or 'none shared'} | " + " | ".join(f"{best[mode]:.1f}" for mode in modes) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)
