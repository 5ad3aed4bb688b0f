"""``duet profile CONFIG``: how long each pool's engine steps take on this machine, as a profile
JSON that ``duet simulate`` runs on.

    duet profile configs/local-pd.yaml [configs/colocated.yaml ...] [--app NAME] [--out profile.json] [--quick] [--transfer] [--serving]
    duet profile configs/local-pd.yaml --roofline h100 --model-shape llama-2-13b [--tp 2]   (hardware not here: computed)

For each pool of each config's application (by stage: ``prefill``, ``decode``, ``colocated``)
(its merged engine settings and its threads, as a replica of it runs them), one engine in this
process is timed:

- prompt steps: one chunk of ``T`` tokens after ``C`` tokens already in the cache (the first
  ``C`` found by the prefix cache, as a conversation's history is), for a grid of ``T`` up to
  the pool's token budget and ``C`` up to its context;
- decode steps: ``B`` sequences of ``C`` tokens each, one token a step (EOS ignored), the median
  step over several.

Each kind is fitted by least squares: a prompt step ``a + b T + c T (C + T/2)`` (the products per
token, attention per token over its context), a decode step ``a + b B + c B C``. A step that
mixes prompt chunks and decode rows is priced as ``max(a) +`` both sums (``step_seconds``). A
pool that drafts (``speculative_config``) is also timed decoding with its drafts
(``profile_spec``): the tokens a step gives a sequence, and what a row costs verifying them.

With ``--transfer``, the KV transfer's time against tokens (``a + b tokens``) is fitted to
``duet bench transfer``'s measurement (SmolLM2's cache layout, whatever the model); without it
``duet simulate`` takes transfers as free, and says so. With ``--serving``, each config is
brought up and the CPU its serving path takes beside the engines is measured
(``profile_serving``), by mode (``pd``, ``colocated``: a PD request's calls are not a colocated
one's); without it ``duet simulate`` leaves the engines every core. The machine (CPU model, the
flags that choose kernels, cores) and each pool's settings are written beside the samples and
the fits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import statistics
import time
from pathlib import Path

from duet.benchmarks.roofline import add_arguments as add_roofline_arguments, from_arguments as roofline_profile

FIRST_TOKEN = 3  # past the special ids of the tokenizers duet ships with


def machine() -> dict:
    """What this machine is, for a profile's reader: the CPU's model, the cores this process may
    use and the flags that choose kernels."""
    import torch

    from duet.cores import machine_cores

    cpu, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni")
    return {
        "cpu": cpu or platform.processor(), "cores": machine_cores(), "flags": [flag for flag in wanted if flag in flags],
        "torch": torch.__version__,
    }


def nonnegative_least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares with every coefficient kept at zero or above (a column whose coefficient
    comes out negative is dropped and the rest refitted): times do not fall as work grows."""
    import numpy as np

    columns = list(range(len(rows[0])))
    while True:
        matrix = np.array([[row[index] for index in columns] for row in rows], dtype=float)
        solution = np.linalg.lstsq(matrix, np.array(targets, dtype=float), rcond=None)[0]
        if (solution >= 0).all() or len(columns) == 1:
            coefficients = [0.0] * len(rows[0])
            for index, value in zip(columns, solution):
                coefficients[index] = max(0.0, float(value))
            return coefficients
        columns.pop(int(np.argmin(solution)))


def fit_prompt(samples: list[list[float]]) -> dict[str, float]:
    """``[T, C, seconds]`` samples: ``a + b T + c T (C + T/2)``."""
    a, b, c = nonnegative_least_squares([[1.0, t, t * (ctx + t / 2)] for t, ctx, _ in samples], [s for _, _, s in samples])
    return {"base_s": a, "per_token_s": b, "per_token_context_s": c}


