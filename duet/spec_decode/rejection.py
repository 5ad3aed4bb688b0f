"""Speculative sampling: keep the draft tokens the target agrees with, then add one token of its own.

Exact in distribution (Leviathan et al. 2023, Chen et al. 2023): draft token x at position i is
kept with probability min(1, p_i(x) / q_i(x)); at the first rejection the replacement comes from
the residual max(0, p_i - q_i), renormalized; if every draft is kept, a bonus token comes from
p_k. The emitted tokens are then distributed exactly as tokens sampled from p one at a time.
Greedy requests keep drafts equal to argmax p_i and end with the argmax of the first row that
differs, so their output is the non-speculative greedy output token for token.

A seeded random request does the same with its own samples: position by position it samples p_i
by one vocabulary-sized race from its generator, exactly as it would without speculation, keeps
the draft while it equals that sample, and ends with the first sample that differs (or the
bonus). Its tokens are then the ones it samples unspeculated, whatever the drafts, and its
generator has made one race per emitted token: a request resumed elsewhere (after preemption or a
move between replicas) continues its stream by advancing a fresh generator one race per token it
has. A one-hot draft is then kept with probability p_i(x), as the rule above keeps it; a sampled
draft agrees often when it was drawn with the same races (``ModelProposer`` does so).

Rows are flattened across the batch, in batch order, as the runner produces them: request r owns
k_r draft rows and k_r + 1 target rows (the last one for the bonus token).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from duet.sampler import exponential_race


@dataclass
class RejectionOutput:
    """Per request: the accepted draft tokens followed by one token from the target (1 to k+1 ids)."""

    sampled_token_ids: list[list[int]]
    # Per request: how many draft tokens were kept (the emitted count minus one).
    num_accepted_tokens: list[int]


@dataclass
class _Batch:
    """Per-request facts of one call: lists for the Python loops, tensors for the batched ops."""

    num_drafts: list[int]
    draft_start: list[int]
    greedy: list[bool]
    num_drafts_tensor: torch.Tensor  # [batch]
    draft_start_rows: torch.Tensor  # [batch] first draft row of each request
    target_start_rows: torch.Tensor  # [batch] first target row of each request
    request_of_draft: torch.Tensor  # [sum k] the request that owns each draft row
    is_greedy: torch.Tensor  # [batch] bool
    races_here: torch.Tensor  # [batch] bool: random and unseeded (a seeded request samples its own last token)


def one_hot_draft_probs(
    draft_token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[sum k, vocab_size] draft rows for deterministic proposals (n-gram): all mass on the proposed token."""
    flat = [token_id for ids in draft_token_ids for token_id in ids]
    probs = torch.zeros(len(flat), vocab_size, device=device)
    rows = torch.arange(len(flat), device=device)
    probs[rows, torch.tensor(flat, dtype=torch.int64, device=device)] = 1.0
    return probs


def rejection_sample(
    draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    greedy: list[bool],
    generators: list[torch.Generator | None],
) -> RejectionOutput:
    """Verify each request's draft tokens against the target and emit 1 to k+1 tokens per request.

    ``draft_probs`` is [sum k_r, vocab] and ``target_probs`` [sum (k_r + 1), vocab]: probabilities
    after each request's temperature and filters. A request may have no drafts: it then samples p_0.
    Greedy requests use only the argmax of their target rows (so the caller may pass raw logits
    there, avoiding ties that softmax rounding creates) and ignore their draft rows; when every
    request is greedy ``draft_probs`` may be None.
    ``generators[r]`` is request r's own stream (None: the global one); a random request with one
    draws a vocabulary-sized race from it per emitted token, whatever else shares the batch.
    """
    _check_shapes(draft_token_ids, draft_probs, target_probs, greedy, generators)
    device = target_probs.device
    seeded = [generator is not None and not is_greedy for generator, is_greedy in zip(generators, greedy)]
    # The seeded requests' drafts go through the batched test too (its result is replaced below);
    # their last token is drawn only by _own_samples, from their own generators.
    batch = _batch(draft_token_ids, greedy, seeded, device)
    drafts = torch.tensor([t for ids in draft_token_ids for t in ids], dtype=torch.int64, device=device)
    target_argmax = target_probs.argmax(dim=-1) if any(greedy) else None
    accepted = _accept(drafts, draft_probs, target_probs, target_argmax, batch)
    num_accepted = _count_leading(accepted, batch)
    final = _final_tokens(num_accepted, draft_probs, target_probs, target_argmax, batch)
    num_accepted_tokens, final_ids = num_accepted.tolist(), final.tolist()
    for request in (r for r, own in enumerate(seeded) if own):
        start = batch.draft_start[request] + request
        rows = target_probs[start : start + batch.num_drafts[request] + 1]
        num_accepted_tokens[request], final_ids[request] = _own_samples(
            draft_token_ids[request], rows, generators[request]
        )
    sampled = [ids[:count] + [token_id] for ids, count, token_id in zip(draft_token_ids, num_accepted_tokens, final_ids)]
    return RejectionOutput(sampled_token_ids=sampled, num_accepted_tokens=num_accepted_tokens)


