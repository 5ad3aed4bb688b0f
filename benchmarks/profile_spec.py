"""Speculative decoding's effect on a pool's decoding, for ``duet profile``: the figures a
simulated sequence's drafts follow in ``duet simulate``, and the planner's arithmetic.

``duet profile``'s decode samples are steps without drafts (one token a sequence), fitted as
``a + b B + c B C``. A pool with a ``speculative_config`` decodes otherwise: steps verify drafts
and, where they are accepted, give a sequence several tokens. So the pool's engine, as the
config runs it, decodes ``SEQUENCES`` of ``duet bench serve``'s random prompts (``PROMPT``
tokens from its vocabulary range) for ``OUTPUT`` tokens each, in waves of a batch, every step
timed. The time its decode steps took at ``BATCH`` sequences, over what the fit gives for
``OUTPUT`` steps of the same batch and contexts, is the pool's ``decode_factor``: under one
where drafts pay. The simulation and the planner take the two figures behind it (``drafts``):
the tokens a sequence gets from a decode step (``tokens_per_step``: its decoded tokens over the
decode steps), and what a row verifying its drafts costs over a row without (``verify_factor``:
the steps' time less their fixed cost, over the rows' part of as many plain steps; 1 at least).
Both depend on the batch: an adaptive engine drafts as many tokens as pay, and a step's fixed
cost is most of a small batch's (on a 2-core EPYC Zen 4, SmolLM2's n-gram drafts gave a lone
sequence 2.3-2.6 tokens a step and 8 sequences 1.8-2.2). So they are measured at each of
``BATCHES`` (``by_batch``), the figures at ``BATCH`` beside them. They hold for this workload's
kind of text (greedy continuations of random prompts repeat, so n-gram drafts pass often);
other text drafts otherwise.
"""

from __future__ import annotations

import random

BATCH = 8
BATCHES = (1, 2, 4, BATCH)
SEQUENCES = BATCH  # at each batch: decoded in waves of the batch
PROMPT = 256
OUTPUT = 64


def measure(llm, fit: dict[str, float], seed: int) -> dict | None:
    """The pool's decode factor at ``BATCH``, with what it came from, and the figures at each of
    ``BATCHES`` (``by_batch``: ``[batch, tokens_per_step, verify_factor]``); None for a pool
    that drafts nothing."""
    engine = llm.engine
    if not engine.speculative_config:
        return None
    by_batch = {batch: _measure_batch(engine, fit, batch, seed + batch) for batch in BATCHES}
    found = by_batch[BATCH]
    return found | {"by_batch": [[batch, figures["tokens_per_step"], figures["verify_factor"]] for batch, figures in by_batch.items()]}


def _measure_batch(engine, fit: dict[str, float], batch: int, seed: int) -> dict:
    """``SEQUENCES`` random prompts decoded ``batch`` at a time (one measurement of a lone
    sequence's drafts swings by half with its text)."""
    from duet import SamplingParams
    from duet.benchmarks.profile import timed_steps
    from duet.benchmarks.sim_model import decode_seconds
    from duet.benchmarks.workloads import SAFE_TOKEN_RANGE
    from duet.messages import EngineRequest

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size  # a small model's: the range's part within it
    low, high = min(SAFE_TOKEN_RANGE[0], vocab // 2), min(SAFE_TOKEN_RANGE[1], vocab)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, min_tokens=OUTPUT, ignore_eos=True)
    waves = max(1, SEQUENCES // batch)
    before = engine.scheduler.spec_stats.stats()
    steps = []
    for wave in range(waves):
        for index in range(batch):
            prompt = [rng.randrange(low, high) for _ in range(PROMPT)]
            engine.add_request(EngineRequest(f"speculation-{batch}-{wave}-{index}", prompt, params))
        steps += timed_steps(engine, lambda: not engine.has_unfinished_requests())
    after = engine.scheduler.spec_stats.stats()
    # a decode step schedules no prompt: every sequence in it has its prompt computed
    decode = [seconds for seconds, output in steps if output.num_scheduled_tokens and _decoding_only(output)]
    plain = waves * sum(decode_seconds(fit, batch, batch * (PROMPT + i)) for i in range(1, OUTPUT))
    drafted = after.num_draft_tokens - before.num_draft_tokens
    found = {
        "decode_factor": sum(decode) / plain if plain > 0 else 1.0,
        "decode_steps": len(decode), "decode_s": sum(decode), "plain_s": plain, "tokens": waves * (OUTPUT - 1),
        "acceptance": (after.num_accepted_tokens - before.num_accepted_tokens) / drafted if drafted else 0.0,
    }
    return found | drafts(found, fit)


def drafts(found: dict, fit: dict[str, float]) -> dict[str, float]:
    """``tokens_per_step`` and ``verify_factor`` from a measurement's decode steps (``OUTPUT`` - 1
    tokens a sequence of each wave, its first from its prompt step): the rows' part of the drafted steps is
    their time less a fixed cost each, and that of as many plain steps the plain steps' rows'
    part in proportion."""
    tokens = found.get("tokens", OUTPUT - 1)  # a sequence's, over the waves measured
    steps = found["decode_steps"]
    if not steps:
        return {"tokens_per_step": 1.0, "verify_factor": 1.0}
    rows_plain = (found["plain_s"] - tokens * fit["base_s"]) * steps / tokens
    verify = (found["decode_s"] - steps * fit["base_s"]) / rows_plain if rows_plain > 0 else 1.0
    return {"tokens_per_step": tokens / steps, "verify_factor": max(1.0, verify)}


def _decoding_only(output) -> bool:
    """Whether a step computed no prompt: each sequence scheduled had its prompt computed
    (its first token is sampled after the prompt's last chunk, so a step of the prompt's last
    chunk counts as prompt work)."""
    for request_id, num_tokens in output.num_scheduled_tokens.items():
        if num_tokens > 1 + len(output.scheduled_spec_token_ids.get(request_id, ())):
            return False
    return True
