"""Perplexity, greedy agreement and memory of each weight and KV cache setting, side by side.

    duet eval ppl [--model smollm2] [--settings fp32,kv-int8,kv-fp8,w-int8,w-int4,...] [--json out.json]

On the project's own English text (``eval_text.py``), each setting runs duet's model over the
whole text in chunks of ``CHUNK`` tokens through a paged KV cache of its ``kv_cache_dtype``, so
every chunk after the first attends to cached (quantized) keys and values, exactly as a served
prompt does; perplexity is over every token after the first. Printed per setting: perplexity
and its change against fp32; the mean KL divergence of its next-token distributions from
fp32's (the finest of these measures: it sees every change, not only those that move a token);
top-1 agreement with fp32 (the share of positions whose most likely next token is fp32's,
every setting reading the same text); greedy agreement (the parity tests' 16 chat prompts,
64 greedy tokens each through the engine, the share equal to fp32's up to each one's first
difference, the strictest count: a token chosen differently at a near-tie ends its prompt's
count, however alike the rest); resident weight bytes and KV bytes per token.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

CHUNK = 256
BLOCK_SIZE = 16
# name: (quantization, kv_cache_dtype). fp32 is the baseline every change is measured against.
SETTINGS = {
    "fp32": ("dequantized", "auto"),
    "gguf": (None, "auto"),
    "kv-int8": ("dequantized", "int8"),
    "kv-fp8": ("dequantized", "fp8_e4m3"),
    "w-int8": ("int8", "auto"),
    "w-int4": ("int4", "auto"),
    "w-int8+kv-int8": ("int8", "int8"),
    "w-int4+kv-int8": ("int4", "int8"),
    "tier-int8": ("dequantized", "auto"),  # an fp32 cache whose earlier chunks come back from an int8 tier (TIER_SETTINGS)
}
# Settings whose cached context is evicted to a second tier of this dtype and restored before each
# chunk reads it (``kv_offload.dtype``: the worst case, all of a prompt's history from the tier).
TIER_SETTINGS = {"tier-int8": "int8"}


@dataclass
class Result:
    setting: str
    quantization: str | None
    kv_cache_dtype: str
    perplexity: float
    change: float  # relative to fp32's perplexity
    kl_divergence: float  # mean over the text's positions of KL(fp32 || setting), in nats
    top1_agreement: float
    greedy_agreement: float | None  # None: not measured (a tier setting)
    weight_bytes: int
    kv_bytes_per_token: int
    seconds: float


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Every tensor the model keeps: parameters, buffers, packed and panel copies and quantized blocks."""
    from duet.models.linear import Linear

    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    for module in model.modules():
        if isinstance(module, Linear):
            extras = [module.packed_weight, module.invariant_panels]
            if module.gguf is not None:
                extras += [module.gguf.codes, module.gguf.scales]
            total += sum(t.numel() * t.element_size() for t in extras if t is not None)
    return total


