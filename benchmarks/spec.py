"""Speculative decoding: decode speed with and without each method, side by side in one run.

    duet bench spec [--max-tokens 128] [--rounds 2] [--methods none,ngram,...] [--json out.json] [--plot out.png]

On SmolLM2-135M-Instruct, for two workloads: input-grounded (rewrite, proofread or continue
a given text: the output copies long spans of the prompt) and open chat (questions and
stories: little to copy). Each workload runs single-stream (one request at a time) and as a
batch of 8, greedy. Every method's engine is loaded up front and the methods take turns on
each case, in a rotated order each round, so that the machine's swings hit them alike. Figures are decode tokens per second (after the first token),
acceptance rate and mean accepted length, and every method's speed as a ratio to no
speculation in the same run. ``draft_model`` uses SmolLM2's first layers saved as a
checkpoint of their own (SmolLM2-135M is the smallest model with its tokenizer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from duet.benchmarks.plots import saved_figure

TEXTS = [
    "The lighthouse stood at the edge of the cliff for two hundred years. Every night its keeper climbed the "
    "narrow stairs, trimmed the wick and polished the great lens until it shone. Ships passing in the dark "
    "knew the rhythm of its beam, three long flashes and one short, and steered wide of the rocks below.",
    "To make bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes until it "
    "is smooth and elastic. Leave it covered in a warm place for an hour, until it has doubled in size. Shape "
    "it into a loaf, let it rise again for thirty minutes, then bake it at two hundred degrees for forty minutes.",
    "Honey bees live in colonies of tens of thousands. The queen lays the eggs, the workers gather nectar and "
    "pollen, build the comb and care for the young, and the drones mate with queens from other colonies. In "
    "winter the bees cluster together and shiver their wing muscles to keep the hive warm.",
    "The first computers filled entire rooms and used thousands of vacuum tubes. They were programmed by "
    "setting switches and plugging cables, and a single calculation could take hours. The invention of the "
    "transistor made computers smaller, faster and far more reliable, and soon they appeared in offices.",
]
GROUNDED_TASKS = [
    "Rewrite the following text in the past tense, keeping every detail:\n\n{text}",
    "Proofread the following text and return it with any mistakes corrected:\n\n{text}",
    "Repeat the following text, then add one sentence that continues it:\n\n{text}",
    "Copy the following text exactly, and give it a title on the first line:\n\n{text}",
]
OPEN_CHAT = [
    "Write a short story about a robot who learns to paint.",
    "What are three good reasons to learn a second language?",
    "Explain how a rainbow forms, in simple words.",
    "Give me some ideas for a birthday party for a ten-year-old.",
    "Why do cats purr?",
    "Describe a perfect autumn day.",
    "What should I pack for a weekend hiking trip?",
    "Write a poem about the sea.",
]
DRAFT_LAYERS = 6


@dataclass
class Result:
    method: str
    workload: str
    batch: int
    decode_tokens_per_s: float
    max_tokens: int
    acceptance_rate: float | None
    mean_accepted_length: float | None
    speedup: float = 1.0


def prompts(llm, workload: str, count: int) -> list[list[int]]:
    if workload == "input-grounded":
        contents = [GROUNDED_TASKS[i % len(GROUNDED_TASKS)].format(text=TEXTS[i % len(TEXTS)]) for i in range(count)]
    else:
        contents = [OPEN_CHAT[i % len(OPEN_CHAT)] for i in range(count)]
    return [llm.apply_chat_template([{"role": "user", "content": content}]) for content in contents]


def draft_checkpoint(smollm2_dir: Path) -> Path:
    """SmolLM2's first DRAFT_LAYERS layers as a checkpoint of their own (made once, cached)."""
    from duet.models.loader import save_first_layers

    target = smollm2_dir.parent / f"{smollm2_dir.name}-first-{DRAFT_LAYERS}-layers"
    if (target / "config.json").exists():
        return target
    return save_first_layers(smollm2_dir, target, DRAFT_LAYERS)


def method_configs(k: int, smollm2_dir: Path) -> dict[str, dict | None]:
    """Each method with the adaptive draft-length rule (the default), and two without it ("fixed")."""
    return {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k},
        "ngram-fixed": {"method": "ngram", "num_speculative_tokens": k, "adaptive": False},
        "layer_skip": {"method": "layer_skip", "num_speculative_tokens": k, "num_draft_layers": 20},
        "layer_skip-fixed": {"method": "layer_skip", "num_speculative_tokens": k, "num_draft_layers": 20, "adaptive": False},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": k, "model": str(draft_checkpoint(smollm2_dir))},
    }


def _decode_rate(outputs) -> float:
    """Tokens after each request's first, over the time from the first first-token to the last finish."""
    start = min(output.metrics["first_token_time"] for output in outputs)
    end = max(output.metrics["finished_time"] for output in outputs)
    return sum(len(output.outputs[0].token_ids) - 1 for output in outputs) / (end - start)


