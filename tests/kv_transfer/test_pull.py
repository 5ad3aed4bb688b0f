"""A pull: the replica that holds a conversation's history in its prefix cache sends only that
KV (``EngineRequest.kv_receive_tokens``: the prompt's leading tokens), and the receiving
engine computes the turn's new tokens itself, samples the first token and decodes. Tokens equal
transformers' on the whole prompt; the holder computes at most the one token past its cache."""

from __future__ import annotations

import contextlib
import time

import pytest

from duet import SamplingParams
from duet.engine_process import EngineProcess
from duet.errors import InvalidRequestError
from duet.messages import EngineRequest
from tests.conftest import make_tiny_model
from tests.kv_transfer.test_pd_tiny import _decode, _engine_kwargs, _prompt_kv_bytes
from tests.reference import compare_to_reference, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
FILL = SamplingParams(temperature=0.0, max_tokens=1)
HISTORY = list(range(300, 340))  # 40 tokens: two full blocks of 16 and a partial one
PROMPT = HISTORY + list(range(500, 537))  # the next turn: 77 tokens
PULLED = 33  # the history's two full blocks, and the one token the holder computes past them

# An engine in a process of its own, KV over gloo: seconds a test.
pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _holding(model_dir, name: str, history: list[int]):
    """An engine in a process of its own that computed ``history`` (a turn it decoded): its
    prefix cache holds it."""
    process = EngineProcess(_engine_kwargs(model_dir, name))
    try:
        process.add_request(EngineRequest("history", history, SamplingParams(temperature=0.0, max_tokens=2)))
        _drain(process, "history")
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def holder(tiny_llama_dir):
    with _holding(tiny_llama_dir, "holder-0", HISTORY) as process:
        yield process


def _drain(process: EngineProcess, request_id: str, timeout_s: float = 60):
    deltas, deadline = [], time.monotonic() + timeout_s
    while not (deltas and deltas[-1].finished):
        assert time.monotonic() < deadline, f"{request_id} unfinished"
        delta = process.receive()
        if delta is None:
            time.sleep(0.002)
        elif delta.request_id == request_id:
            assert delta.error is None, delta.error
            deltas.append(delta)
    return deltas


def _pull(
    holder: EngineProcess, decode, request_id: str, params: SamplingParams, prompt=PROMPT, pulled=PULLED, own_prompt_len=None,
    timeout_s: float = 60,
):
    """The router's pull: the receiver reserves the whole prompt's blocks, the holder computes
    the prompt's first ``pulled`` tokens (its cache hit, and one more) and sends their KV. The
    holder's answer, and every token the receiver gives."""
    request = EngineRequest(request_id, prompt, params, kv_receive=True, kv_receive_tokens=pulled)
    destination = decode.add_request(request)
    holder.add_request(EngineRequest(request_id, prompt[:pulled], FILL, kv_send=destination, own_prompt_len=own_prompt_len))
    sent = _drain(holder, request_id)
    tokens, deadline = [], time.monotonic() + timeout_s
    while decode.has_unfinished_requests():
        assert time.monotonic() < deadline, "the receiver did not finish"
        deltas = decode.step()
        for delta in deltas:
            assert delta.error is None and not delta.kv_lost, delta.error
            assert delta.num_cached_tokens == pulled  # the usage the router reports: not computed for it
            tokens += delta.token_ids
        if not deltas:
            time.sleep(0.002)  # waiting for the KV: leave the transfer threads the CPU
    return sent, tokens


@pytest.mark.parametrize("speculation", [None, "ngram"])
def test_a_pulled_history_is_finished_on_the_receiver_as_transformers_computes_the_prompt(holder, tiny_llama_dir, speculation):
    config = None if speculation is None else {"method": speculation, "num_speculative_tokens": 3, "adaptive": False}
    decode = _decode(tiny_llama_dir, f"pull-{speculation}", speculative_config=config)
    sent, tokens = _pull(holder, decode, f"turn-{speculation}", GREEDY)
    assert sent[0].num_cached_tokens == PULLED - 1  # the holder computed one token past its history
    reference = hf_greedy(tiny_llama_dir, [PROMPT], 12)[0]
    assert compare_to_reference(tokens, reference, "pulled turn") is None
    assert decode.stats().transfer.bytes == _prompt_kv_bytes(decode, PULLED)  # three blocks, not five
    # The pulled blocks and the ones computed here are this engine's prefix cache now.
    decode.add_request(EngineRequest("again", PROMPT, GREEDY))
    again = []
    while decode.has_unfinished_requests():
        for delta in decode.step():
            again.append(delta)
    assert again[0].num_cached_tokens == 64 and [t for d in again for t in d.token_ids] == tokens
    decode.check_integrity()
    decode.close()


