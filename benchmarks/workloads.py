"""The serving benchmark's workloads, as sessions of (prompt token ids, output tokens) turns: a
session's turns are sent one after another, each when the one before it ended; sessions arrive
as a Poisson process.

- ``random``: one turn of random tokens (``input_len``), ``output_len`` out.
- ``shared-prefix``: the same, the first ``shared_prefix`` tokens common to every request.
- ``sharegpt``: the first turn of ShareGPT conversations (vLLM's benchmark set), rendered by the
  model's chat template, output as long as the recorded reply (capped).
- ``multiturn``: ShareGPT conversations replayed as sessions of up to ``turns`` turns, each
  sending the whole history (the recorded replies as the assistant's turns) and the next message.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SAFE_TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary of SmolLM2's tokenizer, no special tokens
WORKLOADS = ("random", "shared-prefix", "sharegpt", "multiturn")


@dataclass(frozen=True)
class TurnSpec:
    prompt: list[int]
    output_len: int


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
            turns.append(TurnSpec(prompt, output_len))
            history.append({"role": "assistant", "content": turn.reply})
        if turns:
            chosen.append(turns)
        if len(chosen) == num:
            break
    return chosen
