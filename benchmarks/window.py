"""What freeing the blocks before a sliding window buys: long sequences of a model whose every
layer has a window, in a KV cache too small to hold them whole, with the blocks freed as duet
does and kept whole as before, side by side in one run.

    duet bench window [--window 256] [--sequences 32] [--prompt-tokens 128] [--new-tokens 768]
                      [--kv-blocks 600] [--rounds 1] [--json out.json] [--plot out.png]

The model is SmolLM2's weights under a Mistral config with ``sliding_window`` (the same
decoder; a Mistral's layers each see their last ``--window`` keys). ``free``: duet as built;
``keep``: the same engine with its KV manager told of no window (every block kept, as before
duet freed them), each in a process of its own. Reports output tokens/s, the mean number of
sequences running a step, preemptions, and whether both gave every sequence the same tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("keep", "free")


def windowed_smollm2(target: Path, window: int) -> Path:
    """SmolLM2's converted directory as a Mistral with a ``window``-key sliding window (links to
    its weights and tokenizer, a config of its own)."""
    from duet.models.gguf_convert import ensure_smollm2

    source = ensure_smollm2()
    target.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists() and not (target / name).exists():
            (target / name).symlink_to(source / name)
    config = json.loads((source / "config.json").read_text())
    config |= {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": window}
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def run_mode(mode: str, model: str, args: argparse.Namespace) -> dict:
    """One engine's run (in this process): its tokens/s, mean running sequences, preemptions and
    a digest of every sequence's tokens."""
    from duet import LLM, SamplingParams
    from duet.benchmarks.workloads import SAFE_TOKEN_RANGE
    from duet.messages import EngineRequest
    from duet.models.llama import LlamaArch

    if mode == "keep":  # the KV manager learns of no window: every block stays, as before
        LlamaArch.kv_window = property(lambda self: None)
    llm = LLM(model=model, num_kv_blocks=args.kv_blocks, max_model_len=args.prompt_tokens + args.new_tokens + 64,
              max_num_seqs=args.sequences, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(args.prompt_tokens)] for _ in range(args.sequences)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    for index, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"w{index}", prompt, params))
    tokens = {f"w{index}": [] for index in range(args.sequences)}
    running, started = [], time.perf_counter()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
        running.append(len(engine.scheduler.running))
    elapsed = time.perf_counter() - started
    total = sum(len(sequence) for sequence in tokens.values())
    digest = hashlib.sha1(json.dumps([tokens[f"w{index}"] for index in range(args.sequences)]).encode()).hexdigest()
    return {
        "mode": mode, "seconds": elapsed, "tokens": total, "tok_s": total / elapsed, "steps": len(running),
        "mean_running": sum(running) / len(running), "preemptions": engine.stats().scheduler.num_preemptions, "digest": digest,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duet bench window", description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=768)
    parser.add_argument("--kv-blocks", type=int, default=600, help="KV blocks of 16 tokens (the default holds 11 sequences whole)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both modes, the order turned each round")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--json", help="also write every run here")
    parser.add_argument("--plot", help="a PNG of tokens/s and running sequences by mode")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one run, this process (the parent's child)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.model, args)))
        return 0

    runs = []
    with tempfile.TemporaryDirectory() as folder:
        model = str(windowed_smollm2(Path(folder) / "smollm2-window", args.window))
        passed = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                  if name in ("window", "sequences", "prompt_tokens", "new_tokens", "kv_blocks", "seed")]
        for round_index in range(args.rounds):
            for mode in MODES if round_index % 2 == 0 else reversed(MODES):
                child = [sys.executable, "-m", "duet.benchmarks.window", f"--mode={mode}", f"--model={model}", *passed]
                result = subprocess.run(child, capture_output=True, text=True, check=True)
                run = json.loads(result.stdout.strip().splitlines()[-1]) | {"round": round_index}
                runs.append(run)
                print(f"round {round_index} {mode}: {run['tok_s']:.1f} tok/s, {run['mean_running']:.1f} running a step, "
                      f"{run['preemptions']} preemptions, {run['seconds']:.1f} s", flush=True)
    same = len({run["digest"] for run in runs}) == 1
    print(f"every sequence's tokens the same in every run: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    if args.plot:
        plot(runs, args, args.plot)
    return 0 if same else 1


def plot(runs: list[dict], args: argparse.Namespace, path: str) -> None:
    from duet.benchmarks.plots import saved_figure

    with saved_figure(path, figsize=(8, 3.4), what="window plot", ncols=2) as (figure, axes):
        for axis, key, label in ((axes[0], "tok_s", "output tokens/s"), (axes[1], "mean_running", "sequences running a step")):
            for index, mode in enumerate(MODES):
                values = [run[key] for run in runs if run["mode"] == mode]  # a bar a round
                width = 0.8 / len(values)
                axis.bar([index - 0.4 + width * (offset + 0.5) for offset in range(len(values))], values, width=width,
                         color=("tab:gray", "tab:blue")[index])
            axis.set_xticks(range(len(MODES)), ["blocks kept", "blocks freed"])
            axis.set_ylabel(label)
        figure.suptitle(f"{args.sequences} sequences of {args.prompt_tokens} + {args.new_tokens} tokens, window {args.window}, "
                        f"{args.kv_blocks} KV blocks", fontsize=9)


if __name__ == "__main__":
    sys.exit(main())
