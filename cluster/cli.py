"""The ``duet`` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def _chat(args: argparse.Namespace) -> int:
    """A model that cannot be found or a setting the engine refuses is one line, with what to type."""
    from duet import LLM, SamplingParams
    from duet.config import ConfigError
    from duet.errors import CheckpointError
    from duet.models.loader import ModelNotFoundError

    try:
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    except CheckpointError as error:  # not found, or a checkpoint duet does not run (the error names what)
        hint = (
            "; pass --model smollm2 (fetched on first use), the path of a local Hugging Face model directory "
            "(config.json and *.safetensors), a .gguf file or a hub id (org/name)"
        ) if isinstance(error, ModelNotFoundError) else ""
        print(f"duet chat: {error}{hint}", file=sys.stderr)
        return 1
    except ConfigError as error:
        print(f"duet chat: {error}", file=sys.stderr)
        return 1
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    output = llm.chat([{"role": "user", "content": args.message}], params)[0]
    print(output.outputs[0].text)
    return 0


def _up(args: argparse.Namespace) -> int:
    from duet.cluster.deploy import DeployError, up

    try:
        state = up(args.config)
    except DeployError as error:
        print(f"duet up: {error}", file=sys.stderr)
        return 1
    for name, url in zip(state.apps, state.urls):
        print(f"{name} is healthy at {url}  (OpenAI API under {url}/v1; `duet status`, `duet down`)")
    return 0


def _status(args: argparse.Namespace) -> int:
    from duet.cluster.deploy import DeployError
    from duet.cluster.operate import format_status, status

    try:
        print(format_status(status(args.url)))
    except DeployError as error:
        print(f"duet status: {error}", file=sys.stderr)
        return 1
    return 0


SCALE_REPLICAS_RULE = "replicas must be a positive number (e.g. 2), or 'auto' to give the pool back to its policy"


def scale_replicas(text: str) -> int | None:
    """``duet scale``'s replicas: a positive number, or ``auto`` (None: back to the policy)."""
    if text.strip().lower() == "auto":
        return None
    try:
        replicas = int(text)
    except ValueError:
        replicas = 0
    if replicas < 1:
        raise ValueError(f"{SCALE_REPLICAS_RULE}, not {text!r}")
    return replicas


def scaled_message(pool: str, replicas: int | None, answer: dict) -> str:
    """What ``duet scale`` did: the size the pool is held at (the router's ``target``, the size
    asked clamped to the pool's bounds) and, when that is not the size asked, why."""
    if replicas is None:
        return f"the {pool} pool is back with its autoscaling policy"
    target = answer.get("target", replicas)
    message = f"the {pool} pool is pinned at {target} replicas"
    if target != replicas and "min_replicas" in answer and "max_replicas" in answer:
        message += f" (asked {replicas}; its autoscaling_config allows {answer['min_replicas']} to {answer['max_replicas']})"
    elif target != replicas:
        message += f" (asked {replicas}; its autoscaling_config bounds it)"
    return message


def _scale(args: argparse.Namespace) -> int:
    from duet.cluster.deploy import DeployError
    from duet.cluster.operate import scale

    replicas = scale_replicas(args.replicas)
    try:
        answer = scale(args.pool, replicas, args.url)
    except DeployError as error:
        print(f"duet scale: {error}", file=sys.stderr)
        return 1
    print(scaled_message(args.pool, replicas, answer))
    return 0


def _down(args: argparse.Namespace) -> int:
    from duet.cluster.deploy import down

    print("stopped" if down() else "nothing that `duet up` started is running")
    return 0


EVAL_CHECKS = ("ppl",)
BENCH_SUITES = (
    "offline", "step", "attention", "cascade", "transfer", "serve", "spec", "autoscale", "migrate", "parallel", "soak", "grammar", "structured",
    "tools", "gpu", "window", "pull",
)


def _run_suite(module: str, argv: list[str]) -> int | None:
    """Run ``duet.benchmarks.<module>``'s own ``main`` on everything after its name (``--help``
    included); its exit status, where it has one (``soak``: 1 when its ledger is not exact)."""
    import importlib

    return importlib.import_module(f"duet.benchmarks.{module}").main(argv)


def _options_for_the_suite(command: argparse.ArgumentParser, help: str) -> None:
    """Everything after the suite's name, its --help included, is the suite's: its own parser reads it."""
    options = command.add_argument("options", nargs=argparse.REMAINDER, help=help)
    options.required = False  # argparse calls a REMAINDER positional required; none is fine


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(prog="duet", description="duet: disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)

    chat = commands.add_parser("chat", help="answer one chat message with the offline engine")
    chat.add_argument("message")
    chat.add_argument("--model", default="smollm2")
    chat.add_argument("--dtype", default="float32")
    chat.add_argument("--max-model-len", type=int, default=2048)
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int, default=None)

    up = commands.add_parser("up", help="deploy a Serve config file (starting a local Ray cluster if none runs)")
    up.add_argument("config", help="a YAML file such as configs/local-pd.yaml")
    status = commands.add_parser("status", help="pools, replicas, KV usage and queue of the running cluster")
    status.add_argument("--url", default=None, help="the router's URL (default: the one `duet up` printed)")
    scale = commands.add_parser("scale", help="pin an autoscaled pool at a size, or give it back to its policy (auto)")
    scale.add_argument("pool", choices=["prefill", "decode", "colocated"])
    scale.add_argument("replicas", help="a number of replicas, or 'auto'")
    scale.add_argument("--url", default=None, help="the router's URL (default: the one `duet up` printed)")
    commands.add_parser("down", help="stop what `duet up` started")

    bench = commands.add_parser("bench", help="benchmarks; `duet bench SUITE --help` for a suite's options")
    bench.add_argument("suite", choices=BENCH_SUITES, help="the benchmark to run")
    _options_for_the_suite(bench, "the suite's options: `duet bench SUITE --help`")
    evaluate = commands.add_parser("eval", help="quality checks; `duet eval ppl --help` for options")
    evaluate.add_argument("check", choices=EVAL_CHECKS, help="the check to run")
    _options_for_the_suite(evaluate, "the check's options: `duet eval ppl --help`")

    profile = commands.add_parser("profile", help="time a config's engine steps on this machine (a profile for `duet simulate`)")
    _options_for_the_suite(profile, "the config and options: `duet profile --help`")
    simulate = commands.add_parser("simulate", help="`duet bench serve`'s load on a model of a config's cluster, from a profile")
    _options_for_the_suite(simulate, "options: `duet simulate --help`")
    plan = commands.add_parser("plan", help="the layout of the cores that a profile says serves a load best, as a config")
    _options_for_the_suite(plan, "options: `duet plan --help`")

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("profile", "simulate", "plan"):  # every option is the command's own, leading ones too
        return _run_suite(argv[0], argv[1:])
    args = parser.parse_args(argv)
    if args.command == "scale":
        try:
            scale_replicas(args.replicas)
        except ValueError as error:
            scale.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "bench":
        return _run_suite(args.suite, args.options)
    if args.command == "eval":
        return _run_suite({"ppl": "perplexity"}[args.check], args.options)
    return {"chat": _chat, "up": _up, "status": _status, "scale": _scale, "down": _down}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
