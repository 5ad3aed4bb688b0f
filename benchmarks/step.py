"""Where a decode step's milliseconds go: SmolLM2's engine step, op by op, at each batch size.

    duet bench step [--batches 1,32] [--steps 64] [--dtype float32] [--quantization auto]
                    [--layers native,python] [--json out.json]

For each batch size, the engine decodes that many greedy sequences (the offline benchmark's
prompts) and times, over ``--steps`` steps past the prompts, the engine's step and what it
spends inside: the products (``Linear``: GGUF block kernels, oneDNN or MKL, whichever its rows
take; the LM head's fused greedy argmax apart), attention over the paged cache, the KV write
with RoPE, the norms, the activation, sampling (steps that need logits) and the runner's input
preparation. What the step spends outside all of these is the
per-step overhead: Python, module calls, views, the scheduler, the runner's bookkeeping.

Each timed function gets a ``perf_counter`` pair around it (about a microsecond a call, a few
hundred calls a step: counted in the kernels' own times, not in the overhead). Where the layers
run in one C++ call (``duet.models.decoder_stack``, the default), that call times its own
parts the same way, in C++; ``--layers python,native`` profiles the Python layer loop and the
C++ stack side by side, in one run.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

PROMPT_BATCH = 32


@dataclass
class StepProfile:
    batch: int
    layers: str  # "native": the C++ decoder stack, where the model has one; "python": the layer loop
    step_ms: float
    parts_ms: dict[str, float]  # per step, by part
    overhead_ms: float  # step less every kernel-level part


def _timed_parts():
    """(label, owner, attribute) of what a step is split into, and the step itself."""
    from duet import engine, model_runner
    from duet.models import linear, llama

    return [
        ("products", linear.Linear, "forward"),
        ("LM head argmax", linear.Linear, "argmax"),
        ("attention", llama, "paged_attention"),
        ("RoPE + KV write", llama, "rope_and_write_kv"),
        ("norms", llama, "add_rms_norm"),
        ("norms", llama, "rms_norm"),
        ("activation", llama, "silu_and_mul"),
        ("sampler", model_runner.ModelRunner, "_sample"),
        ("prepare inputs", model_runner.ModelRunner, "_prepare_inputs"),
        ("step", engine.LLMEngine, "step"),
    ]


KERNEL_PARTS = (
    "products", "LM head argmax", "attention", "RoPE + KV write", "norms", "activation", "LoRA updates", "sampler", "prepare inputs",
)


@contextmanager
def timing(totals: dict[str, float]):
    """Wrap every part of ``_timed_parts`` so that its seconds add up in ``totals``. A kernel-level
    part inside another (the products of the LM head's unfused argmax) counts in the outer one
    alone, so that the parts never overlap; ``step`` contains them."""
    originals, depth = [], collections.Counter()

    def wrap(label, function):
        key = "kernel" if label in KERNEL_PARTS else label

        def timed(*args, **kwargs):
            depth[key] += 1
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                depth[key] -= 1
                if depth[key] == 0:
                    totals[label] += time.perf_counter() - started
        return timed

    for label, owner, attribute in _timed_parts():
        original = getattr(owner, attribute)
        originals.append((owner, attribute, original))
        setattr(owner, attribute, wrap(label, original))
    try:
        yield
    finally:
        for owner, attribute, original in reversed(originals):
            setattr(owner, attribute, original)


def profile(llm, prompts: list[list[int]], batch: int, steps: int, layers: str = "native") -> StepProfile:
    from duet import SamplingParams
    from duet.messages import EngineRequest

    engine = llm.engine
    model = engine.executor.worker.runner.model  # the in-process worker
    kept = model.use_decoder_stack
    model.use_decoder_stack = layers == "native"
    stack = model.decoder_stack()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, min_tokens=steps + 8)
    for index in range(batch):
        engine.add_request(EngineRequest(f"profile-{batch}-{index}", prompts[index % len(prompts)], params))
    for _ in range(4):  # the prompts, and a few steps to settle
        engine.step()
    totals = collections.defaultdict(float)
    if stack is not None:
        stack.take_times()
        stack.profile(True)
    try:
        with timing(totals):
            for _ in range(steps):
                engine.step()
    finally:
        if stack is not None:
            stack.profile(False)
            for label, seconds in stack.take_times().items():
                totals[label] += seconds
        model.use_decoder_stack = kept
    while engine.has_unfinished_requests():
        engine.step()
    parts = {label: seconds / steps * 1e3 for label, seconds in totals.items() if seconds}
    step_ms = parts.pop("step")
    overhead = step_ms - sum(parts.get(label, 0.0) for label in KERNEL_PARTS)
    return StepProfile(batch=batch, layers=layers if stack is not None else "python", step_ms=step_ms, parts_ms=parts, overhead_ms=overhead)


def report(profiles: list[StepProfile]) -> str:
    labels = [label for label in KERNEL_PARTS if any(label in p.parts_ms for p in profiles)]
    lines = [f"{'part (ms a step)':<20}" + "".join(f"{f'batch {p.batch}':>16}" for p in profiles)]
    lines.append(f"{'layers':<20}" + "".join(f"{p.layers:>16}" for p in profiles))
    for label in labels:
        lines.append(f"{label:<20}" + "".join(f"{p.parts_ms.get(label, 0.0):>16.2f}" for p in profiles))
    lines.append(f"{'outside kernels':<20}" + "".join(f"{p.overhead_ms:>16.2f}" for p in profiles))
    lines.append(f"{'step':<20}" + "".join(f"{p.step_ms:>16.2f}" for p in profiles))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duet bench step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--model", default="smollm2", help="an alias or a checkpoint directory (one that ships quantized, say)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="auto", help="auto (the engine's default), dequantized, int8, int4, w8a8")
    parser.add_argument("--layers", default="native", help="native (the C++ decoder stack), python (the layer loop), or both: python,native")
    parser.add_argument("--json", help="also write the profiles here")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from duet import LLM
    from duet.benchmarks.offline import batch_prompts
    from duet.models.loader import resolve_model_path

    batches = [int(batch) for batch in args.batches.split(",")]
    quantization = None if args.quantization == "auto" else args.quantization
    llm = LLM(model=args.model, dtype=args.dtype, quantization=quantization, max_num_seqs=max(batches), kv_cache_memory_gib=1.0)
    prompts = batch_prompts(AutoTokenizer.from_pretrained(str(resolve_model_path(args.model))))
    profiles = [profile(llm, prompts, batch, args.steps, layers) for batch in batches for layers in args.layers.split(",")]
    print(f"{args.model} decode step, {args.dtype}, quantization {args.quantization}, mean of {args.steps} steps")
    print(report(profiles))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(p) for p in profiles], out, indent=2)
    return 0
