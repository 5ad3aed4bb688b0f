"""Turns one step's logits into next tokens: forbidden tokens, penalties, greedy or filtered random sampling.

Per-row settings become tensors once per step (`build_sampling_metadata`) so the sampler itself
is a handful of batched ops; the flags on `SamplingMetadata` let the common cases skip whole stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from duet.sampling_params import SamplingParams

# How many of the likeliest tokens top-p sorts before falling back to the whole vocabulary.
_TOP_P_CANDIDATES = 1024
# Temperatures and repetition penalties stay within [1 / this, this], so in float32 they are
# never 0 or inf: -inf x 0, 0 x inf and -inf / inf are all NaN.
_MAX_MAGNITUDE = 1e30
_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, one entry per logits row.

    Sampling tensors are None when ``all_greedy``; penalty tensors are None when ``no_penalties``.
    Greedy rows carry neutral values (top_k=vocab_size, top_p=1, min_p=0) and ``temperature == 0``,
    and the ``no_*`` flags only look at the random rows.
    """

    all_greedy: bool
    no_penalties: bool
    # Per row: how many top logprobs the request asked for, None when it asked for none.
    num_logprobs: list[int | None]
    max_num_logprobs: int | None
    # (row indices, token ids) as two 1-D tensors ready for advanced indexing; None when empty.
    forbidden_token_ids: tuple[torch.Tensor, torch.Tensor] | None
    no_top_k: bool = True
    no_top_p: bool = True
    no_min_p: bool = True
    temperature: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    # Row -> the request's own generator, only for random rows whose request has a seed.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    repetition_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    # [rows, longest] token ids padded with vocab_size (a bin that is counted, then dropped).
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    # (row indices, token ids, biases) of the rows' logit_bias; None when no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class SamplerOutput:
    """One sampled token per row, and the raw log-probabilities of rows that asked for them.

    ``logprobs`` is None when no row asked; otherwise it has one entry per row: None for a row
    that did not ask, else a dict of its top-``logprobs`` tokens (highest first) plus the sampled
    token (last, if it is not already among them) mapped to log_softmax of the model's logits
    (before penalties and filters; after a structured-output mask, as in vLLM: -inf where it forbids).
    """

    sampled_token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own random stream, so its samples depend only on its seed."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)  # torch's own mapping of negative seeds, for any integer
    return generator


def copy_generator(generator: torch.Generator) -> torch.Generator:
    """A second stream that draws what ``generator`` would draw next, leaving it where it is."""
    twin = torch.Generator(device=generator.device)
    twin.set_state(generator.get_state())
    return twin


def advance_generator(generator: torch.Generator, vocab_size: int, num_samples: int) -> None:
    """Skip the random draws of ``num_samples`` earlier samples (see ``exponential_race``)."""
    for _ in range(num_samples):
        torch.empty(vocab_size, device=generator.device).uniform_(generator=generator)


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    forbidden_token_ids: list[tuple[int, ...]],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    """Gather one step's per-row settings into tensors; all arguments are indexed by logits row.

    ``generators[row]`` is the request's generator (None when it has no seed).
    ``forbidden_token_ids[row]`` are tokens whose logits are set to -inf this step.
    """
    num_logprobs = [p.logprobs for p in params]
    asked = [n for n in num_logprobs if n is not None]
    metadata = SamplingMetadata(
        all_greedy=all(p.greedy for p in params),
        no_penalties=not any(p.has_penalties for p in params),
        num_logprobs=num_logprobs,
        max_num_logprobs=max(asked) if asked else None,
        forbidden_token_ids=_forbidden_indices(forbidden_token_ids, vocab_size, device),
    )
    if not metadata.all_greedy:
        _add_sampling_tensors(metadata, params, generators, vocab_size, device)
    if not metadata.no_penalties:
        _add_penalty_tensors(metadata, params, prompt_token_ids, output_token_ids, vocab_size, device)
    return metadata


