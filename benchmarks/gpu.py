"""The GPU paths against the GPU's own baselines, side by side in one run (a CUDA device needed).

    duet bench gpu [--model smollm2|DIR] [--dtype bfloat16|float16|float32] [--repeats 3] [--json out.json] [--plot out.png]

For one model on ``cuda``: decode throughput of 32 streams x 128 tokens and of one stream, with
the decode step replayed from CUDA graphs (the default, ``duet.cuda_graphs``) and eagerly
(``enforce_eager``), against transformers' ``generate`` on the same GPU in the same dtype;
prefill of one 512-token prompt against transformers' forward; and the paged-attention kernel
(``kernels/triton_attention.py``) against torch's ``scaled_dot_product_attention`` over the same
keys laid out contiguously (no block table), for a decode step of 32 sequences with 512 tokens
of context each and for one 512-token prompt.
"""

from __future__ import annotations

import argparse
import json

import torch
from tqdm import tqdm

from duet.benchmarks.offline import (
    BATCH, OUTPUT_TOKENS, PREFILL_TOKENS, Figure, TransformersBaseline, _best, batch_prompts, filler_tokens, measure_duet,
)
from duet.benchmarks.plots import saved_figure

CONTEXT = 512  # tokens of context per sequence in the attention measures


def attention_seconds(arch, dtype: torch.dtype, num_seqs: int, query_len: int) -> tuple[float, float]:
    """Seconds per call of the paged Triton kernel and of torch's SDPA over contiguous K/V, for
    ``num_seqs`` sequences of ``query_len`` new tokens after ``CONTEXT - query_len`` cached ones."""
    from triton.testing import do_bench

    from duet.kernels.triton_attention import paged_attention_triton
    from duet.model_inputs import Span, build_batch

    heads, kv_heads, head_dim, block_size = arch.num_heads, arch.num_kv_heads, arch.head_dim, 16
    blocks_per_seq = CONTEXT // block_size
    generator = torch.Generator(device="cuda").manual_seed(0)
    cache_shape = (kv_heads, num_seqs * blocks_per_seq, block_size, head_dim)
    key_cache = torch.randn(cache_shape, generator=generator, device="cuda", dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=generator, device="cuda", dtype=dtype)
    spans = [
        Span([0] * query_len, CONTEXT - query_len, list(range(seq * blocks_per_seq, (seq + 1) * blocks_per_seq)))
        for seq in range(num_seqs)
    ]
    metadata = build_batch(spans, block_size, "cuda").metadata
    query = torch.randn(num_seqs * query_len, heads, head_dim, generator=generator, device="cuda", dtype=dtype)
    scale = head_dim**-0.5
    # The same keys in SDPA's layout: [seqs, kv heads, tokens, head_dim], the query [seqs, heads, query_len, head_dim].
    keys = key_cache.view(kv_heads, num_seqs, CONTEXT, head_dim).transpose(0, 1).contiguous()
    values = value_cache.view(kv_heads, num_seqs, CONTEXT, head_dim).transpose(0, 1).contiguous()
    queries = query.view(num_seqs, query_len, heads, head_dim).transpose(1, 2).contiguous()
    mask = torch.ones(query_len, CONTEXT, dtype=torch.bool, device="cuda").tril(CONTEXT - query_len)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)

    paged = paged_attention_triton(query, key_cache, value_cache, metadata, scale)
    reference = sdpa().transpose(1, 2).reshape(paged.shape)
    torch.testing.assert_close(paged.float(), reference.float(), atol=2e-2, rtol=2e-2)  # the same attention, measured
    triton_ms = do_bench(lambda: paged_attention_triton(query, key_cache, value_cache, metadata, scale))
    return triton_ms / 1e3, do_bench(sdpa) / 1e3


