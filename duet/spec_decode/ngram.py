"""Prompt-lookup drafting: propose what followed an earlier occurrence of the context's last tokens.

No draft model: text that repeats a span of its context (code edits, quotes from the prompt,
structured output) is guessed by copying, and the target verifies the guess in one forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram_tokens(
    token_ids: Sequence[int] | np.ndarray,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    num_speculative_tokens: int,
) -> list[int]:
    """Up to ``num_speculative_tokens`` tokens that followed an earlier occurrence of the last n tokens.

    ``token_ids`` is the request's prompt plus output; an ndarray (a view of a per-request buffer)
    skips the list conversion, which dominates for long contexts. n is the largest length in
    [prompt_lookup_min, prompt_lookup_max] whose tail occurs earlier, and of its occurrences the
    most recent wins. An occurrence may overlap the tail; fewer tokens are proposed when it ends
    near the end of the context. Returns [] when no tail of at least prompt_lookup_min tokens recurs.
    """
    if not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise ValueError(
            f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min} and {prompt_lookup_max}"
        )
    tokens = np.asarray(token_ids)
    if num_speculative_tokens <= 0 or tokens.size < 2:
        return []
    match_ends, match_lengths = _tail_matches(tokens, prompt_lookup_max)
    if match_ends.size == 0 or match_lengths.max() < prompt_lookup_min:
        return []
    end = match_ends[match_lengths == match_lengths.max()][-1]
    return tokens[end + 1 : end + 1 + num_speculative_tokens].tolist()


def _tail_matches(tokens: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Earlier positions holding the last token, ascending, and how many tail tokens end there (capped)."""
    # Every occurrence of the tail ends at an earlier copy of the last token: one O(n) scan.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    lengths = np.ones(ends.size, dtype=np.int64)
    still_matching = np.ones(ends.size, dtype=bool)
    # An occurrence ends before the last token, so it is at most len(tokens) - 1 long.
    for back in range(1, min(max_length, tokens.size - 1)):
        still_matching &= ends >= back
        still_matching[still_matching] = tokens[ends[still_matching] - back] == tokens[-1 - back]
        if not still_matching.any():
            break
        lengths += still_matching
    return ends, lengths