def fit_decode(samples: list[list[float]]) -> dict[str, float]:
    """``[B, C, seconds]`` samples: ``a + b B + c B C``."""
    a, b, c = nonnegative_least_squares([[1.0, batch, batch * ctx] for batch, ctx, _ in samples], [s for _, _, s in samples])
    return {"base_s": a, "per_row_s": b, "per_row_context_s": c}


def fit_transfer(samples: list[list[float]]) -> dict[str, float]:
    """``[tokens, seconds]`` samples: ``a + b tokens``."""
    a, b = nonnegative_least_squares([[1.0, tokens] for tokens, _ in samples], [s for _, s in samples])
    return {"base_s": a, "per_token_s": b}


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(length)]


def timed_steps(engine, until) -> list[tuple[float, object]]:
    """Step the engine until ``until()``; each step's seconds and its scheduler output."""
    steps = []
    original = engine.scheduler.schedule

    def schedule(*args, **kwargs):
        output = original(*args, **kwargs)
        steps.append([time.perf_counter(), output])
        return output

    engine.scheduler.schedule = schedule
    try:
        while not until():
            engine.step()
            steps[-1][0] = time.perf_counter() - steps[-1][0]
    finally:
        engine.scheduler.schedule = original
    return [(seconds, output) for seconds, output in steps]


