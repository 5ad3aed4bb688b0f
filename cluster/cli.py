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


def _bench(args: argparse.Namespace, rest: list[str]) -> None:
    if args.suite == "offline":
        from duet.benchmarks.offline import main as offline_main

        offline_main(rest)
    elif args.suite == "transfer":
        from duet.benchmarks.transfer import main as transfer_main

        transfer_main(rest)


def main(argv: list[str] | None = None) -> None:
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

    bench = commands.add_parser("bench", help="benchmarks; `duet bench offline --help` for options")
    bench.add_argument("suite", choices=["offline", "transfer"])

    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "chat":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        _chat(args)
    elif args.command == "bench":
        _bench(args, rest)


if __name__ == "__main__":
    sys.exit(main())
