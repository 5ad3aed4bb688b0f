"""Engines sharing one machine's cores in turns (``duet.cores``): one step at a time holds the
cores, a waiting decoder steps before the next prompt chunk, prompt chunks shrink to the
decoders' gap, a dead engine's claim goes with it, and greedy output is the same in turns."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from duet import LLM, SamplingParams
from duet.cores import MIN_CHUNK_TOKENS, CoreLease, EngineState
from tests.reference import compare_to_reference, hf_greedy


@pytest.fixture
def leases(tmp_path):
    made: list[CoreLease] = []

    def make(decode: bool, tpot_budget_s: float = 0.1) -> CoreLease:
        lease = CoreLease(decode, tpot_budget_s, directory=tmp_path)
        made.append(lease)
        return lease

    yield make
    for lease in made:
        lease.close()


def test_one_step_at_a_time_holds_the_cores(leases):
    decode, prefill = leases(True), leases(False)
    order: list[str] = []
    with prefill.hold(64):
        waiter = threading.Thread(target=lambda: _step(decode, order, "decode"))
        waiter.start()
        time.sleep(0.1)
        assert [peer.wanting for peer in prefill.peers()] == [True]  # the decoder waits for the lease
        order.append("prefill")
    waiter.join(5)
    assert order == ["prefill", "decode"]
    assert decode.state.steps == 1 and not decode.state.wanting and decode.state.busy


def test_a_waiting_decoder_steps_before_the_next_prompt_chunk(leases):
    """Guards decode's priority: released and asked for again at once, the lease went back to the
    prompt side while the decoder slept on it."""
    decode, prefill = leases(True), leases(False)
    order: list[str] = []
    prefill_holds = threading.Event()

    def decoder():
        prefill_holds.wait(5)
        _step(decode, order, "decode")

    thread = threading.Thread(target=decoder)
    thread.start()
    with prefill.hold(64):
        prefill_holds.set()
        time.sleep(0.1)
        order.append("prefill 1")
    prefill.token_budget()  # waits for the decoder's step
    with prefill.hold(64):
        order.append("prefill 2")
    thread.join(5)
    assert order == ["prefill 1", "decode", "prefill 2"]


def test_prompt_chunks_fit_the_busy_decoders_gap_at_the_speed_measured_in_turns(leases):
    decode, prefill = leases(True, tpot_budget_s=0.12), leases(False)
    with decode.hold(8):
        time.sleep(0.02)
    assert decode.state.busy and 0.0 < decode.state.gap_s <= 0.1
    assert prefill.token_budget() is None  # no prompt speed measured yet: the whole step budget
    prefill._after(500, 0.5)  # 1000 tokens a second in its turn
    prefill._after(10, 1.0)  # too few tokens to say
    assert prefill.prompt_tokens_per_s == 1000.0
    budget = prefill.token_budget()
    assert budget == max(MIN_CHUNK_TOKENS, int(decode.state.gap_s * 1000.0))
    decode.state.step_s = 0.2
    decode._after(8, 0.2)  # steps past the budget leave no gap: the least chunk still advances prompts
    assert decode.state.gap_s == 0.0
    assert prefill.token_budget() == MIN_CHUNK_TOKENS
    for _ in range(40):  # three tokens a step (drafts accepted): three tokens' time between steps
        decode.observe_decode(4, 12)
    decode._after(8, 0.2)
    assert decode.state.gap_s == pytest.approx(0.12 * 3 - 0.2, abs=0.01)
    decode.idle()
    assert prefill.token_budget() is None  # no decoder busy: the whole step budget
    assert leases(True).token_budget() is None  # a decoder's own steps are never bounded


def test_a_dead_engines_state_and_lock_go_with_it(tmp_path):
    script = (
        "import sys; from pathlib import Path; from duet.cores import CoreLease; "
        "lease = CoreLease(True, 0.1, directory=Path(sys.argv[1])); lease.state.wanting = True; lease._publish(); "
        "import fcntl; fcntl.flock(lease._lock_fd, fcntl.LOCK_EX); import os; os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, cwd=os.getcwd(), timeout=60)
    (tmp_path / "notes.state").write_bytes(b"not an engine's")  # a stray file is no engine
    lease = CoreLease(False, 0.1, directory=tmp_path)
    try:
        assert lease.peers() == [] and sorted(path.name for path in tmp_path.glob("*.state")) == sorted([lease._name, "notes.state"])
        assert lease.token_budget() is None
        with lease.hold(64):  # its lock went with it
            pass
    finally:
        lease.close()
    assert [path.name for path in tmp_path.glob("*.state")] == ["notes.state"]


def test_state_round_trips():
    state = EngineState(True, wanting=True, busy=False, steps=7, step_s=0.03, gap_s=0.07)
    assert EngineState.unpack(state.pack()) == state


def test_greedy_output_is_the_same_in_turns_with_chunks_cut_to_a_decoders_gap(tiny_llama_dir, tmp_path):
    """A prefill engine next to a busy decoder computes its prompts in chunks of the decoder's gap
    at its measured speed: the chunks change, the tokens do not."""
    prompts = [list(range(100, 300)), [7] * 90]
    references = hf_greedy(tiny_llama_dir, prompts, 8)
    decoder = CoreLease(True, tpot_budget_s=0.1, directory=tmp_path)
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=256)
    lease = llm.engine.core_lease = CoreLease(False, tpot_budget_s=0.1, directory=tmp_path)
    try:
        decoder.state.busy, decoder.state.gap_s = True, 0.0  # the least chunk
        decoder._publish()
        lease.prompt_tokens_per_s = 1000.0
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
        assert lease.state.steps == len([1 for _, tokens in budgets if tokens])
        llm.engine.check_integrity()
    finally:
        decoder.close()
        llm.engine.close()


def _step(lease: CoreLease, order: list[str], name: str) -> None:
    with lease.hold(64):
        order.append(name)