def _warm_up(llm, rng: random.Random) -> None:
    """Untimed prompts and decode steps first: a process's first steps pay for first uses (its
    kernels' buffers, the allocator's pools), which would slow the first samples timed."""
    from duet import SamplingParams

    scheduler, vocab = llm.engine.scheduler, llm.engine.model_config.vocab_size
    prompts = [_prompt(rng, min(128, scheduler.max_num_batched_tokens, scheduler.max_model_len // 2), vocab) for _ in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, ignore_eos=True))


def measure_prompts(llm, budget: int, max_context: int, rng: random.Random, repeats: int, quick: bool) -> list[list[float]]:
    """``[T, C, seconds]``: a chunk of ``T`` new tokens after ``C`` cached ones, the median of ``repeats``."""
    from duet import SamplingParams
    from duet.messages import EngineRequest

    engine, block, vocab = llm.engine, llm.engine.block_size, llm.engine.model_config.vocab_size
    chunks = [t for t in ((32, 128, 512) if quick else (16, 64, 128, 256, 512, 1024, 2048)) if t <= budget]
    contexts = [c for c in ((0, 512) if quick else (0, 256, 1024)) if c + max(chunks) < max_context]
    samples = []
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for context in contexts:
        for chunk in chunks:
            if context + chunk >= max_context:
                continue
            times = []
            for repeat in range(repeats):
                history = _prompt(rng, context - context % block, vocab)
                if history:  # in the prefix cache, as a conversation's earlier turns are
                    engine.add_request(EngineRequest(f"history-{context}-{chunk}-{repeat}", history, one))
                    timed_steps(engine, lambda: not engine.has_unfinished_requests())
                engine.add_request(EngineRequest(f"prompt-{context}-{chunk}-{repeat}", history + _prompt(rng, chunk, vocab), one))
                steps = timed_steps(engine, lambda: not engine.has_unfinished_requests())
                computed = [(seconds, output) for seconds, output in steps if output.total_num_scheduled_tokens]
                if len(computed) == 1 and computed[0][1].total_num_scheduled_tokens == chunk:
                    times.append(computed[0][0])
            if times:
                samples.append([chunk, len(history), statistics.median(times)])
    return samples


def measure_decode(llm, max_seqs: int, max_context: int, rng: random.Random, steps: int, quick: bool) -> list[list[float]]:
    """``[B, C, seconds]``: the median decode step of ``B`` sequences at about ``C`` tokens each."""
    from duet import SamplingParams
    from duet.messages import EngineRequest

    engine, vocab = llm.engine, llm.engine.model_config.vocab_size
    batches = [b for b in ((1, 8, 32) if quick else (1, 2, 4, 8, 16, 32, 64)) if b <= max_seqs]
    contexts = [c for c in ((64, 512) if quick else (64, 256, 1024)) if c + steps + 8 < max_context]
    samples = []
    for context in contexts:
        for batch in batches:
            params = SamplingParams(temperature=0.0, max_tokens=steps + 4, min_tokens=steps + 4, ignore_eos=True)
            for index in range(batch):
                engine.add_request(EngineRequest(f"decode-{context}-{batch}-{index}", _prompt(rng, context, vocab), params))
            timed = timed_steps(engine, lambda: not engine.has_unfinished_requests())
            decode_only = [
                seconds for seconds, output in timed
                if len(output.num_scheduled_tokens) == batch and output.total_num_scheduled_tokens == batch
            ]
            if len(decode_only) >= 3:
                samples.append([batch, context + steps / 2, statistics.median(decode_only)])
    return samples


NEIGHBOUR_BATCH = 8  # sequences a neighbouring engine keeps decoding while this one is timed beside it


def _neighbour(engine_args: dict, num_threads: int, ready, stop) -> None:
    """Another engine on this machine decoding a steady batch, as a busy neighbouring replica does."""
    import torch

    from duet import LLM, SamplingParams
    from duet.messages import EngineRequest

    torch.set_num_threads(num_threads)
    engine = LLM(**engine_args).engine
    rng, vocab, count = random.Random(1), engine.model_config.vocab_size, itertools.count()
    params = SamplingParams(temperature=0.0, max_tokens=256, min_tokens=256, ignore_eos=True)
    ready.set()
    while not stop.is_set():
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < NEIGHBOUR_BATCH:
            engine.add_request(EngineRequest(f"neighbour-{next(count)}", _prompt(rng, 64, vocab), params))
        engine.step()
    engine.close()


def measure_neighbours(
    llm, engine_args: dict, num_threads: int, neighbours: int, alone: dict, rng: random.Random, quick: bool
) -> dict:
    """How much slower this engine's steps are while ``neighbours`` other engines on the machine
    decode (as the other replicas of a cluster on it do): the median ratio to the same steps
    alone, for prompt steps and for decode steps. A busy neighbour never makes a step faster: a
    ratio under one is noise in the times (a step alone slowed by something else) and counts as one."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    stop, events = context.Event(), [context.Event() for _ in range(neighbours)]
    processes = [context.Process(target=_neighbour, args=(engine_args, num_threads, ready, stop), daemon=True) for ready in events]
    for process in processes:
        process.start()
    try:
        for ready in events:
            if not ready.wait(600):
                raise RuntimeError("a neighbouring engine did not start")
        scheduler = llm.engine.scheduler
        prompts = measure_prompts(llm, scheduler.max_num_batched_tokens, scheduler.max_model_len, rng, repeats=2, quick=quick)
        decode = measure_decode(llm, scheduler.max_num_seqs, scheduler.max_model_len, rng, steps=8 if quick else 16, quick=quick)
    finally:
        stop.set()
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    ratios = {}
    for kind, samples in (("prompt", prompts), ("decode", decode)):
        times_alone = {(a, b): seconds for a, b, seconds in alone[kind]}
        found = [seconds / times_alone[(a, b)] for a, b, seconds in samples if (a, b) in times_alone]
        ratios[kind] = max(1.0, statistics.median(found)) if found else 1.0
    return {"neighbours": neighbours, "prompt_slowdown": ratios["prompt"], "decode_slowdown": ratios["decode"]}


def profile_pool(stage: str, engine_args: dict, num_threads: int, quick: bool, seed: int, neighbours: int = 0) -> dict:
    import torch

    from duet import LLM
    from duet.benchmarks.profile_spec import BATCH, measure as measure_speculation

    torch.set_num_threads(num_threads)
    llm = LLM(**engine_args)
    try:
        config = llm.engine.scheduler
        rng = random.Random(seed)
        budget, max_context, max_seqs = config.max_num_batched_tokens, config.max_model_len, config.max_num_seqs
        print(f"{stage}: {num_threads} threads, token budget {budget}, context {max_context}, {max_seqs} sequences", flush=True)
        _warm_up(llm, rng)
        prompts = measure_prompts(llm, budget, max_context, rng, repeats=2 if quick else 3, quick=quick)
        print(f"{stage}: {len(prompts)} prompt steps timed", flush=True)
        decode = measure_decode(llm, max_seqs, max_context, rng, steps=8 if quick else 16, quick=quick)
        print(f"{stage}: {len(decode)} decode steps timed", flush=True)
        speculation = measure_speculation(llm, fit_decode(decode), seed)
        if speculation:
            print(f"{stage}: decoding with its drafts x{speculation['decode_factor']:.2f} the time of steps without at "
                  f"{BATCH} sequences: {speculation['tokens_per_step']:.2f} tokens a step, a row x{speculation['verify_factor']:.2f} "
                  f"(acceptance {speculation['acceptance']:.2f})", flush=True)
        shared = None
        if neighbours:
            alone = {"prompt": prompts, "decode": decode}
            shared = measure_neighbours(llm, engine_args, num_threads, neighbours, alone, rng, quick)
            print(f"{stage}: beside {neighbours} busy engines, prompt steps x{shared['prompt_slowdown']:.2f}, "
                  f"decode steps x{shared['decode_slowdown']:.2f}", flush=True)
    finally:
        llm.engine.close()
    return {
        "neighbours": shared,
        "num_threads": num_threads,
        "settings": {
            "max_num_batched_tokens": budget, "max_model_len": max_context, "max_num_seqs": max_seqs,
            "block_size": llm.engine.block_size, "num_blocks": llm.engine.num_blocks,
            "dtype": str(llm.engine.dtype).removeprefix("torch."),
        },
        "prompt": {"samples": prompts, "fit": fit_prompt(prompts)},
        "decode": {"samples": decode, "fit": fit_decode(decode)},
        "speculation": speculation,
    }


def pools_of(config_path: str, app_name: str | None, resolve: bool = True) -> tuple[dict, dict[str, tuple[dict, int]]]:
    """The application's args, and per pool (``colocated``, or ``prefill`` and ``decode``) its
    engine's arguments and threads, as ``duet.cluster.app`` builds them, and its starting size
    (``resolve=False``: the model as the config names it, not downloaded or looked up)."""
    import yaml

    from duet.cluster.config import parse_args
    from duet.models.loader import resolve_model_path

    raw = yaml.safe_load(Path(config_path).read_text())
    apps = raw["applications"]
    app = next((app for app in apps if app.get("name", "default") == app_name), None) if app_name else apps[0]
    if app is None:
        raise SystemExit(f"{config_path} has no application named {app_name!r}")
    config = parse_args(app.get("args") or {})
    model_dir = str(resolve_model_path(config.model)) if resolve else config.model
    pools = {"colocated": config.decode} if config.mode == "colocated" else {"prefill": config.prefill, "decode": config.decode}
    engines = {stage: pool.merged_engine(config.engine) for stage, pool in pools.items()}
    return app.get("args") or {}, {
        stage: (engines[stage].engine_args(model_dir), pool.num_threads(engines[stage]), pool.starting_replicas(stage))
        for stage, pool in pools.items()
    }


def transfer_samples() -> list[list[float]]:
    """``duet bench transfer``'s KV transfers of SmolLM2's cache layout: ``[tokens, seconds]``."""
    from duet.benchmarks.transfer import measure

    return [[record["tokens"], record["seconds"]] for record in measure(lambda *args: None)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="+", help="Serve config files (configs/local-pd.yaml); their pools by stage in one profile")
    parser.add_argument("--app", default=None, help="the application to profile (default: each file's first)")
    parser.add_argument("--out", default="profile.json")
    parser.add_argument("--quick", action="store_true", help="a smaller grid (about a minute and a half a pool on two cores)")
    parser.add_argument("--transfer", action="store_true", help="also time KV transfers (duet bench transfer's measurement)")
    parser.add_argument("--serving", action="store_true", help="also measure the serving path's CPU, each config brought up")
    parser.add_argument(
        "--neighbours", type=int, default=None,
        help="busy engines to time each pool beside (default: the config's other replicas, one per other core at most; 0: none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_roofline_arguments(parser)
    args = parser.parse_args(argv)
    if args.serving:
        from duet.cluster.deploy import use_loopback_ray

        use_loopback_ray()  # it brings the configs up on this machine: before anything imports ray

    if args.roofline:
        pools = {}
        for config in args.config:
            app_args, config_pools = pools_of(config, args.app, resolve=args.model_shape is None)
            pools |= {stage: engine_args for stage, (engine_args, _, _) in config_pools.items()}
        profile = roofline_profile(args, pools, next(iter(pools.values()))["model"])
        profile["model"] = args.model_shape or app_args.get("model")
        Path(args.out).write_text(json.dumps(profile, indent=1))
        for stage, pool in profile["pools"].items():
            print(f"{stage}: prompt {_shown(pool['prompt']['fit'])}; decode {_shown(pool['decode']['fit'])}; {pool['settings']['num_blocks']} blocks")
        print(f"wrote {args.out} ({profile['machine']['cpu']}, TP={args.tp})")
        return
    profile = {"machine": machine(), "configs": args.config, "pools": {}}
    cores = profile["machine"]["cores"]
    for config in args.config:
        app_args, pools = pools_of(config, args.app)
        profile.setdefault("model", app_args.get("model"))
        # The other replicas the config runs beside each one on this machine, one per other core at most.
        others = min(sum(replicas for *_, replicas in pools.values()) - 1, cores - 1)
        neighbours = others if args.neighbours is None else args.neighbours
        for stage, (engine_args, num_threads, _) in pools.items():
            profile["pools"][stage] = profile_pool(stage, engine_args, num_threads, args.quick, args.seed, neighbours)
    if args.transfer and "prefill" in profile["pools"]:
        samples = transfer_samples()
        profile["transfer"] = {"samples": samples, "fit": fit_transfer(samples)}
    if args.serving:
        from duet.benchmarks.profile_serving import LONG_PROMPT, SHORT_PROMPT, measure
        from duet.benchmarks.sim_model import PoolModel

        profile["serving"] = {}
        for config in args.config:
            app_args, pools = pools_of(config, args.app)
            threads = {stage: num_threads for stage, (_, num_threads, _) in pools.items()}
            mode = "colocated" if "colocated" in pools else "pd"
            first = PoolModel.from_profile(profile["pools"]["colocated" if mode == "colocated" else "prefill"])
            steps = {prompt: first.step_seconds(prompt, prompt * prompt / 2, 0, 0) for prompt in (SHORT_PROMPT, LONG_PROMPT)}  # alone, in one step
            profile["serving"][mode] = measure(config, threads, app_args.get("model_id") or app_args.get("model"), steps)
    Path(args.out).write_text(json.dumps(profile, indent=1))
    for stage, pool in profile["pools"].items():
        print(f"{stage}: prompt {_shown(pool['prompt']['fit'])}; decode {_shown(pool['decode']['fit'])}")
    for mode, serving in profile.get("serving", {}).items():
        fit = serving["fit"]
        print(f"serving path ({mode}): {fit['base_cores']:.3f} cores idle, {fit['per_request_s'] * 1e3:.2f} CPU ms a request, "
              f"{fit['per_prompt_token_s'] * 1e3:.3f} a prompt token, {fit['per_token_s'] * 1e3:.3f} a streamed token; "
              f"{fit['latency_s'] * 1e3:.0f} ms of latency a request; served engines x{fit.get('engine_factor', 1.0):.2f}")
    print(f"wrote {args.out} ({profile['machine']['cpu']})")


def _shown(fit: dict[str, float]) -> str:
    return ", ".join(f"{name} {value * 1e3:.4g} ms" for name, value in fit.items())
