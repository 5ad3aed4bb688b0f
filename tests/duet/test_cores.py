"""Engines sharing one machine's cores step by step (``duet.cores``): a decoder with time to
spare yields to prompts, which take every core; one without keeps its share and the prompt takes
the rest in short chunks; alone, either takes every core; a dead engine's state goes with it;
and greedy output is the same whatever the shares and chunks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from duet import LLM, SamplingParams
from duet.cores import MAX_SLACK_S, MIN_CHUNK_TOKENS, MIN_PAUSE_S, SPLIT_CHUNK_S, YIELD_WAIT_S, CoreShare, EngineState, StepPlan
from tests.reference import compare_to_reference, hf_greedy


@pytest.fixture
def shares(tmp_path):
    made: list[CoreShare] = []

    def make(decode: bool, tpot_budget_s: float = 0.1, cores: int = 4) -> CoreShare:
        share = CoreShare(decode, tpot_budget_s, directory=tmp_path)
        share.cores = cores
        made.append(share)
        return share

    yield make
    for share in made:
        share.close()


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _age(share: CoreShare, seconds: float) -> None:
    """Move every stream the decoder knows ``seconds`` into the past."""
    share._streams = {key: (since - seconds, tokens) for key, (since, tokens) in share._streams.items()}


def test_alone_an_engine_steps_on_every_core(shares):
    decode, prompts = shares(True), shares(False)
    assert decode.before_step([("a", 1)]) == StepPlan(4, None)
    decode.idle()
    assert prompts.before_step() == StepPlan(4, None)  # no decoder with streams: no bound either
    prompts.idle()
    assert not prompts.state.wanting and decode.before_step([("a", 2)]) == StepPlan(4, None)


def test_an_engine_wants_the_cores_while_it_has_something_to_compute(shares):
    decode, prompts = shares(True), shares(False)
    prompts.before_step()
    assert decode.before_step([("a", 1)]) is None  # it yields to the prompts
    assert prompts.before_step(requests=0) == StepPlan(prompts.last_threads, None)  # only sends left
    assert not prompts.state.wanting and decode.before_step([("a", 1)]) == StepPlan(4, None)
    assert decode.before_step([], requests=1) == StepPlan(4, None)  # a prompt of its own, no stream
    assert decode.state.wanting and prompts.before_step().threads == 3  # beside it, what it leaves
    assert prompts.waited_s < YIELD_WAIT_S  # at once: a decoder without streams does not yield


def test_a_decoder_with_time_to_spare_yields_and_the_prompt_takes_every_core_within_its_slack(shares):
    decode, prompts = shares(True, tpot_budget_s=0.1), shares(False)
    assert decode.before_step([("a", 1), ("b", 5)]) == StepPlan(4, None)  # nothing wants the cores yet
    prompts.prompt_tokens_per_s[4] = 2000.0
    prompts.state.wanting = True
    prompts._publish()
    assert decode.before_step([("a", 3), ("b", 5)]) is None  # b's slack: a token's budget, less the time since
    assert decode.state.yielding
    slack = decode.state.slack_s
    assert MIN_PAUSE_S <= slack <= 0.1
    plan = prompts.before_step()
    assert plan.threads == 4 and plan.token_budget == max(MIN_CHUNK_TOKENS, int(slack * 2000.0))
    _age(decode, 0.1 - MIN_PAUSE_S / 2)  # b has spent its budget: the decoder steps again, on its share
    assert decode.before_step([("a", 3), ("b", 5)]) == StepPlan(1, None)
    assert not decode.state.yielding and decode.waited_s > 0


def test_beside_a_decoder_without_slack_the_prompt_takes_what_it_leaves_in_short_chunks(shares):
    decode, prompts = shares(True, tpot_budget_s=0.1), shares(False)
    decode.before_step([("a", 1)])
    _age(decode, 0.5)  # half a second for one token: far behind its budget
    prompts.state.wanting = True
    prompts._publish()
    assert decode.before_step([("a", 1)]) == StepPlan(1, None) and decode.state.slack_s == 0.0
    prompts.prompt_tokens_per_s[3] = 600.0
    assert prompts.before_step() == StepPlan(3, int(SPLIT_CHUNK_S * 600.0))  # it did not wait for a yield
    assert prompts.waited_s < YIELD_WAIT_S


def test_beside_a_backlog_of_prompts_the_cores_stay_split(shares):
    """Turns at every core cost more than a core each (the other engines' threads slow a team of
    several): a decoder with slack yields to a lone prompt, not to a queue of them."""
    decode, prompts = shares(True), shares(False)
    decode.before_step([("a", 1)])
    assert prompts.before_step(requests=3) == StepPlan(3, None) and prompts.waited_s < YIELD_WAIT_S
    assert prompts.state.backlog and decode.before_step([("a", 1)]) == StepPlan(1, None)
    prompts.before_step(requests=1)
    assert decode.before_step([("a", 1)]) is None


def test_a_prompt_waits_for_a_decoder_that_will_yield_then_takes_every_core(shares):
    decode, prompts = shares(True), shares(False)
    decode.before_step([("a", 1)])  # stepping, with slack: it yields at its next step
    assert not decode.state.yielding and decode.state.slack_s >= MIN_PAUSE_S
    plan = prompts.before_step()  # the decoder never comes back here: the wait is bounded
    assert plan.threads == 3 and prompts.waited_s >= YIELD_WAIT_S


def test_slack_is_each_streams_budget_for_its_tokens_less_its_time_capped(shares):
    decode = shares(True, tpot_budget_s=0.1)
    decode.before_step([("a", 10)])
    _age(decode, 0.25)
    decode.before_step([("a", 14)])  # five tokens' budget (0.5 s) in 0.25 s
    assert decode.state.slack_s == pytest.approx(0.25, abs=0.01)
    decode.before_step([("a", 100)])
    assert decode.state.slack_s == MAX_SLACK_S
    decode.before_step([("b", 3)])  # a is done: forgotten; b is new, with one token's budget
    assert set(decode._streams) == {"b"} and decode.state.slack_s == pytest.approx(0.1, abs=0.01)


def test_a_decoders_need_is_the_threads_its_steps_take_within_the_budget(shares):
    decode = shares(True, tpot_budget_s=0.05, cores=8)
    assert decode._need() == 1  # nothing measured
    decode._after(4, 4, 0.03)  # 0.12 thread-seconds a step, at one token a step
    assert decode._need() == 3
    for _ in range(60):
        decode.observe_decode(2, 8)  # four tokens a step: four tokens' budget a step
    assert decode._need() == 1
    decode._after(4, 8, 1.0)
    assert decode._need() == 7  # never every core


def test_a_dead_engines_state_goes_with_it(tmp_path):
    script = (
        "import sys; from pathlib import Path; from duet.cores import CoreShare; "
        "share = CoreShare(True, 0.1, directory=Path(sys.argv[1])); share.before_step([('a', 1)]); import os; os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, cwd=os.getcwd(), timeout=60)
    (tmp_path / "notes.state").write_bytes(b"not an engine's")  # a stray file is no engine
    share = CoreShare(False, 0.1, directory=tmp_path)
    try:
        assert share.peers() == [] and sorted(path.name for path in tmp_path.glob("*.state")) == sorted([share._name, "notes.state"])
        assert share.before_step() == StepPlan(share.cores, None)
    finally:
        share.close()
    assert [path.name for path in tmp_path.glob("*.state")] == ["notes.state"]


def test_state_round_trips():
    state = EngineState(True, wanting=True, backlog=True, yielding=True, need=2, steps=7, slack_s=0.07)
    assert EngineState.unpack(state.pack()) == state


def test_greedy_output_is_the_same_in_the_least_chunks_on_every_core(tiny_llama_dir, tmp_path, keep_threads):
    """A prompt engine beside a decoder that yields with no slack left computes in the least
    chunks, on every core: the chunks and threads change, the tokens do not."""
    prompts = [list(range(100, 300)), [7] * 90]
    references = hf_greedy(tiny_llama_dir, prompts, 8)
    decoder = CoreShare(True, tpot_budget_s=0.1, directory=tmp_path)
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=256)
    share = llm.engine.core_share = CoreShare(False, tpot_budget_s=0.1, directory=tmp_path)
    try:
        decoder.state.wanting, decoder.state.yielding, decoder.state.slack_s = True, True, 0.0
        decoder._publish()
        share.prompt_tokens_per_s[share.cores] = 1.0
        budgets = []
        schedule = llm.engine.scheduler.schedule

        def recorded(token_budget=None):
            output = schedule(token_budget)
            budgets.append((token_budget, output.total_num_scheduled_tokens))
            return output

        llm.engine.scheduler.schedule = recorded
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8))
        for index, (output, reference) in enumerate(zip(outputs, references)):
            assert compare_to_reference(output.outputs[0].token_ids, reference, f"prompt {index}") is None
        assert budgets and all(budget == MIN_CHUNK_TOKENS and tokens <= MIN_CHUNK_TOKENS for budget, tokens in budgets)
        assert share.state.steps == len([1 for _, tokens in budgets if tokens]) and share.last_threads == share.cores
        llm.engine.check_integrity()
    finally:
        decoder.close()
        llm.engine.close()


def test_greedy_output_is_the_same_for_a_decoder_that_yields_to_prompts(tiny_llama_dir, tmp_path, keep_threads):
    """A decoder beside a prompt engine that always wants the cores skips steps while its streams
    have time to spare, then steps on its share: its tokens are the same."""
    prompts = [list(range(40, 90)), [9] * 30]
    references = hf_greedy(tiny_llama_dir, prompts, 6)
    prompt_engine = CoreShare(False, tpot_budget_s=0.05, directory=tmp_path)
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=128, max_model_len=512)
    share = llm.engine.core_share = CoreShare(True, tpot_budget_s=0.05, directory=tmp_path)
    try:
        prompt_engine.state.wanting = True
        prompt_engine._publish()
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))
        for index, (output, reference) in enumerate(zip(outputs, references)):
            assert compare_to_reference(output.outputs[0].token_ids, reference, f"prompt {index}") is None
        assert share.waited_s > 0  # it yielded
        llm.engine.check_integrity()
    finally:
        prompt_engine.close()
        llm.engine.close()
