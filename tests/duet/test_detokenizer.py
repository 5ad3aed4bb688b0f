"""Incremental text equals the tokenizer's decode of the kept tokens, whatever the chunking, and
stop strings cut it where the whole text would be cut (the tests' byte-level BPE tokenizer, whose
merges join the bytes of characters and split others between tokens, as SmolLM2's do)."""

from __future__ import annotations

import random
import time

import pytest
from tokenizers import Tokenizer

from duet.detokenizer import SequenceText
from duet.messages import TokenDelta
from duet.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))


def _stream(tokenizer, ids: list[int], params: SamplingParams, rng: random.Random) -> tuple[SequenceText, list[str]]:
    """``ids`` fed in random chunks, the last one finishing the sequence; the text deltas."""
    sequence, pieces, start = SequenceText.start(tokenizer, params), [], 0
    while start < len(ids) and not sequence.finished:
        end = min(len(ids), start + rng.randint(1, 4))
        delta = TokenDelta("r", ids[start:end], finished=end == len(ids), finish_reason="length" if end == len(ids) else None)
        pieces.append(sequence.add(delta).text)
        start = end
    return sequence, pieces


def _random_ids(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Ids of text with multi-byte characters, runs of ids that split them, and special tokens."""
    text = "".join(rng.choice(["héllo ", "日本語", " 🙂🦜", "\n", "abc", "Ω≈ç√", " the", "𓂀ꙮ"]) for _ in range(length))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    byte_ids = [tokenizer.token_to_id(token) for token in ("Ã", "Â", "ð", "Ł")]  # byte-level pieces of characters
    for _ in range(length // 4):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice([*byte_ids, 0, 1, 2]))
    return ids


def test_streamed_text_is_the_decode_of_the_tokens_whatever_the_chunking(tokenizer):
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4096)
    for _ in range(60):
        ids = _random_ids(tokenizer, rng, rng.randint(1, 40))
        sequence, pieces = _stream(tokenizer, ids, params, rng)
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        assert sequence.text == expected and "".join(pieces) == expected, ids


def test_a_character_cut_short_at_the_end_is_in_the_text(tokenizer):
    """Guards the tail of a sequence that ended in the middle of a character: it was held back,
    waiting for bytes that never came, and lost (with any text of the same token)."""
    ids = tokenizer.encode("Hello 🦜", add_special_tokens=False).ids
    cut = ids[:-1]  # the emoji's bytes span its last tokens
    expected = tokenizer.decode(cut)
    assert expected.startswith("Hello") and expected.endswith(REPLACEMENT)
    sequence, pieces = _stream(tokenizer, cut, SamplingParams(max_tokens=16), random.Random(0))
    assert sequence.text == "".join(pieces) == expected


def test_text_that_is_replacement_characters_streams_as_it_comes_and_costs_a_window(tokenizer):
    """Guards text lost and a router loop stalled: a model repeating a token that decodes to
    U+FFFD was held back forever (the whole pending window decoded again at each token)."""
    ids = tokenizer.encode(REPLACEMENT * 3000, add_special_tokens=False).ids
    sequence = SequenceText.start(tokenizer, SamplingParams(max_tokens=len(ids)))
    started = time.perf_counter()
    pieces = [sequence.add(TokenDelta("r", [token], finish_reason="length" if i == len(ids) - 1 else None)).text for i, token in enumerate(ids)]
    assert "".join(pieces) == sequence.text == tokenizer.decode(ids) == REPLACEMENT * 3000
    assert "".join(pieces[:100]), "nothing streamed in the first 100 tokens"
    print(f"{len(ids)} tokens in {time.perf_counter() - started:.3f} s")


def test_a_long_run_of_skipped_special_tokens_moves_the_window_past_it(tokenizer):
    ids = [0] * 500 + tokenizer.encode("Hello world", add_special_tokens=False).ids + [1] * 500
    sequence, pieces = _stream(tokenizer, ids, SamplingParams(max_tokens=2000), random.Random(2))
    assert sequence.text == "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
    assert len(sequence.detokenizer._ids) - sequence.detokenizer._prefix_offset <= 2 * 8 + 4  # the window stayed short


def test_stop_strings_cut_where_the_whole_text_would_be_cut(tokenizer):
    rng = random.Random(1)
    for _ in range(60):
        ids = _random_ids(tokenizer, rng, rng.randint(4, 40))
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        start = rng.randrange(len(whole))
        stop = whole[start : start + rng.randint(1, 6)]
        include = rng.random() < 0.5
        sequence, pieces = _stream(tokenizer, ids, SamplingParams(max_tokens=4096, stop=[stop], include_stop_str_in_output=include), rng)
        index = whole.find(stop)
        assert sequence.text == whole[: index + (len(stop) if include else 0)], (ids, stop)
        assert "".join(pieces) == sequence.text and sequence.finish_reason == "stop"


def test_a_stop_string_counts_only_where_it_ends_past_min_tokens(tokenizer):
    """As vLLM: the first ``min_tokens`` tokens' text is searched for no stop string; one that
    begins there and ends in a later token's text stops the output. Guards a stop string met
    early ending a request that asked for ``min_tokens`` (it ended at 38 of 850)."""
    ids = tokenizer.encode("ab ab cd ab cd ef", add_special_tokens=False).ids
    pieces = [tokenizer.decode(ids[: index + 1]) for index in range(len(ids))]
    whole = pieces[-1]
    for min_tokens in range(len(ids)):
        for stop in ("ab", "cd", "b c", "ef"):
            params = SamplingParams(max_tokens=64, min_tokens=min_tokens, stop=[stop])
            sequence, _ = _stream(tokenizer, ids, params, random.Random(min_tokens))
            # The first end of the stop string in text past the first min_tokens tokens' text.
            searched_from = len(pieces[min_tokens - 1]) if min_tokens else 0
            ends = [start + len(stop) for start in range(len(whole)) if whole.startswith(stop, start) and start + len(stop) > searched_from]
            if ends:
                assert (sequence.text, sequence.finish_reason) == (whole[: ends[0] - len(stop)], "stop"), (min_tokens, stop)
            else:
                assert (sequence.text, sequence.finish_reason) == (whole, "length"), (min_tokens, stop)
