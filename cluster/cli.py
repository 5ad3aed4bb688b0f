"""The ``duet`` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def _chat(args: argparse.Namespace) -> None:
    from duet import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    output = llm.chat([{"role": "user", "content": args.message}], params)[0]
    print(output.outputs[0].text)


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
    from duet.cluster.deploy import DeployError, format_status, status

    try:
        print(format_status(status(args.url)))
    except DeployError as error:
        print(f"duet status: {error}", file=sys.stderr)
        return 1
    return 0


def _scale(args: argparse.Namespace) -> int:
    from duet.cluster.deploy import DeployError, scale

    replicas = None if args.replicas == "auto" else int(args.replicas)
    try:
        scale(args.pool, replicas, args.url)
    except DeployError as error:
        print(f"duet scale: {error}", file=sys.stderr)
        return 1
    print(f"the {args.pool} pool is " + ("back with its autoscaling policy" if replicas is None else f"pinned at {replicas} replicas"))
    return 0


def _down(args: argparse.Namespace) -> int:
    from duet.cluster.deploy import down

    print("stopped" if down() else "nothing that `duet up` started is running")
    return 0


EVAL_CHECKS = ("ppl",)
BENCH_SUITES = ("offline", "step", "attention", "transfer", "serve", "spec", "autoscale", "migrate", "parallel", "soak", "grammar", "structured")


def _bench(args: argparse.Namespace, rest: list[str]) -> int | None:
    """A suite's exit status, where it has one (``soak``: 1 when its ledger is not exact)."""
    import importlib

    return importlib.import_module(f"duet.benchmarks.{args.suite}").main(rest)


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

    bench = commands.add_parser("bench", help="benchmarks; `duet bench offline --help` for options")
    bench.add_argument("suite", choices=BENCH_SUITES)
    evaluate = commands.add_parser("eval", help="quality checks; `duet eval ppl --help` for options")
    evaluate.add_argument("check", choices=EVAL_CHECKS)

    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "chat":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        _chat(args)
    elif args.command == "bench":
        return _bench(args, rest)
    elif args.command == "eval":
        from duet.benchmarks import perplexity

        return perplexity.main(rest)
    else:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "scale" and args.replicas != "auto" and not args.replicas.isdigit():
            parser.error("replicas must be a number or 'auto'")
        return {"up": _up, "status": _status, "scale": _scale, "down": _down}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
