"""The serving benchmark's workloads, as sessions of (prompt token ids, output tokens) turns: a
session's turns are sent one after another, each when the one before it ended; sessions arrive
as a Poisson process.

- ``random``: one turn of random tokens (``input_len``), ``output_len`` out.
- ``shared-prefix``: the same, the first ``shared_prefix`` tokens common to every request.
- ``sharegpt``: the first turn of ShareGPT conversations (vLLM's benchmark set), rendered by the
  model's chat template, output as long as the recorded reply (capped).
- ``multiturn``: ShareGPT conversations replayed as sessions of up to ``turns`` turns, each
  sending the whole history (the recorded replies as the assistant's turns, or with
  ``--history generated`` those the server generated, as a chat client sends them) and the
  next message.
- ``trace``: a request log in the Mooncake trace format, one JSON object a line with its
  ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (one id per block of
  the prompt, 512 tokens in Mooncake's traces: requests that share a prefix share its ids),
  replayed at its own arrival times scaled to the chosen mean rate.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

SAFE_TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary of SmolLM2's tokenizer, no special tokens
WORKLOADS = ("random", "shared-prefix", "sharegpt", "multiturn", "trace")
TRACE_BLOCK_TOKENS = 512  # the tokens of one hash id in Mooncake's traces


@dataclass(frozen=True)
class TurnSpec:
    prompt: list[int]
    output_len: int
    at_s: float | None = None  # a trace's session: when it arrived in the trace (s after its first)
    # A later turn's tokens after the last turn's reply (its end of turn, this turn's message, the
    # assistant's start): with the replies generated as the history, the prompt is the last one's,
    # the reply the server made, and these (None: the recorded history only).
    after_reply: list[int] | None = None

    def sent_prompt(self, last: tuple[list[int], list[int]] | None) -> list[int]:
        """The prompt to send after ``last`` (the last turn's prompt sent and the tokens it
        generated; None: the history as recorded)."""
        if last is None or self.after_reply is None:
            return self.prompt
        return last[0] + last[1] + self.after_reply


def arrival_times(num_sessions: int, rate: float, seed: int) -> list[float]:
    """When each session's first request is sent, Poisson at ``rate`` (0: all at once)."""
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(num_sessions):
        times.append(now)
        now += rng.expovariate(rate) if rate > 0 else 0.0
    return times


def session_arrivals(sessions: list[list[TurnSpec]], rate: float, seed: int) -> list[float]:
    """When each session is sent: a trace's own times, stretched or squeezed so that its mean
    rate is ``rate`` (0: all at once); other workloads' sessions arrive as a Poisson process."""
    traced = [turns[0].at_s for turns in sessions]
    if not traced or None in traced:
        return arrival_times(len(sessions), rate, seed)
    span = traced[-1] - traced[0]
    if rate <= 0 or span <= 0:
        return [0.0] * len(traced)
    stretch = (len(traced) - 1) / rate / span
    return [(at - traced[0]) * stretch for at in traced]


def random_sessions(num: int, input_len: int, output_len: int, shared_prefix: int, seed: int) -> list[list[TurnSpec]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(shared_prefix)]
    return [
        [TurnSpec(prefix + [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(input_len - shared_prefix)], output_len)]
        for _ in range(num)
    ]


def sharegpt_sessions(
    tokenizer, conversations: list[list[dict]], num: int, max_turns: int, output_cap: int, max_context: int, seed: int
) -> list[list[TurnSpec]]:
    """``num`` sessions of up to ``max_turns`` turns drawn from ShareGPT ``conversations`` for a
    model's ``tokenizer`` (a ``RouterTokenizer``): each turn's prompt is the conversation so far
    through the chat template, its output the recorded reply's length, capped at ``output_cap``
    (and at least 4). A session ends before the turn that would pass ``max_context``; one whose
    first turn would is passed over."""
    from duet.benchmarks.sharegpt import sessions

    chosen = []
    for conversation in sessions(conversations, min(len(conversations), 4 * num), max_turns, seed):
        history, turns = [], []
        for turn in conversation:
            history.append({"role": "user", "content": turn.message})
            prompt = tokenizer.encode_chat(history)
            output_len = max(4, min(output_cap, len(tokenizer.encode(turn.reply, add_special_tokens=False))))
            if len(prompt) + output_len > max_context:
                break
            turns.append(TurnSpec(prompt, output_len, after_reply=_after_reply(prompt, turns[-1].prompt, reply) if turns else None))
            history.append({"role": "assistant", "content": turn.reply})
            reply = tokenizer.encode(turn.reply, add_special_tokens=False)
        if turns:
            chosen.append(turns)
        if len(chosen) == num:
            break
    return chosen