def _own_samples(drafts: list[int], target_rows: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """(drafts kept, the token after them) for a seeded request: its drafts checked against the
    samples it draws from its target rows in order, one race each, stopping at the first that
    differs, so that it draws exactly one race per emitted token."""
    for position in range(len(drafts) + 1):
        token_id = int(exponential_race(target_rows[position : position + 1].clone(), {0: generator}))
        if position == len(drafts) or token_id != drafts[position]:
            return position, token_id
    raise AssertionError("unreachable: the last position always returns")


def _check_shapes(
    draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    greedy: list[bool],
    generators: list[torch.Generator | None],
) -> None:
    num_requests, total = len(draft_token_ids), sum(len(ids) for ids in draft_token_ids)
    if len(greedy) != num_requests or len(generators) != num_requests:
        raise ValueError(
            f"greedy ({len(greedy)}) and generators ({len(generators)}) need one entry per request ({num_requests})"
        )
    if draft_probs is None:
        if not all(greedy):
            raise ValueError("draft_probs may be None only when every request is greedy")
        draft_probs = target_probs[:total]
    if draft_probs.shape[0] != total:
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows but the batch proposes {total} draft tokens")
    if target_probs.shape[0] != total + num_requests:
        raise ValueError(
            f"target_probs has {target_probs.shape[0]} rows; {num_requests} requests with {total} draft tokens "
            f"need {total + num_requests} (k + 1 per request)"
        )
    if draft_probs.shape[1] != target_probs.shape[1]:
        raise ValueError(
            f"draft vocabulary {draft_probs.shape[1]} differs from target vocabulary {target_probs.shape[1]}"
        )


def _batch(draft_token_ids: list[list[int]], greedy: list[bool], seeded: list[bool], device: torch.device) -> _Batch:
    num_drafts = [len(ids) for ids in draft_token_ids]
    draft_start = [0, *accumulate(num_drafts)][:-1]
    num_drafts_tensor = torch.tensor(num_drafts, dtype=torch.int64, device=device)
    draft_start_rows = torch.tensor(draft_start, dtype=torch.int64, device=device)
    request_index = torch.arange(len(num_drafts), device=device)
    return _Batch(
        num_drafts=num_drafts,
        draft_start=draft_start,
        greedy=greedy,
        num_drafts_tensor=num_drafts_tensor,
        draft_start_rows=draft_start_rows,
        target_start_rows=draft_start_rows + request_index,
        request_of_draft=torch.repeat_interleave(request_index, num_drafts_tensor),
        is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        races_here=torch.tensor([not g and not own for g, own in zip(greedy, seeded)], dtype=torch.bool, device=device),
    )


def _accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor | None,
    batch: _Batch,
) -> torch.Tensor:
    """[sum k] bool: whether each draft token passes its own test, before cutting at the first failure."""
    draft_rows = torch.arange(drafts.numel(), device=drafts.device)
    target_rows = draft_rows + batch.request_of_draft
    accepted = torch.zeros_like(drafts, dtype=torch.bool)
    if not all(batch.greedy):
        uniform = torch.rand(drafts.numel(), device=drafts.device)
        # u < p/q without dividing: q(x) = 0 then means "keep iff p(x) > 0", as min(1, p/q) would.
        accepted = uniform * draft_probs[draft_rows, drafts] < target_probs[target_rows, drafts]
    if target_argmax is not None:
        greedy_rows = batch.is_greedy[batch.request_of_draft]
        accepted = torch.where(greedy_rows, target_argmax[target_rows] == drafts, accepted)
    return accepted


def _count_leading(accepted: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """[batch] drafts kept per request: the position of its first rejection, or k if there is none."""
    first_row = batch.draft_start_rows[batch.request_of_draft]
    positions = torch.arange(accepted.numel(), device=accepted.device) - first_row
    rejected = ~accepted
    return batch.num_drafts_tensor.scatter_reduce(
        0, batch.request_of_draft[rejected], positions[rejected], reduce="amin", include_self=True
    )


def _final_tokens(
    num_accepted: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor | None,
    batch: _Batch,
) -> torch.Tensor:
    """[batch] the token after the kept drafts: replacement at the first rejection, else the bonus token."""
    final = torch.zeros_like(num_accepted)
    if target_argmax is not None:
        # The first rejected row, or the bonus row when every draft was kept.
        final = torch.where(batch.is_greedy, target_argmax[batch.target_start_rows + num_accepted], final)
    random_requests = batch.races_here.nonzero().squeeze(1)
    if random_requests.numel():
        probs = _final_probs(random_requests, num_accepted, draft_probs, target_probs, batch)
        final[random_requests] = exponential_race(probs, {})
    return final


def _final_probs(
    requests: torch.Tensor,
    num_accepted: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    batch: _Batch,
) -> torch.Tensor:
    """[len(requests), vocab] unnormalized distribution of each one's last token: residual or bonus row."""
    kept = num_accepted[requests]
    probs = target_probs[batch.target_start_rows[requests] + kept]
    rejected = kept < batch.num_drafts_tensor[requests]
    if rejected.any():
        draft_rows = (batch.draft_start_rows[requests] + kept)[rejected]
        target = probs[rejected]
        residual = (target - draft_probs[draft_rows]).clamp_min_(0.0)
        # No residual mass means p <= q everywhere, i.e. p == q up to rounding: rejection was a
        # rounding accident there, and p itself is the exact distribution to draw from.
        no_mass = residual.sum(dim=-1, keepdim=True) <= 0
        probs[rejected] = torch.where(no_mass, target, residual)
    return probs
