"""Attention over the paged KV cache on CPU, one layer: the C++ kernels against the torch path,
side by side in one run.

    duet bench attention [--prompt-tokens 128,512,2048] [--decode-batch 32] [--context 512]
                         [--dtypes float32,bfloat16] [--kv-cache-dtypes auto,int8] [--rounds 5]
                         [--heads 9,3,64] [--window N] [--softcap X] [--json out.json]

For each model dtype and KV cache dtype: a prompt of each length attended as one chunk (the
tiled prompt kernel of ``cpu_ops`` against ``scaled_dot_product_attention``, which the torch
path uses for prompt chunks), and a decode step of ``--decode-batch`` sequences of
``--context`` tokens each (the decode kernel against the torch path's batched matmuls). The
shape is SmolLM2's by default (9 query heads, 3 KV heads, head_dim 64), the cache in blocks of
16 tokens placed at random. ``--window``: each query sees its last N keys (Mistral's, Gemma's
sliding windows); ``--softcap``: scores capped as Gemma 2 caps them (short queries' caps are
torch's on both ways). Prints milliseconds a layer (best of ``--rounds`` rounds that take the
two ways in turn), the kernel's speed-up, and the GFLOP/s of the products it computes (causal:
a prompt's tokens see half the prompt on average, or the window where it is shorter). Where bf16
prompts over a bf16 cache go by AMX tiles, a row ``prompt N no AMX`` follows each such prompt:
the same kernel with its fp32 products instead, timed in the same rounds.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

BLOCK_SIZE = 16


@dataclass
class Timing:
    case: str
    dtype: str
    kv_cache_dtype: str
    kernel_ms: float
    torch_ms: float
    gflop: float

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.kernel_ms


def _layer(query_lens: list[int], seq_lens: list[int], heads: tuple[int, int, int], dtype, cache_dtype, generator):
    """A query batch, its metadata and a paged cache holding the sequences' KV, written as the
    engine writes it (quantized where the cache is)."""
    from duet.kernels import AttentionMetadata
    from duet.kernels.kv_quant import row_width
    from duet.kernels.torch_attention import write_kv_cache_torch

    num_heads, num_kv_heads, head_dim = heads
    blocks = [-(-length // BLOCK_SIZE) for length in seq_lens]
    order = torch.randperm(sum(blocks), generator=generator)
    tables, slots, first = [], [], 0
    for length, count in zip(seq_lens, blocks):
        table = order[first : first + count]
        first += count
        tables.append(torch.nn.functional.pad(table, (0, max(blocks) - count)))
        positions = torch.arange(length)
        slots.append(table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE)
    shape = (num_kv_heads, sum(blocks), BLOCK_SIZE, row_width(head_dim, cache_dtype))
    key_cache, value_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    num_keys = sum(seq_lens)
    keys = torch.randn(num_keys, num_kv_heads, head_dim, generator=generator).to(dtype)
    values = torch.randn(num_keys, num_kv_heads, head_dim, generator=generator).to(dtype)
    write_kv_cache_torch(keys, values, key_cache, value_cache, torch.cat(slots))
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.stack(tables).to(torch.int32),
        query_lens=query_lens, seq_lens_list=seq_lens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
    )
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype)
    return query, key_cache, value_cache, metadata


def _keys_seen(first: int, last: int, window: int | None) -> int:
    """Keys the queries at positions ``first`` to ``last`` see, in all."""
    return sum(position + 1 if window is None else min(position + 1, window) for position in range(first, last + 1))


def measure(prompt_tokens, decode_batch, context, dtypes, kv_cache_dtypes, heads, rounds, window=None, softcap=None) -> list[Timing]:
    from duet.kernels import cpu_ops
    from duet.kernels.torch_attention import paged_attention_torch

    ops = cpu_ops.load()
    if ops is None:
        raise SystemExit("the C++ kernels are not available here (no compiler, or DUET_CPU_OPS=0): nothing to compare")
    num_heads, _, head_dim = heads
    generator = torch.Generator().manual_seed(0)
    cases = [(f"prompt {n}", [n], [n], 4 * num_heads * head_dim * _keys_seen(0, n - 1, window)) for n in prompt_tokens]
    decode_flop = 4 * num_heads * head_dim * _keys_seen(context - 1, context - 1, window) * decode_batch
    cases.append((f"decode {decode_batch} x {context}", [1] * decode_batch, [context] * decode_batch, decode_flop))
    options = {"window": window, "softcap": softcap}
    timings = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for kv_name in kv_cache_dtypes:
            cache_dtype = {"auto": dtype, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_name]
            for case, query_lens, seq_lens, flop in cases:
                query, key_cache, value_cache, metadata = _layer(query_lens, seq_lens, heads, dtype, cache_dtype, generator)
                scale = head_dim**-0.5
                kernel = lambda: paged_attention_torch(query, key_cache, value_cache, metadata, scale, native_ops=ops, **options)  # noqa: E731
                ways = {"kernel": kernel, "torch": lambda: paged_attention_torch(query, key_cache, value_cache, metadata, scale, **options)}
                if case.startswith("prompt") and cache_dtype == torch.bfloat16 and ops.prompt_attention_amx():
                    ways["fp32"] = lambda: _without_amx(ops, kernel)
                times = cpu_ops.best_times(ways, rounds=rounds)
                for label, way in ((case, "kernel"), (f"{case} no AMX", "fp32")):
                    if way in times:
                        timings.append(Timing(label, dtype_name, kv_name, times[way] * 1e3, times["torch"] * 1e3, flop / 1e9))
                        print(_row(timings[-1]), flush=True)
    return timings


def _without_amx(ops, kernel) -> None:
    """The prompt kernel with its fp32 products where it would take AMX tiles."""
    ops.set_prompt_attention_amx(False)
    try:
        kernel()
    finally:
        ops.set_prompt_attention_amx(True)


def _row(timing: Timing) -> str:
    return (
        f"{timing.case:<18} {timing.dtype:<9} {timing.kv_cache_dtype:<9} {timing.kernel_ms:>9.3f} {timing.torch_ms:>9.3f}"
        f" {timing.speedup:>7.2f}x {timing.gflop / timing.kernel_ms * 1e3:>9.1f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench attention", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", default="128,512,2048", help="comma-separated prompt lengths")
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512, help="tokens each decoding sequence holds")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kv-cache-dtypes", default="auto,int8", help="auto (the model's dtype), int8, fp8_e4m3")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    parser.add_argument("--window", type=int, default=None, help="each query sees its last N keys (a sliding window)")
    parser.add_argument("--softcap", type=float, default=None, help="scores become X * tanh(score / X)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    heads = tuple(int(value) for value in args.heads.split(","))
    shape = f"heads {heads[0]} (KV {heads[1]}) x {heads[2]}, window {args.window}, softcap {args.softcap}"
    print(f"attention of one layer, {shape}, torch threads={torch.get_num_threads()}")
    print(f"{'case':<18} {'dtype':<9} {'kv cache':<9} {'kernel ms':>9} {'torch ms':>9} {'speedup':>8} {'GFLOP/s':>9}")
    timings = measure(
        [int(n) for n in args.prompt_tokens.split(",")], args.decode_batch, args.context,
        args.dtypes.split(","), args.kv_cache_dtypes.split(","), heads, args.rounds, args.window, args.softcap,
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(timing) | {"speedup": timing.speedup} for timing in timings], file, indent=2)