def measure(llm, case_prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, tuple[int, ...]]:
    """Decode tokens/s of one case, and the (drafts, draft tokens, accepted tokens) it added."""
    from duet import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    stats = llm.engine.scheduler.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    if batch == 1:
        # The mean time per token, as one stream sees it.
        rates = [_decode_rate(llm.generate([prompt], params)) for prompt in case_prompts]
        rate = len(rates) / sum(1 / r for r in rates)
    else:
        rate = _decode_rate(llm.generate(case_prompts[:batch], params))
    after = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    return rate, tuple(a - b for a, b in zip(after, before))


def run_cases(engines: dict, workloads: dict[str, list[list[int]]], args, progress) -> list[Result]:
    """Every case for every method; the median round counts."""
    results = []
    names = list(engines)
    for workload, workload_prompts in workloads.items():
        for batch in (1, 8):
            case_prompts = workload_prompts[: args.single_stream_prompts] if batch == 1 else workload_prompts
            rates: dict[str, list[float]] = {name: [] for name in names}
            counts = {name: (0, 0, 0) for name in names}
            for round_index in range(args.rounds):
                shift = round_index % len(names)
                for name in names[shift:] + names[:shift]:
                    rate, added = measure(engines[name], case_prompts, batch, args.max_tokens)
                    rates[name].append(rate)
                    counts[name] = tuple(a + b for a, b in zip(counts[name], added))
                    progress.update(1)
            for name in names:
                drafts, draft_tokens, accepted = counts[name]
                results.append(
                    Result(
                        name, workload, batch, statistics.median(rates[name]), args.max_tokens,
                        accepted / draft_tokens if draft_tokens else None,
                        1 + accepted / drafts if drafts else None,
                    )
                )
    return results


def print_table(results: list[Result]) -> None:
    print(f"\n{'method':<18} {'workload':<15} {'batch':>5} {'decode tok/s':>13} {'vs none':>8} {'accept':>7} {'mean len':>9}")
    for r in results:
        accept = f"{r.acceptance_rate:.2f}" if r.acceptance_rate is not None else "-"
        length = f"{r.mean_accepted_length:.2f}" if r.mean_accepted_length is not None else "-"
        print(f"{r.method:<18} {r.workload:<15} {r.batch:>5} {r.decode_tokens_per_s:>13.1f} {r.speedup:>7.2f}x {accept:>7} {length:>9}")


def plot(results: list[Result], path: str) -> None:
    cases = list(dict.fromkeys((r.workload, r.batch) for r in results))
    methods = list(dict.fromkeys(r.method for r in results))
    with saved_figure(path, figsize=(10, 4)) as (fig, ax):
        width = 0.8 / len(methods)
        for index, method in enumerate(methods):
            speedups = [next(r.speedup for r in results if r.method == method and (r.workload, r.batch) == case) for case in cases]
            ax.bar([c + index * width for c in range(len(cases))], speedups, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([c + width * (len(methods) - 1) / 2 for c in range(len(cases))])
        ax.set_xticklabels([f"{workload}\nbatch {batch}" for workload, batch in cases])
        ax.set_ylabel("decode speed vs no speculation")
        ax.set_title("Speculative decoding on SmolLM2-135M (greedy, CPU)")
        ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench spec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="turns each method takes on each case")
    parser.add_argument("--single-stream-prompts", type=int, default=2, help="prompts run one at a time per case")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--methods", default="none,ngram,ngram-fixed,layer_skip,draft_model")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)

    from duet import LLM, SamplingParams
    from duet.models.gguf_convert import ensure_smollm2

    smollm2_dir = ensure_smollm2()
    configs = method_configs(args.num_speculative_tokens, smollm2_dir)
    names = args.methods.split(",")
    if "none" not in names or any(name not in configs for name in names):
        parser.error(f"--methods must include none and name only {', '.join(configs)}")
    started = time.time()
    engines = {}
    for name in tqdm(names, desc="loading engines", unit="engine"):
        engines[name] = LLM(model="smollm2", max_model_len=2048, kv_cache_memory_gib=0.25, speculative_config=configs[name])
        engines[name].generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    workloads = {name: prompts(engines["none"], name, 8) for name in ("input-grounded", "open chat")}
    with tqdm(total=len(names) * 4 * args.rounds, desc="bench spec", unit="run") as progress:
        results = run_cases(engines, workloads, args, progress)
    baseline = {(r.workload, r.batch): r.decode_tokens_per_s for r in results if r.method == "none"}
    for r in results:
        r.speedup = r.decode_tokens_per_s / baseline[(r.workload, r.batch)]
    print_table(results)
    print(f"\n{time.time() - started:.0f} s; k={args.num_speculative_tokens}, {args.max_tokens} tokens per request, greedy, median of {args.rounds} rounds")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
