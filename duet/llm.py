"""The offline API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from duet.config import EngineArgs
from duet.engine import LLMEngine
from duet.messages import RequestFailedError
from duet.outputs import RequestOutput
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
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. A prompt is text or a list of token ids."""
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
        order = []
        for prompt, params in zip(prompts, params_list):
            request_id = str(next(self._ids))
            if isinstance(prompt, str):
                token_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=True)
                self.engine.add_request(request_id, token_ids, params, prompt=prompt)
            else:
                self.engine.add_request(request_id, list(prompt), params)
            order.append(request_id)
        return self._run(order)

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

    def _run(self, order: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(order):
                for output in self.engine.step():
                    if output.error is not None:
                        raise RequestFailedError(f"request {output.request_id}: {output.error}")
                    if output.finished:
                        finished[output.request_id] = output
        except BaseException:
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        return [finished[request_id] for request_id in order]
