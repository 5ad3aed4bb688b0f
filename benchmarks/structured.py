"""What structured outputs cost the engine per decode step, at batch 1 and 32.

    duet bench structured [--model smollm2] [--batch-sizes 1,32] [--tokens 64] [--repeats 2] [--json out.json]

Each batch of chat prompts decodes ``--tokens`` greedy tokens (``min_tokens`` holds EOS off)
three ways on one engine: unconstrained; under the regex ``(?s:.*)``, which allows every text and
so yields the same tokens (checked), making the difference in step time the masks' own cost; and
under a JSON schema (other tokens; a complete object ends its sequence, so a step is the run's
time over its longest output). Printed per setting: ms per decode step, the
change against unconstrained, and where the masks' time went per step (filled on their thread
while the forward runs, the step's wait for them after its forward, applying them and advancing
the matchers). The engine's grammar engine is llguidance; ``duet bench grammar`` compares it
with xgrammar outside the engine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
        "notes": {"type": "string"},
    },
    "required": ["title", "tags", "score", "notes"],
}
QUESTIONS = ["Describe a city as JSON.", "Summarize a novel as JSON.", "Review a restaurant as JSON.", "Plan a trip as JSON."]


@dataclass
class Figure:
    setting: str
    batch_size: int
    step_ms: float
    change: float  # against the unconstrained step at this batch size
    fill_ms: float  # per step, on the masks' thread
    wait_ms: float  # per step, the step blocked on the masks after its forward
    apply_ms: float  # per step: masks onto logits, matchers past the sampled tokens


def _prompts(tokenizer, batch_size: int) -> list[list[int]]:
    conversations = [[{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}] for index in range(batch_size)]
    encoded = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in conversations]
    return [list(e["input_ids"] if hasattr(e, "keys") else e) for e in encoded]


def measure(llm, batch_size: int, num_tokens: int, repeats: int) -> list[Figure]:
    from duet import SamplingParams, StructuredOutputs

    prompts = _prompts(llm.get_tokenizer(), batch_size)
    settings = {
        "unconstrained": None,
        "regex (?s:.*)": StructuredOutputs(regex=r"(?s:.*)"),
        "json schema": StructuredOutputs(json=SCHEMA),
    }
    masks = llm.engine.executor.worker.runner.grammar  # the in-process worker
    figures, tokens = [], {}
    for setting, constraint in settings.items():
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, min_tokens=num_tokens, structured_outputs=constraint)
        best = None
        for _ in range(repeats):
            llm.generate(prompts, params)  # prompts into the prefix cache: the timed run decodes
            before = (masks.fill_seconds, masks.wait_seconds, masks.apply_seconds)
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds = time.perf_counter() - started
            num_steps = max(len(output.outputs[0].token_ids) for output in outputs)
            after = (masks.fill_seconds, masks.wait_seconds, masks.apply_seconds)
            spent = [(end - start) * 1e3 / num_steps for end, start in zip(after, before)]
            if best is None or seconds / num_steps < best[0]:
                best = (seconds / num_steps, spent)
        tokens[setting] = [output.outputs[0].token_ids for output in outputs]
        step_ms = best[0] * 1e3
        base = figures[0].step_ms if figures else step_ms
        figures.append(Figure(setting, batch_size, step_ms, step_ms / base - 1, *best[1]))
    if tokens["regex (?s:.*)"] != tokens["unconstrained"]:
        raise AssertionError("a regex that allows every text changed greedy tokens")
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench structured", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs per figure")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    from duet import LLM

    llm = LLM(model=args.model, max_model_len=1024)
    figures = []
    print(f"{'setting':<16}{'batch':>6}{'ms/step':>10}{'change':>9}{'fill ms':>9}{'wait ms':>9}{'apply ms':>10}")
    for batch_size in (int(size) for size in args.batch_sizes.split(",")):
        for figure in measure(llm, batch_size, args.tokens, args.repeats):
            figures.append(figure)
            print(
                f"{figure.setting:<16}{figure.batch_size:>6}{figure.step_ms:>10.2f}{figure.change:>+9.1%}"
                f"{figure.fill_ms:>9.3f}{figure.wait_ms:>9.3f}{figure.apply_ms:>10.3f}"
            )
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(figure) for figure in figures], file, indent=2)
