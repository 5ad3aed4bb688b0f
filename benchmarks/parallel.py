"""Parallel layouts on this machine: SmolLM2's decode step at TP=1, TP=2 and PP=2, and where it goes.

    duet bench parallel [--batches 1,32] [--steps 32] [--json out.json] [--plot out.png]

Layouts, each on all of the machine's cores: ``tp1``, one worker in the engine's process with
every thread; ``tp1-ray``, that worker in a Ray actor (what the executor's round trip costs a
step); ``tp2``, two workers as Ray actors with half the threads each, meeting through shared
memory (gloo across machines, NCCL on a GPU); ``pp2``, two stages of 15 layers, one worker
each. For each batch, the median decode step (every sequence past its first token) and the
share of it the ranks spend communicating (mean over the ranks). For tp2: their collectives,
an all-reduce after each attention and MLP block, one after the embedding, the LM head's
gather, waiting for the slower rank included. For pp2: the hidden states from the stage before
(waiting for it to compute them), the sends to the next, and the sampled tokens from the last
(the first stage waits there for the last stage's compute: with one micro-batch, at batch 1,
the stages take turns).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from duet.benchmarks.plots import saved_figure

LAYOUTS = ("tp1", "tp1-ray", "tp2", "pp2")


@dataclass
class Row:
    layout: str
    batch: int
    step_ms: float
    collective_ms: float  # per step, mean over the ranks
    collectives_per_step: float

    @property
    def collective_share(self) -> float:
        return self.collective_ms / self.step_ms


def _engine(layout: str, max_batch: int):
    from duet import LLM

    settings = dict(model="smollm2", max_model_len=1024, kv_cache_memory_gib=0.25, max_num_seqs=max_batch)
    if layout == "tp1-ray":
        settings["distributed_executor_backend"] = "ray"
    elif layout == "tp2":
        settings["tensor_parallel_size"] = 2
    elif layout == "pp2":
        settings["pipeline_parallel_size"] = 2
    return LLM(**settings).engine


def _collective_stats(engine) -> list[tuple[float, int]]:
    workers = getattr(engine.executor, "workers", None)
    if workers is None:
        return [engine.executor.worker.collective_stats()]
    import ray

    return ray.get([worker.collective_stats.remote() for worker in workers])


def measure(layout: str, prompts: list[list[int]], batches: list[int], steps: int, progress) -> list[Row]:
    from duet import SamplingParams
    from duet.messages import EngineRequest

    engine = _engine(layout, max(batches))
    rows = []
    try:
        for batch in batches:
            params = SamplingParams(temperature=0.0, max_tokens=steps + 4, min_tokens=steps + 4)
            ids = [f"{layout}-{batch}-{index}" for index in range(batch)]
            for request_id, prompt in zip(ids, prompts[:batch]):
                engine.add_request(EngineRequest(request_id, prompt, params))
            started = set()
            while len(started) < batch:  # prompts, until every sequence has its first token
                started |= {delta.request_id for delta in engine.step() if delta.token_ids}
            before = _collective_stats(engine)
            times = []
            for _ in range(steps):
                begin = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - begin)
            after = _collective_stats(engine)
            for request_id in ids:
                engine.abort_request(request_id)
            while engine.has_unfinished_requests():
                engine.step()
            spent = statistics.mean(end[0] - start[0] for start, end in zip(before, after))
            calls = statistics.mean(end[1] - start[1] for start, end in zip(before, after))
            rows.append(Row(layout, batch, 1000 * statistics.median(times), 1000 * spent / steps, calls / steps))
            progress.update()
    finally:
        engine.check_integrity()
        engine.close()
    return rows


def print_table(rows: list[Row]) -> None:
    baseline = {row.batch: row.step_ms for row in rows if row.layout == "tp1"}
    print(f"\n{'layout':<9} {'batch':>5} {'step ms':>9} {'vs tp1':>7} {'communication ms':>17} {'share':>6} {'calls':>6}")
    for row in rows:
        print(
            f"{row.layout:<9} {row.batch:>5} {row.step_ms:>9.2f} {baseline[row.batch] / row.step_ms:>6.2f}x "
            f"{row.collective_ms:>17.2f} {100 * row.collective_share:>5.0f}% {row.collectives_per_step:>6.0f}"
        )


def plot(rows: list[Row], path: str) -> None:
    batches = sorted({row.batch for row in rows})
    with saved_figure(path, figsize=(4.5 * len(batches), 4), ncols=len(batches)) as (figure, axes):
        for axis, batch in zip(figure.axes if len(batches) > 1 else [axes], batches):
            chosen = [row for row in rows if row.batch == batch]
            names = [row.layout for row in chosen]
            compute = [row.step_ms - row.collective_ms for row in chosen]
            axis.bar(names, compute, label="compute and the rest")
            axis.bar(names, [row.collective_ms for row in chosen], bottom=compute, label="communication and stage waits")
            axis.set_ylim(0, 1.25 * max(row.step_ms for row in chosen))
            axis.set_title(f"SmolLM2 decode step, batch {batch}")
            axis.set_ylabel("ms")
            axis.legend()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench parallel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    if "tp1" not in layouts or any(layout not in LAYOUTS for layout in layouts):
        parser.error(f"--layouts must include tp1 and name only {', '.join(LAYOUTS)}")
    batches = [int(batch) for batch in args.batches.split(",")]

    from transformers import AutoTokenizer

    from duet.benchmarks.offline import BATCH, batch_prompts
    from duet.models.gguf_convert import ensure_smollm2

    if max(batches) > BATCH:
        parser.error(f"batches go up to {BATCH}")
    prompts = batch_prompts(AutoTokenizer.from_pretrained(str(ensure_smollm2())))
    print(f"{torch.get_num_threads()} threads; SmolLM2-135M-Instruct, float32 (GGUF blocks where they apply), greedy")
    rows = []
    with tqdm(total=len(layouts) * len(batches), desc="bench parallel", unit="case") as progress:
        for layout in layouts:
            rows += measure(layout, prompts, batches, args.steps, progress)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(row) | {"collective_share": row.collective_share} for row in rows], indent=2))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