def test_a_pull_that_ends_on_its_first_token_ends_there(holder, tiny_llama_dir):
    """The receiver samples the first token: one that ends the sequence ends it, blocks back."""
    decode = _decode(tiny_llama_dir, "pull-one")
    _, tokens = _pull(holder, decode, "one", SamplingParams(temperature=0.0, max_tokens=1))
    assert tokens == hf_greedy(tiny_llama_dir, [PROMPT], 1)[0].token_ids
    assert decode.kv_cache_manager.num_free_blocks == 128
    decode.check_integrity()
    decode.close()


def test_a_windowed_pull_ships_only_the_blocks_the_receiver_reads(tmp_path_factory, tiny_tokenizer_dir):
    """Window 20, blocks of 16: of a 65-token pull, the receiver's queries from position 65 on
    read keys 46 on, so blocks 2-4 travel (not 0-4), and the tokens are transformers'."""
    mistral = make_tiny_model(tmp_path_factory.mktemp("mistral"), tiny_tokenizer_dir, "mistral-windowed")
    history, prompt = list(range(100, 170)), list(range(100, 170)) + list(range(600, 637))
    with _holding(mistral, "holder-window", history) as holder:
        decode = _decode(mistral, "pull-window")
        sent, tokens = _pull(holder, decode, "turn", GREEDY, prompt, 65)
        assert sent[0].num_cached_tokens == 64
        assert compare_to_reference(tokens, hf_greedy(mistral, [prompt], 12)[0], "windowed pull") is None
        assert decode.stats().transfer.bytes * 5 == _prompt_kv_bytes(decode, 65) * 3
        decode.check_integrity()
        decode.close()


def test_a_pull_past_a_length_dependent_rope_switch_is_computed_with_the_whole_prompts_rope(tmp_path_factory, tiny_tokenizer_dir):
    """Phi-3's longrope rotates a prompt longer than ``original_max_position_embeddings`` (20
    here) by its long frequencies: a 16-token history the holder computed short, pulled for a
    40-token turn, is computed there again with the turn's RoPE (``own_prompt_len``, as the
    router sends it), not sent as it is cached; the tokens are transformers'."""
    phi3 = make_tiny_model(tmp_path_factory.mktemp("phi3"), tiny_tokenizer_dir, "phi3-longrope")
    history, prompt = list(range(100, 116)), list(range(100, 116)) + list(range(600, 624))
    with _holding(phi3, "holder-longrope", history) as holder:
        decode = _decode(phi3, "pull-longrope")
        sent, tokens = _pull(holder, decode, "turn", GREEDY, prompt, 17, own_prompt_len=len(prompt))
        assert sent[0].num_cached_tokens == 0  # the short history's KV is not the turn's
        assert compare_to_reference(tokens, hf_greedy(phi3, [prompt], 12)[0], "pull past longrope's switch") is None
        decode.check_integrity()
        decode.close()


def test_a_pull_reserves_the_slots_of_the_tokens_it_computes_here(tiny_llama_dir):
    """A request waiting for its KV cannot be preempted, so a pull reserves every slot its first
    step computes: 77 tokens' blocks, not the 33 pulled and one; a second such pull finds no
    room in 8 blocks and is refused, rather than two waiting on blocks neither gives back."""
    from duet.errors import ReplicaFullError

    decode = _decode(tiny_llama_dir, "pull-room", num_kv_blocks=8)
    decode.add_request(EngineRequest("a", PROMPT, GREEDY, kv_receive=True, kv_receive_tokens=PULLED))
    assert decode.kv_cache_manager.num_free_blocks == 8 - 5
    with pytest.raises(ReplicaFullError):
        decode.add_request(EngineRequest("b", PROMPT, GREEDY, kv_receive=True, kv_receive_tokens=PULLED))
    decode.abort_request("a")
    decode.step()
    assert decode.kv_cache_manager.num_free_blocks == 8 and not decode.has_unfinished_requests()
    decode.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(kv_receive_tokens=len(PROMPT)), "from 1 to 76"),
        (dict(kv_receive_tokens=0), "from 1 to 76"),
        (dict(kv_receive_tokens=16, output_token_ids=[5]), "new sequence"),
        (dict(kv_receive_tokens=16, kv_receive=False), "new sequence"),
        (dict(kv_receive_tokens=16, params=SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)), "no prompt logprobs"),
    ],
)
def test_a_pull_the_receiver_cannot_finish_is_refused_and_holds_nothing(tiny_llama_dir, overrides, message):
    decode = _decode(tiny_llama_dir, "pull-refused")
    with pytest.raises(InvalidRequestError, match=message):
        decode.add_request(EngineRequest("bad", PROMPT, **({"params": GREEDY, "kv_receive": True} | overrides)))
    assert decode.kv_cache_manager.num_free_blocks == 128 and not decode.has_unfinished_requests()
    decode.close()
