"""Per-request sampling settings, named and defaulted as in vLLM and the OpenAI API."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from duet.errors import InvalidRequestError
from duet.structured_output import StructuredOutputs

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this temperature sampling is greedy: its limit as the temperature goes to 0 (dividing
# logits by less would overflow float32 and turn the probabilities into NaN).
GREEDY_TEMPERATURE = 1e-5
# What one request may ask the text and token checks to carry: every stop string is searched
# for in each piece of every sequence's text (on the router's event loop, which streams every
# client), and every stop token id is excluded from each of its rows' logits, each step, until
# min_tokens. 85,000 stop strings held that loop 0.4 s a step; 500,000 stop ids made every step
# of a shared batch take seconds. OpenAI's API takes at most 4 stop strings. A piece of text
# costs its length times the stop strings' total length at worst (adversarial strings: 64 of
# 1,024 characters took 0.8 ms a token), hence the total.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_CHARS_TOTAL = 4096
MAX_STOP_TOKEN_IDS = 1024


class SamplingParamsError(InvalidRequestError):
    """A sampling setting is out of range; the message says which and what is allowed, ``param``
    names the setting."""


class ContextLengthError(InvalidRequestError):
    """The prompt, with the tokens asked for, does not fit the model's context."""


def fit_to_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The tokens a request may generate: ``max_tokens``, or all the room the prompt leaves.
    The one length rule, applied by the router at the edge and by the engine."""
    if num_prompt_tokens == 0:
        raise ContextLengthError("the prompt is empty; send at least one token", "prompt")
    if num_prompt_tokens >= max_model_len:
        over = num_prompt_tokens - max_model_len + 1
        raise ContextLengthError(
            f"the prompt has {num_prompt_tokens} tokens but this model's maximum context length is {max_model_len}; "
            f"shorten it by at least {over} token{'s' if over > 1 else ''} so that one can be generated "
            "(or ask for its last tokens only: truncate_prompt_tokens)", "prompt",
        )
    room = max_model_len - num_prompt_tokens
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthError(
            f"max_tokens={max_tokens} is too large: the {num_prompt_tokens}-token prompt leaves {room} of the "
            f"{max_model_len}-token context", "max_tokens",
        )
    return room if max_tokens is None else max_tokens


def truncate_prompt(prompt_token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """A prompt's last ``keep`` tokens (``truncate_prompt_tokens``; -1: as many as the model's
    context holds; None: the prompt as it is)."""
    if keep is None:
        return prompt_token_ids
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise SamplingParamsError(f"truncate_prompt_tokens must be at least 1, or -1 for the model's context, got {keep}", "truncate_prompt_tokens")
    if keep > max_model_len:
        raise SamplingParamsError(
            f"truncate_prompt_tokens={keep} is more than this model's maximum context length, {max_model_len}", "truncate_prompt_tokens",
        )
    return prompt_token_ids[-keep:]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature=0`` (or anything below ``GREEDY_TEMPERATURE``) is greedy. ``seed`` makes one
    request's samples reproducible whatever else shares its batch. ``logprobs=k`` returns the
    top-k log-probabilities of each generated token (plus the sampled one). ``n`` completions
    are fanned out before the engine (``choice``), and share the prompt's KV through the prefix
    cache. ``stop`` strings and the text options act where text is made (the router, ``LLM``);
    the engine stops on token ids (EOS, ``stop_token_ids``, ``max_tokens``).
    ``structured_outputs`` constrains the output to a JSON schema, regex, choice or grammar:
    each token is sampled among those the constraint allows, and once it is complete only EOS
    is: a complete output ends at EOS; ``max_tokens`` cuts an incomplete one (``"length"``), and
    a ``stop`` string or stop token the client chose may end it early.

    The OpenAI API's request fields are made from these fields, types and defaults
    (``duet.router.protocol``): a field added here is one a request may set.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    # Added to the token's logit before sampling (OpenAI's -100 to 100), as (token id, bias)
    # pairs in id order; given as a dict (the API's form) it is made into these.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The log-probability of each prompt token after the ones before it, with this many of the
    # most likely tokens there (vLLM's); the prompt is then computed whole, not read from the
    # prefix cache.
    prompt_logprobs: int | None = None
    # Keep only the prompt's last this many tokens (-1: as many as the model's context holds),
    # vLLM's: a prompt past the context is otherwise refused, never cut silently. Applied where
    # the prompt is tokenized (the router, ``LLM``: ``truncate``), not by the engine, whose
    # contexts (a moved sequence's prompt and output) are never cut.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((int(token_id), float(value)) for token_id, value in bias)))
        self._validate()

    def _validate(self) -> None:
        """One table of what the engine can represent; the HTTP API refuses the same values (400)."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise SamplingParamsError(f"{name} must be a finite number, got {getattr(self, name)}", name)
        checks = [
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            ("temperature", self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            ("top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= 0 or self.top_k == -1, f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}"),
            ("min_p", 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            ("repetition_penalty", self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            ("min_tokens", self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}",
            ),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
            ),
            (
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1,
                f"truncate_prompt_tokens must be at least 1, or -1 for the model's context, got {self.truncate_prompt_tokens}",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"),
            (
                "stop",
                all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
                f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters",
            ),
            (
                "stop",
                sum(len(s) for s in self.stop if isinstance(s, str)) <= MAX_STOP_CHARS_TOTAL,
                f"the stop strings may have at most {MAX_STOP_CHARS_TOTAL} characters in all",
            ),
            (
                "seed",
                self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
                f"seed must be a 64-bit signed integer, in [{INT64_MIN}, {INT64_MAX}]",
            ),
            (
                "stop_token_ids",
                all(0 <= token_id <= INT64_MAX for token_id in self.stop_token_ids),
                f"stop_token_ids must be token ids, integers in [0, {INT64_MAX}]",
            ),
            (
                "stop_token_ids",
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            ),
            (
                "logit_bias",
                all(0 <= token_id <= INT64_MAX and -100.0 <= value <= 100.0 for token_id, value in self.logit_bias),
                "logit_bias maps token ids to biases in [-100, 100]",
            ),
            (
                "logit_bias",
                len(self.logit_bias) <= MAX_STOP_TOKEN_IDS,
                f"logit_bias takes at most {MAX_STOP_TOKEN_IDS} tokens, got {len(self.logit_bias)}",
            ),
            (
                "ignore_eos",
                not (self.ignore_eos and self.structured_outputs is not None),
                "ignore_eos cannot be combined with structured_outputs: a complete constrained output ends at EOS",
            ),
            (
                "structured_outputs",
                self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
                "structured_outputs must be a StructuredOutputs(json=..., regex=..., choice=..., grammar=...)",
            ),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamsError(message, param)

    def truncate(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as ``truncate_prompt_tokens`` asks (``truncate_prompt``)."""
        return truncate_prompt(prompt_token_ids, self.truncate_prompt_tokens, max_model_len)

    def choice(self, index: int) -> SamplingParams:
        """Completion ``index`` of the ``n``: one completion, seeded with ``seed + index`` (wrapped
        into 64 bits) so that each completion has its own reproducible stream. Only the first
        computes the prompt's logprobs (the others read the prompt from the prefix cache)."""
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether the request changes logits itself (penalties, a logit bias): its rows take the
        sampler's penalty path, and it is not speculated."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or bool(self.logit_bias)

    @property
    def effective_top_k(self) -> int:
        """top_k with the two 'disabled' spellings (0 and -1) folded to 0."""
        return max(self.top_k, 0)