def _forbidden_indices(
    forbidden_token_ids: list[tuple[int, ...]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows, token_ids = [], []
    for row, ids in enumerate(forbidden_token_ids):
        for token_id in ids:
            # A token outside the logits can never be sampled, so forbidding it is a no-op.
            if token_id < vocab_size:
                rows.append(row)
                token_ids.append(token_id)
    if not rows:
        return None
    return torch.tensor(rows, device=device), torch.tensor(token_ids, device=device)


def _add_sampling_tensors(
    metadata: SamplingMetadata,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device | str,
) -> None:
    random_params = [(row, p) for row, p in enumerate(params) if not p.greedy]
    top_k = [vocab_size] * len(params)
    top_p = [1.0] * len(params)
    min_p = [0.0] * len(params)
    for row, p in random_params:
        top_k[row] = min(p.effective_top_k or vocab_size, vocab_size)
        top_p[row] = p.top_p
        min_p[row] = p.min_p
    metadata.no_top_k = all(k == vocab_size for k in top_k)
    metadata.no_top_p = all(p == 1.0 for p in top_p)
    metadata.no_min_p = all(p == 0.0 for p in min_p)
    temperatures = [0.0 if p.greedy else min(p.temperature, _MAX_MAGNITUDE) for p in params]
    metadata.temperature = torch.tensor(temperatures, dtype=torch.float32, device=device)
    metadata.top_k = torch.tensor(top_k, dtype=torch.int64, device=device)
    metadata.top_p = torch.tensor(top_p, dtype=torch.float32, device=device)
    metadata.min_p = torch.tensor(min_p, dtype=torch.float32, device=device)
    metadata.generators = {row: generators[row] for row, _ in random_params if generators[row] is not None}


def _add_penalty_tensors(
    metadata: SamplingMetadata,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
) -> None:
    def as_tensor(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    metadata.repetition_penalties = as_tensor(
        [min(max(p.repetition_penalty, 1 / _MAX_MAGNITUDE), _MAX_MAGNITUDE) for p in params]
    )
    metadata.frequency_penalties = as_tensor([p.frequency_penalty for p in params])
    metadata.presence_penalties = as_tensor([p.presence_penalty for p in params])
    # Only the repetition penalty looks at the prompt; skip copying long prompts when none uses it.
    uses_prompt = any(p.repetition_penalty != 1.0 for p in params)
    prompts = prompt_token_ids if uses_prompt else [[] for _ in params]
    metadata.prompt_token_ids = _pad(prompts, vocab_size, device)
    metadata.output_token_ids = _pad(output_token_ids, vocab_size, device)
    biased = [(row, token_id, value) for row, p in enumerate(params) for token_id, value in p.logit_bias if token_id < vocab_size]
    if biased:
        rows, token_ids, values = zip(*biased)
        metadata.logit_bias = (
            torch.tensor(rows, device=device), torch.tensor(token_ids, device=device), torch.tensor(values, dtype=torch.float32, device=device)
        )


def _pad(token_ids: list[list[int]], pad_id: int, device: torch.device | str) -> torch.Tensor:
    longest = max((len(ids) for ids in token_ids), default=0)
    padded = [ids + [pad_id] * (longest - len(ids)) for ids in token_ids]
    return torch.tensor(padded, dtype=torch.int64, device=device)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] occurrence counts; the padding id vocab_size lands in a dropped extra bin."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, then frequency, then presence penalty, as vLLM applies them, then each row's
    logit bias; returns new logits.

    Repetition covers tokens seen in prompt or output: positive logits are divided by the
    penalty, the others multiplied. Frequency subtracts penalty x count in the output; presence
    subtracts the penalty once for any token present in the output.
    """
    vocab_size = logits.shape[1]
    output_counts = _token_counts(metadata.output_token_ids, vocab_size)
    in_output = output_counts > 0
    seen = in_output | (_token_counts(metadata.prompt_token_ids, vocab_size) > 0)
    repetition = torch.where(seen, metadata.repetition_penalties.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits = logits - metadata.presence_penalties.unsqueeze(1) * in_output
    if metadata.logit_bias is not None:
        rows, token_ids, values = metadata.logit_bias
        logits = logits.index_put((rows, token_ids), values, accumulate=True)
    return logits


class Sampler:
    """Picks one token per logits row.

    Order: forbidden tokens to -inf, penalties and logit biases (greedy rows too), then argmax for greedy rows;
    random rows go through temperature, min_p, top-k, top-p and an exponential race that draws
    from the row's own generator when its request has a seed. Logprobs come from the logits as
    given (a constrained row's arrive masked).
    """

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # Later stages only write into tensors they created, so the caller's logits stay untouched.
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None
        if metadata.forbidden_token_ids is not None:
            logits = logits.index_put(metadata.forbidden_token_ids, logits.new_tensor(float("-inf")))
        if not metadata.no_penalties:
            # An extreme penalty pushes logits past float32: saturate them, so that none is +inf
            # (inf - inf is NaN later) and no possible token becomes -inf; impossible ones stay -inf.
            penalized = apply_penalties(logits, metadata).clamp_(-_FLOAT32_MAX, _FLOAT32_MAX)
            logits = torch.where(logits == float("-inf"), logits, penalized)
        sampled = logits.argmax(dim=-1)
        if not metadata.all_greedy:
            # The greedy choice's logit is each row's largest: the random rows measure from it.
            row_max = logits.gather(1, sampled.unsqueeze(1))
            sampled = torch.where(metadata.temperature == 0, sampled, _sample_random(logits, metadata, row_max))
        sampled_token_ids = sampled.tolist()
        logprobs = None if raw_logprobs is None else _gather_logprobs(raw_logprobs, sampled_token_ids, metadata)
        return SamplerOutput(sampled_token_ids=sampled_token_ids, logprobs=logprobs)


def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata, row_max: torch.Tensor) -> torch.Tensor:
    """Temperature, min_p, top-k, top-p, then an exponential race; greedy rows get a throwaway sample."""
    return exponential_race(_filtered_probs(logits, metadata, row_max), metadata.generators)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] the distribution each row's random (temperature > 0) params sample from:
    temperature, min_p, top-k and top-p, without penalties or forbidden tokens."""
    rows, vocab_size = logits.shape
    metadata = build_sampling_metadata(
        params, [[]] * rows, [[]] * rows, [None] * rows, [()] * rows, vocab_size, logits.device
    )
    return _filtered_probs(logits.float(), metadata)


def _filtered_probs(logits: torch.Tensor, metadata: SamplingMetadata, row_max: torch.Tensor | None = None) -> torch.Tensor:
    """``row_max``: [rows, 1] each row's largest logit, when the caller has it already."""
    temperature = metadata.temperature
    # Measured from the row's largest logit, a logit divided by a small temperature can only fall
    # (to -inf at worst), never overflow to +inf, which would make the probabilities NaN.
    logits = logits - (logits.amax(dim=-1, keepdim=True) if row_max is None else row_max)
    logits /= torch.where(temperature == 0, 1.0, temperature).unsqueeze(1)
    if not metadata.no_min_p:
        # p / p_max is now exp(logit), so p < min_p x p_max is logit < log(min_p): exact even where
        # a huge temperature rounds the probabilities to ties.
        logits.masked_fill_(logits < metadata.min_p.log().unsqueeze(1), float("-inf"))
    if not metadata.no_top_k:
        logits = _apply_top_k(logits, metadata.top_k)
    if not metadata.no_top_p:
        logits = _apply_top_p(logits, metadata.top_p)
    return logits.softmax(dim=-1)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k largest logits (and any tied with the k-th); top_k=vocab_size keeps all."""
    vocab_size = logits.shape[1]
    disabled = top_k == vocab_size
    max_k = int(top_k.masked_fill(disabled, 1).max())
    top_values = logits.topk(max_k, dim=-1).values
    kth_largest = top_values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
    kth_largest.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p.

    Runs after top-k, so the mass is measured among its survivors, renormalized. Tokens tied
    with the last kept one are kept too; the cut compares logits, which stay apart where a huge
    temperature rounds probabilities to ties. A full-vocabulary sort costs ~10x a top-k on CPU,
    so only the likeliest candidates are sorted, and only rows they do not cover get a full sort.
    """
    probs = logits.softmax(dim=-1)
    candidates, candidate_ids = logits.topk(min(_TOP_P_CANDIDATES, logits.shape[1]), dim=-1)
    candidate_probs = probs.gather(1, candidate_ids)
    threshold = _top_p_threshold(candidates, candidate_probs, top_p)
    uncovered = (top_p < 1.0) & (candidate_probs.sum(dim=-1) < top_p)
    if uncovered.any():
        full_sort, full_sort_ids = logits[uncovered].sort(dim=-1, descending=True)
        full_sort_probs = probs[uncovered].gather(1, full_sort_ids)
        threshold[uncovered] = _top_p_threshold(full_sort, full_sort_probs, top_p[uncovered])
    # Rows with top_p=1 keep everything, whatever rounding did to their cumulative sum.
    threshold.masked_fill_((top_p == 1.0).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_p_threshold(sorted_logits: torch.Tensor, sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, 1] logit of the token whose cumulative probability (descending) first reaches top_p."""
    cumulative = sorted_probs.cumsum(dim=-1)
    # Tokens before the one that reaches top_p, plus that one.
    num_kept = ((cumulative < top_p.unsqueeze(1)).sum(dim=-1) + 1).clamp(max=sorted_probs.shape[1])
    return sorted_logits.gather(1, (num_kept - 1).unsqueeze(1))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exponential(1) per token picks token i with probability probs[i].

    q = -log(u), u ~ Uniform: on CPU uniform_ plus log is ~2x faster than exponential_.
    ``generators`` maps rows to their own streams; the other rows draw from the global one.
    """
    uniform = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    # u = 0 would make q infinite; if a row's only candidate drew it, argmax would return token 0.
    q = uniform.clamp_min_(torch.finfo(uniform.dtype).tiny).log_().neg_()
    return probs.div_(q).argmax(dim=-1)


def _gather_logprobs(
    raw_logprobs: torch.Tensor, sampled_token_ids: list[int], metadata: SamplingMetadata
) -> list[dict[int, float] | None]:
    return top_logprobs(raw_logprobs, sampled_token_ids, metadata.num_logprobs)


def top_logprobs(raw_logprobs: torch.Tensor, token_ids: list[int], nums: list[int | None]) -> list[dict[int, float] | None]:
    """Per row of ``raw_logprobs`` (log-softmaxed logits): the ``nums[row]`` most likely tokens'
    logprobs and ``token_ids[row]``'s own (None where ``nums[row]`` is None)."""
    most = max((num for num in nums if num is not None), default=0)
    top_values, top_ids = raw_logprobs.topk(most, dim=-1)
    own = raw_logprobs.gather(1, torch.tensor(token_ids, device=raw_logprobs.device).unsqueeze(1)).squeeze(1)
    top_values, top_ids, own = top_values.tolist(), top_ids.tolist(), own.tolist()
    logprobs: list[dict[int, float] | None] = []
    for row, num in enumerate(nums):
        if num is None:
            logprobs.append(None)
            continue
        row_logprobs = dict(zip(top_ids[row][:num], top_values[row][:num]))
        row_logprobs.setdefault(token_ids[row], own[row])
        logprobs.append(row_logprobs)
    return logprobs
