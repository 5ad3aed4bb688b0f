"""How many generated tool calls are valid: random function schemas sent through the official
``openai`` client to duet and, in the same run, to another OpenAI server (vLLM with
``--enable-auto-tool-choice --tool-call-parser hermes``).

    duet bench tools --url http://127.0.0.1:8000 --model smollm2 [--peer-url http://127.0.0.1:8001 --peer-model smollm2]
                     [--requests 120] [--temperatures 0,1] [--max-tokens 256] [--seed 0] [--json out.json]

Each request draws 1-3 functions (nested objects, enums, arrays, required fields; strings and
numbers unbounded unless ``--bounded``) and a tool choice in turn (``auto``, ``required``, the
first function by name), greedy or sampled, half of them streamed. A call is valid when its
name is one of the request's functions and its arguments parse as JSON and validate against
that function's schema (jsonschema). Counted per server: calls, valid calls, calls that do not
parse, that parse but break their schema, that name no function; ``required`` or named requests
that ended without a call; requests cut by ``max_tokens`` (their last call, whole or not, is
not counted: a stream shows a cut call as far as it got);
requests refused or failed (any HTTP error).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from duet.benchmarks.tool_schemas import random_tools


def requests(count: int, temperatures: list[float], seed: int, bounded: bool) -> list[dict]:
    """The same requests for every server."""
    rng = random.Random(seed)
    drawn = []
    for index in range(count):
        tools = random_tools(rng, rng.randint(1, 3), bounded)
        choice = ["auto", "required", {"type": "function", "function": {"name": tools[0]["function"]["name"]}}][index % 3]
        drawn.append({
            "messages": [{"role": "user", "content": f"Use the tools to answer request number {index}: look something up."}],
            "tools": tools, "tool_choice": choice, "temperature": temperatures[index // 3 % len(temperatures)], "seed": index,
            "stream": index % 2 == 1,
        })
    return drawn


def _ask(client, model: str, request: dict, max_tokens: int):
    """The final choice, however it was sent."""
    import openai

    fields = {key: value for key, value in request.items() if key != "stream"} | {"model": model, "max_tokens": max_tokens}
    if not request["stream"]:
        return client.chat.completions.create(**fields).choices[0]
    with client.chat.completions.stream(**fields) as events:
        for _ in events:
            pass
        try:
            return events.get_final_completion().choices[0]
        except openai.LengthFinishReasonError as cut:
            return cut.completion.choices[0]


def judge(request: dict, choice) -> Counter:
    """What one answer counts for."""
    import jsonschema

    counts = Counter(requests=1)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in request["tools"]}
    calls = list(choice.message.tool_calls or [])
    if choice.finish_reason == "length":
        counts["cut_by_max_tokens"] += 1
        calls = calls[:-1]
    elif request["tool_choice"] != "auto" and not calls:
        counts["missing_call"] += 1
    for call in calls:
        counts["calls"] += 1
        if call.function.name not in schemas:
            counts["unknown_function"] += 1
            continue
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            counts["not_json"] += 1
            continue
        try:
            jsonschema.validate(arguments, schemas[call.function.name])
        except jsonschema.ValidationError:
            counts["breaks_schema"] += 1
            continue
        counts["valid"] += 1
    return counts


def measure(url: str, model: str, drawn: list[dict], max_tokens: int, concurrency: int, label: str) -> Counter:
    import openai

    client = openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="none", max_retries=0, timeout=600)

    def one(request: dict) -> Counter:
        try:
            return judge(request, _ask(client, model, request, max_tokens))
        except openai.APIError as error:
            return Counter(requests=1, failed=1, **{f"failed_{getattr(error, 'status_code', None) or 'other'}": 1})

    total = Counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for counts in tqdm(pool.map(one, drawn), total=len(drawn), desc=label, unit="req"):
            total += counts
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench tools", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="duet's router (or any OpenAI server)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--peer-url", default=None, help="another OpenAI server to send the same requests to")
    parser.add_argument("--peer-model", default=None, help="its model name (default: --model)")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--bounded", action="store_true", help="bound every string, array and number (for random-weight models)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the counts here")
    args = parser.parse_args(argv)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # the openai client's request lines
    drawn = requests(args.requests, [float(value) for value in args.temperatures.split(",")], args.seed, args.bounded)
    servers = {"duet": (args.url, args.model)}
    if args.peer_url:
        servers["peer"] = (args.peer_url, args.peer_model or args.model)
    results = {name: measure(url, model, drawn, args.max_tokens, args.concurrency, name) for name, (url, model) in servers.items()}
    columns = ["requests", "calls", "valid", "not_json", "breaks_schema", "unknown_function", "missing_call", "cut_by_max_tokens", "failed"]
    print(f"{'server':<8}" + "".join(f"{column:>18}" for column in columns) + f"{'valid share':>14}")
    for name, counts in results.items():
        share = counts["valid"] / counts["calls"] if counts["calls"] else float("nan")
        print(f"{name:<8}" + "".join(f"{counts[column]:>18}" for column in columns) + f"{share:>14.1%}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "results": {name: dict(counts) for name, counts in results.items()}}, file, indent=1)