def _after_reply(prompt: list[int], last_prompt: list[int], reply: list[int]) -> list[int] | None:
    """What follows the last turn's prompt and its reply in ``prompt``, where the chat template
    puts them there token for token (else None: the boundary tokenizes otherwise)."""
    end = len(last_prompt) + len(reply)
    return prompt[end:] if prompt[:end] == last_prompt + reply else None


def trace_sessions(path: str | Path, num: int, max_context: int, seed: int, scale: float | None = None) -> list[list[TurnSpec]]:
    """The first ``num`` requests of a Mooncake-format trace as one-turn sessions. Lengths (and
    a hash id's block with them) are multiplied by ``scale``, by default the factor that fits the
    90th percentile of the requests' lengths in ``max_context``: a request still too long keeps
    its output (at most half the context) and the start of its prompt. A hash id stands for the
    same random tokens wherever it appears (for this ``seed``), so prefixes the trace shares are
    shared here."""
    records = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                record = json.loads(line)
                if not {"timestamp", "input_length", "output_length"} <= record.keys():
                    raise ValueError(f"{path}:{number}: a request needs timestamp, input_length and output_length (and hash_ids)")
                records.append(record)
            if len(records) == num:
                break
    if not records:
        raise ValueError(f"{path}: no requests")
    records.sort(key=lambda record: record["timestamp"])
    if scale is None:
        lengths = sorted(record["input_length"] + record["output_length"] for record in records)
        scale = min(1.0, max_context / lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))])
    block = max(1, int(TRACE_BLOCK_TOKENS * scale))
    blocks: dict[int, list[int]] = {}
    first_ms, sessions = records[0]["timestamp"], []
    for index, record in enumerate(records):
        output_len = max(1, min(int(record["output_length"] * scale), max_context // 2))
        input_len = max(1, min(int(record["input_length"] * scale), max_context - output_len))
        prompt = []
        for hash_id in record.get("hash_ids", []):
            if hash_id not in blocks:
                rng = random.Random(f"{seed}/{hash_id}")
                blocks[hash_id] = [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(block)]
            prompt += blocks[hash_id]
            if len(prompt) >= input_len:
                break
        rng = random.Random(f"{seed}/request/{index}")  # a prompt longer than its blocks: its own tokens
        prompt = prompt[:input_len] + [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(input_len - len(prompt))]
        sessions.append([TurnSpec(prompt, output_len, (record["timestamp"] - first_ms) / 1e3)])
    return sessions


def make_sessions(args: argparse.Namespace, workload: str, seed: int) -> list[list[TurnSpec]]:
    """The sessions of ``workload`` that ``duet bench serve``'s load arguments (``args``) and ``seed`` give."""
    if workload in ("random", "shared-prefix"):
        prefix = args.shared_prefix if workload == "shared-prefix" else 0
        return random_sessions(args.num_requests, args.input_len, args.output_len, prefix, seed)
    if workload == "trace":
        return trace_sessions(args.trace, args.num_requests, args.max_context, seed, args.trace_scale)
    from duet.benchmarks.sharegpt import load_conversations
    from duet.models.loader import resolve_model_path
    from duet.router.tokenizer import RouterTokenizer

    tokenizer = RouterTokenizer(resolve_model_path(args.tokenizer))
    turns = 1 if workload == "sharegpt" else args.turns
    return sharegpt_sessions(tokenizer, load_conversations(), args.num_requests, turns, args.sharegpt_output_cap, args.max_context, seed)
