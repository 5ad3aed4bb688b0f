"""The offline API, shaped like vLLM's ``LLM``: text in, text out, on one engine in this process."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from duet.config import EngineArgs
from duet.detokenizer import SequenceText
from duet.engine import LLMEngine
from duet.errors import RequestFailedError
from duet.messages import EngineRequest
from duet.outputs import CompletionOutput, RequestOutput
from duet.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate completions for a batch of prompts in this process.

    >>> llm = LLM(model="smollm2")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str = "smollm2", **engine_kwargs) -> None:
        known = {f.name for f in EngineArgs.__dataclass_fields__.values()}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {unknown}; known engine arguments are {sorted(known)}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | tuple[str, str] | list[str | tuple[str, str] | None] | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. A prompt is text or a list of token ids;
        each of its ``n`` completions is a sequence of its own in the engine. ``lora``: the
        LoRA adapter of every prompt, or a list of each's (None: the base): a name in
        ``lora_modules``, or ``(name, folder)``, which the engine loads when it is first used."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, (str, tuple)) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA adapters for {len(prompts)} prompts")
        requests = []
        for prompt, params, adapter in zip(prompts, params_list, loras):
            text = prompt if isinstance(prompt, str) else None
            token_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=True) if text is not None else list(prompt)
            truncated = params.truncate(token_ids, self.engine.max_model_len)
            if len(truncated) < len(token_ids):  # the prompt is what is left of it
                text, token_ids = self.engine.tokenizer.decode(truncated), truncated
            requests.append(_Request(str(next(self._ids)), text, token_ids, params, adapter))
        return self._run(requests)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the assistant turn opened) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, conversation: list[dict]) -> list[int]:
        encoded = self.engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def _run(self, requests: list[_Request]) -> list[RequestOutput]:
        engine = self.engine
        tokenizer = engine.tokenizer.backend_tokenizer
        sequences: dict[str, tuple[_Request, SequenceText]] = {}
        try:
            for request in requests:
                name, path = (request.lora, None) if not isinstance(request.lora, tuple) else request.lora
                for index in range(request.params.n):
                    sequence_id = f"{request.request_id}#{index}"
                    engine.add_request(EngineRequest(sequence_id, request.prompt_token_ids, request.params.choice(index), lora=name, lora_path=path))
                    sequences[sequence_id] = (request, SequenceText.start(tokenizer, request.params))
                    request.sequences.append(sequences[sequence_id][1])
            unfinished = set(sequences)
            while unfinished:
                for delta in engine.step():
                    request, sequence = sequences[delta.request_id]
                    if delta.error is not None:
                        raise RequestFailedError(f"request {request.request_id}: {delta.error}")
                    request.num_cached_tokens[delta.request_id] = delta.num_cached_tokens
                    sequence.add(delta)
                    request.metrics.setdefault("first_token_time", time.monotonic())
                    if sequence.finished:
                        request.metrics["finished_time"] = time.monotonic()
                        if not delta.finished:
                            engine.abort_request(delta.request_id)  # a stop string: the engine knows no text
                        unfinished.discard(delta.request_id)
        finally:
            for sequence_id in sequences:
                engine.abort_request(sequence_id)
        return [request.output() for request in requests]


class _Request:
    """A prompt and its ``n`` sequences, gathered into one ``RequestOutput``."""

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, lora: str | tuple[str, str] | None = None
    ) -> None:
        self.request_id = request_id
        self.lora = lora
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sequences: list[SequenceText] = []
        self.num_cached_tokens: dict[str, int] = {}  # per sequence: prompt tokens found in the prefix cache
        self.metrics: dict[str, float] = {}

    def output(self) -> RequestOutput:
        completions = [
            CompletionOutput(index, sequence.text, sequence.token_ids, sequence.finish_reason, sequence.stop_reason, sequence.logprobs)
            for index, sequence in enumerate(self.sequences)
        ]
        num_cached = min(self.num_cached_tokens.values(), default=0)
        prompt_logprobs = self.sequences[0].prompt_logprobs if self.sequences else None
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, completions, True, num_cached, self.metrics, prompt_logprobs
        )