@torch.inference_mode()
def text_logits(model, token_ids: list[int], kv_dtype: torch.dtype, tier: str | None = None) -> torch.Tensor:
    """``[len - 1, vocab]`` logits predicting tokens 1.., computed chunk by chunk over a paged
    cache; ``tier`` (a ``kv_offload.dtype``): after each chunk its blocks are saved to such a
    tier and restored from it, as an evicted history is."""
    from duet.kv_tier import KVTierStore
    from duet.model_inputs import Span, build_batch
    from duet.model_runner import allocate_kv_cache
    from duet.outputs import KVTierOps

    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    kv_cache, caches = allocate_kv_cache(model.arch, num_blocks, BLOCK_SIZE, kv_dtype, "cpu")
    store = None if tier is None else KVTierStore(kv_cache, num_blocks, quantized=tier == "int8")
    block_ids = list(range(num_blocks))
    logits = []
    for start in range(0, len(token_ids) - 1, CHUNK):
        chunk = token_ids[start : min(start + CHUNK, len(token_ids) - 1)]
        batch = build_batch([Span(chunk, start, block_ids)], BLOCK_SIZE, "cpu")
        rows = torch.arange(len(chunk))
        logits.append(model(batch.input_ids, batch.positions, caches, batch.metadata, rows))
        if store is not None:  # CHUNK is whole blocks: the chunk's, saved and then restored in place
            written = list(range(start // BLOCK_SIZE, -(-(start + len(chunk)) // BLOCK_SIZE)))
            store.apply(KVTierOps(saves=[(block, block) for block in written]))
            store.apply(KVTierOps(loads=[(block, block) for block in written]))
    return torch.cat(logits)


def greedy_tokens(llm, prompts: list[list[int]]) -> list[list[int]]:
    from duet import SamplingParams
    from duet.benchmarks.prompts import PARITY_NEW_TOKENS

    # As the parity tests generate: min_tokens bars EOS, as transformers' min_new_tokens does.
    params = SamplingParams(temperature=0.0, max_tokens=PARITY_NEW_TOKENS, min_tokens=PARITY_NEW_TOKENS)
    outputs = llm.generate(prompts, params)
    return [output.outputs[0].token_ids for output in outputs]


def prefix_share(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Tokens equal to the reference's, counted in each sequence up to its first difference."""
    equal = 0
    for ref, got in zip(reference, candidate):
        equal += next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return equal / sum(len(ref) for ref in reference)


def run(model: str, settings: list[str], num_prompts: int | None = None) -> list[Result]:
    """Each setting's measures; greedy agreement over the first ``num_prompts`` chat prompts (all: None)."""
    from duet import LLM
    from duet.benchmarks.eval_text import TEXT
    from duet.benchmarks.prompts import encode_conversations, parity_conversations

    token_ids = prompts = None
    ordered = ["fp32"] + [name for name in settings if name != "fp32"]
    results, reference_log_probs, reference_greedy = [], None, None
    for name in tqdm(ordered, desc="settings", unit="setting"):
        quantization, kv_cache_dtype = SETTINGS[name]
        started = time.perf_counter()
        llm = LLM(model=model, quantization=quantization, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gib=0.25)
        token_ids = token_ids or llm.get_tokenizer().encode(TEXT)
        prompts = prompts or encode_conversations(llm.get_tokenizer(), parity_conversations())[:num_prompts]
        network, kv_dtype = llm.engine.executor.worker.runner.model, llm.engine.kv_dtype
        log_probs = text_logits(network, token_ids, kv_dtype, TIER_SETTINGS.get(name)).log_softmax(-1)
        targets = torch.tensor(token_ids[1:])
        perplexity = math.exp(torch.nn.functional.nll_loss(log_probs, targets).item())
        greedy = None if name in TIER_SETTINGS else greedy_tokens(llm, prompts)  # single prompts never reach a tier
        if reference_log_probs is None:
            reference_log_probs, reference_greedy, base = log_probs, greedy, perplexity
        kl = torch.nn.functional.kl_div(log_probs, reference_log_probs, log_target=True, reduction="batchmean")
        top1_agreement = (log_probs.argmax(-1) == reference_log_probs.argmax(-1)).float().mean()
        results.append(Result(
            setting=name, quantization=quantization, kv_cache_dtype=kv_cache_dtype, perplexity=perplexity,
            change=perplexity / base - 1, kl_divergence=float(kl), top1_agreement=float(top1_agreement),
            greedy_agreement=None if greedy is None else prefix_share(reference_greedy, greedy), weight_bytes=resident_weight_bytes(network),
            kv_bytes_per_token=llm.engine.kv_bytes_per_block // llm.engine.block_size,
            seconds=time.perf_counter() - started,
        ))
        del llm, network
    return results


def report(results: list[Result]) -> str:
    lines = [f"{'setting':<16} {'perplexity':>10} {'change':>8} {'KL':>8} {'top-1 agree':>11} {'greedy agree':>12} {'weights MB':>10} {'KV B/token':>10}"]
    for r in results:
        lines.append(
            f"{r.setting:<16} {r.perplexity:>10.4f} {r.change:>+8.2%} {r.kl_divergence:>8.1e} {r.top1_agreement:>11.1%} "
            f"{'-' if r.greedy_agreement is None else format(r.greedy_agreement, '.1%'):>12} "
            f"{r.weight_bytes / 1e6:>10.1f} {r.kv_bytes_per_token:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duet eval ppl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    settings = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = [name for name in settings if name not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known are {', '.join(SETTINGS)}")
    results = run(args.model, settings)
    print(report(results))
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(r) for r in results], file, indent=2)
    return 0
