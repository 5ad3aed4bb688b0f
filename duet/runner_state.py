"""What a worker's runner keeps of each request between steps: its tokens, its block table (as
the scheduler last sent it) and its random stream. Built from the scheduler's diffs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from duet.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """One request as the runner holds it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    lora: str | None = None  # its LoRA adapter (None: the base model)
    prompt_len: int = 0  # its sequence's own prompt length (``Span.prompt_len``)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
