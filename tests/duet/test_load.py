"""What an engine measures of its own load (``duet.load``): decode steps are the steps that gave
decoding sequences their next token, however many sequences (or drafts) the batch held; TPOT is
a step's time over the tokens each decoding sequence got from it; prompt speed comes from the
prompt tokens a step computed, and a token's cost from all of them."""

from __future__ import annotations

import random

from duet import LLM, SamplingParams
from duet.load import LoadTracker
from tests.conftest import TINY_VOCAB


def test_a_step_counts_as_decode_and_as_prompt_work_for_what_it_computed():
    load = LoadTracker()
    load.observe_step(num_prompt_tokens=0, num_tokens=48, num_decoding=48, num_decode_outputs=48, num_output_tokens=48, seconds=0.1)
    assert abs(load.tpot_s - 0.1) < 1e-9 and abs(load.decode_only_tpot_s - 0.1) < 1e-9
    assert load.prefill_tokens_per_s == load.tokens_per_s == 0
    # 400 prompt tokens beside 2 decoding sequences: the prompt took 0.5 s, its tokens cost 1/804 s each.
    load.observe_step(num_prompt_tokens=400, num_tokens=402, num_decoding=2, num_decode_outputs=2, num_output_tokens=2, seconds=0.5)
    assert load.prefill_tokens_per_s == 800 and load.tokens_per_s == 804
    assert abs(load.tpot_s - 0.3) < 1e-9  # both steps made the decoding sequences wait
    assert abs(load.decode_only_tpot_s - 0.1) < 1e-9  # the decode work alone
    load.observe_step(num_prompt_tokens=400, num_tokens=400, num_decoding=0, num_decode_outputs=0, num_output_tokens=1, seconds=0.25)
    assert abs(load.tpot_s - 0.3) < 1e-9 and 800 < load.prefill_tokens_per_s < 1600


def test_a_replica_computing_prompts_at_every_step_reports_what_its_decoding_gets_meanwhile():
    """No decode-only step in the window: the decode-only TPOT is that of all the steps (a
    figure from before the prompts came would let the router send more of them); idle, the last."""
    from duet.load import WINDOW_S

    now = [0.0]
    load = LoadTracker(clock=lambda: now[0])
    load.observe_step(num_prompt_tokens=0, num_tokens=4, num_decoding=4, num_decode_outputs=4, num_output_tokens=4, seconds=0.1)
    now[0] = WINDOW_S + 1.0
    load.observe_step(num_prompt_tokens=400, num_tokens=402, num_decoding=2, num_decode_outputs=2, num_output_tokens=2, seconds=0.5)
    assert abs(load.decode_only_tpot_s - 0.5) < 1e-9
    load.observe_step(num_prompt_tokens=0, num_tokens=2, num_decoding=2, num_decode_outputs=4, num_output_tokens=4, seconds=0.06)
    assert abs(load.decode_only_tpot_s - 0.03) < 1e-9  # a decode-only step again: its own figure
    now[0] += 3 * WINDOW_S
    assert abs(load.decode_only_tpot_s - 0.03) < 1e-9 and load.tpot_s == 0.0


def test_accepted_drafts_shorten_the_time_per_token():
    load = LoadTracker()
    # 4 sequences verify 4 drafts each and get 3 tokens apiece from a 0.09 s step.
    load.observe_step(num_prompt_tokens=0, num_tokens=20, num_decoding=4, num_decode_outputs=12, num_output_tokens=12, seconds=0.09)
    assert abs(load.tpot_s - 0.03) < 1e-9 and abs(load.decode_only_tpot_s - 0.03) < 1e-9


def test_an_engine_decoding_a_large_batch_reports_its_time_per_token(tiny_llama_dir):
    """48 sequences decode 48 tokens a step: still decode steps (once counted as prompt work)."""
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=1024, max_model_len=256, max_num_seqs=64)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(8)] for _ in range(48)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24))
    stats = llm.engine.stats()
    assert stats.load.tpot_s > 0 and stats.load.decode_only_tpot_s > 0
    assert stats.load.prefill_tokens_per_s > 0 and stats.load.tokens_per_s >= stats.load.prefill_tokens_per_s  # the 384 prompt tokens came in steps of their own
