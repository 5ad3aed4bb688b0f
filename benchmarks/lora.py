"""``duet bench offline --lora N``: decode with N LoRA adapters mixed across the batch against
the base model alone, on one engine in the same run.

The adapters are written by PEFT (installed with the test extras) from the model itself: rank
``--lora-rank`` on every projection duet adapts, random A and B (PEFT's own init leaves B at
zero). The batch's prompts take the adapters in turn; the base runs the same prompts.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model_dir: Path, folder: Path, count: int, rank: int) -> dict[str, str]:
    """``count`` random rank-``rank`` adapters of the model in ``model_dir``, by name."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit("--lora needs peft (pip install -e '.[test]')") from None
    from transformers import AutoModelForCausalLM

    adapters = {}
    for index in range(count):
        torch.manual_seed(index)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False, lora_dropout=0.0)
        path = folder / f"adapter-{index}"
        get_peft_model(model, config).save_pretrained(str(path))
        adapters[path.name] = str(path)
    return adapters


def measure(model: str, dtype: str, count: int, rank: int, repeats: int, batch: list[list[int]], output_tokens: int, progress) -> dict:
    """Seconds to decode ``batch`` (and its first prompt alone) with the adapters in turn, and
    with the base model, on one engine."""
    from duet import LLM, SamplingParams
    from duet.models.loader import resolve_model_path

    decode = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="duet-lora-bench-") as folder:
        adapters = write_adapters(resolve_model_path(model), Path(folder), count, rank)
        llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=len(batch), lora_modules=adapters, max_lora_rank=rank)
        names = list(adapters)
        mixed = [names[index % count] for index in range(len(batch))]
        llm.generate(batch[:4], SamplingParams(temperature=0.0, max_tokens=8), lora=mixed[:4])  # warm-up

        def timed(prompts, lora) -> float:
            best = float("inf")
            for _ in range(repeats):
                llm.engine.kv_cache_manager.block_pool.reset_prefix_cache()
                started = time.perf_counter()
                llm.generate(prompts, decode, lora=lora)
                best = min(best, time.perf_counter() - started)
            progress.update()
            return best

        return {
            "batch_base": timed(batch, None), "batch_lora": timed(batch, mixed),
            "single_base": timed(batch[:1], None), "single_lora": timed(batch[:1], names[0]),
        }