def run(model: str, dtype: str, repeats: int) -> list[Figure]:
    from duet.models.loader import read_arch, resolve_model_path

    model_dir = resolve_model_path(model)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    progress = tqdm(total=12, desc="gpu benchmark", unit="stage")
    graphs = measure_duet(dtype, None, repeats, progress, model=model, device="cuda")[1]
    eager = measure_duet(dtype, None, repeats, progress, model=model, device="cuda", enforce_eager=True)[1]
    torch.cuda.empty_cache()
    hf = TransformersBaseline(model_dir, torch_dtype, "cuda")
    prompts, long_prompt = batch_prompts(hf.tokenizer), filler_tokens(hf.tokenizer, PREFILL_TOKENS, seed=1)
    hf_batch = _best(lambda: hf.generate(prompts, OUTPUT_TOKENS), repeats)
    progress.update()
    hf_single = _best(lambda: hf.generate(prompts[:1], OUTPUT_TOKENS), repeats)
    hf_prefill = _best(lambda: hf.prefill(long_prompt), repeats)
    progress.update()
    arch = read_arch(model_dir)
    decode_attention = attention_seconds(arch, torch_dtype, BATCH, 1)
    progress.update()
    prefill_attention = attention_seconds(arch, torch_dtype, 1, CONTEXT)
    progress.update()
    progress.close()
    total, prefill = BATCH * OUTPUT_TOKENS, PREFILL_TOKENS
    decode_us, prefill_us = [s * 1e6 for s in decode_attention], [s * 1e6 for s in prefill_attention]
    return [
        Figure(f"batch {BATCH} x {OUTPUT_TOKENS}, CUDA graphs vs transformers", total / graphs["batch"], total / hf_batch, "tok/s"),
        Figure(f"batch {BATCH} x {OUTPUT_TOKENS}, eager vs transformers", total / eager["batch"], total / hf_batch, "tok/s"),
        Figure(f"batch {BATCH} x {OUTPUT_TOKENS}, CUDA graphs vs eager", total / graphs["batch"], total / eager["batch"], "tok/s"),
        Figure("single stream, CUDA graphs vs transformers", OUTPUT_TOKENS / graphs["single"], OUTPUT_TOKENS / hf_single, "tok/s"),
        Figure("single stream, eager vs transformers", OUTPUT_TOKENS / eager["single"], OUTPUT_TOKENS / hf_single, "tok/s"),
        Figure("single stream, CUDA graphs vs eager", OUTPUT_TOKENS / graphs["single"], OUTPUT_TOKENS / eager["single"], "tok/s"),
        Figure(f"prefill, {PREFILL_TOKENS} tokens vs transformers", prefill / graphs["prefill"], prefill / hf_prefill, "tok/s"),
        Figure(f"attention, decode {BATCH} x {CONTEXT} context: Triton vs SDPA", *decode_us, "us", False),
        Figure(f"attention, {CONTEXT}-token prompt: Triton vs SDPA", *prefill_us, "us", False),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="an alias or a Hugging Face model directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per figure")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--plot", help="also plot the ratios to this PNG file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark measures the GPU paths")
    figures = run(args.model, args.dtype, args.repeats)
    print(f"\nduet on {torch.cuda.get_device_name()}, dtype={args.dtype}, torch {torch.__version__}")
    print(f"{'measure':60} {'duet':>10} {'baseline':>10} {'unit':>6} {'ratio':>7}")
    for figure in figures:
        print(f"{figure.name:60} {figure.duet:10.1f} {figure.transformers:10.1f} {figure.unit:>6} {figure.ratio:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**vars(figure), "ratio": figure.ratio} for figure in figures], f, indent=2)
    if args.plot:
        with saved_figure(args.plot, figsize=(9, 1.5 + 0.45 * len(figures))) as (fig, ax):
            ax.barh([f.name for f in figures], [f.ratio for f in figures], color="#3b7dd8")
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_xlabel("speed-up over the baseline (x)")
            ax.set_title(f"duet on {torch.cuda.get_device_name()}, {args.dtype}")
            for y, figure in enumerate(figures):
                ax.text(figure.ratio, y, f" {figure.ratio:.2f}x", va="center")
