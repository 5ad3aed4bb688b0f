"""The engine in prefill role: computes prompts, samples the first token, ships the KV.

A plain class driven by ``step()``, so it can be tested in a process of its own; the Serve
deployment wraps it. A request's blocks stay pinned after its first token until the decode
replica acknowledges its KV (its full blocks stay in the prefix cache after that).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from dataclasses import dataclass

from duet.config import EngineArgs
from duet.detokenizer import hold_back_stop_prefix
from duet.engine import LLMEngine, RequestValidationError
from duet.kv_transfer import Endpoint, KVDestination, KVHandle, KVSender, engine_kv_spec
from duet.kv_transfer.transfer import LayerProgress
from duet.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    """The first token. ``handle`` (to pull the KV with) is None when the request finished with
    that token, or when its KV is already streaming to a decode replica chosen up front."""

    request_id: str
    first_token_id: int
    text: str
    finish_reason: str | None
    handle: KVHandle | None
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed


class PrefillNode:
    """An ``LLMEngine`` that stops each request after its first token and ships its KV."""

    def __init__(self, engine_args: EngineArgs, node_id: str, transfer_timeout_s: float = 30.0) -> None:
        self.node_id = node_id
        self.engine = LLMEngine(engine_args)
        self.kv_spec = engine_kv_spec(self.engine)
        self.sender = KVSender(self.engine.runner.kv_cache, self.kv_spec, timeout_s=transfer_timeout_s)
        self._params: dict[str, SamplingParams] = {}
        self._ready: dict[int, str] = {}  # transfer id -> request whose KV waits to be pulled
        self._sending: dict[int, str] = {}
        self._streaming: dict[str, LayerProgress] = {}
        self.engine.runner.layer_listener = self._on_layer_done

    @property
    def has_work(self) -> bool:
        """Prompts to compute, or KV whose delivery is still to be acknowledged."""
        return self.engine.scheduler.has_unfinished_requests() or bool(self._sending)

    def _on_layer_done(self, layer: int, completing: list[str]) -> None:
        """Runs on the engine thread during the forward pass: release finished layers."""
        for request_id in completing:
            progress = self._streaming.get(request_id)
            if progress is not None:
                block_ids = self.engine.kv_cache_manager.block_ids(request_id) if layer == 0 else None
                progress.mark_ready(layer + 1, block_ids)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        destination: KVDestination | None = None,
    ) -> None:
        """Prefill a prompt. With a ``destination`` (a decode replica chosen up front) its KV
        streams there layer run by layer run while the prompt's last chunk computes."""
        if params.n != 1:
            raise RequestValidationError("prefill takes one completion per request; fan out n before prefill")
        self.engine.validate(prompt_token_ids, params)
        self._params[request_id] = params
        self.engine.kv_cache_manager.pin_on_free(request_id)
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        self.engine.add_request(request_id, prompt_token_ids, first_only)
        if destination is not None:
            progress = LayerProgress(self.kv_spec.num_layers)
            self._streaming[request_id] = progress
            self._sending[destination.transfer_id] = request_id
            num_blocks = -(-len(prompt_token_ids) // self.engine.block_size)
            self.sender.send(destination.transfer_id, None, destination.endpoint, destination.pair_key, progress, num_blocks)

    def step(self) -> list[PrefillResult]:
        """One engine step; returns the requests that got their first token."""
        self._release_sent()
        results = []
        for output in self.engine.step():
            if output.finished:
                results.append(self._result(output))
        return results

    def _result(self, output) -> PrefillResult:
        completion = output.outputs[0]
        params = self._params.pop(output.request_id)
        done = completion.finish_reason == "stop" or params.max_tokens == 1
        # A streamed request's KV is already on its way; it is unpinned on acknowledgement.
        streamed = self._streaming.pop(output.request_id, None) is not None
        handle = None
        if done and not streamed:
            self.engine.kv_cache_manager.release_pinned(output.request_id)
        elif not done and not streamed:
            transfer_id = secrets.randbits(62)
            self._ready[transfer_id] = output.request_id
            handle = KVHandle(
                request_id=output.request_id,
                prompt_token_ids=tuple(output.prompt_token_ids),
                first_token_id=completion.token_ids[0],
                num_kv_tokens=len(output.prompt_token_ids),
                source=self.node_id,
                transfer_id=transfer_id,
            )
        # The engine flushed the text when the one-token request ended; the request goes on at
        # the decode replica, so hold back what could start a stop string, as decode will.
        text = completion.text if done or not params.stop else hold_back_stop_prefix(completion.text, params.stop)
        return PrefillResult(
            output.request_id, completion.token_ids[0], text, completion.finish_reason if done else None,
            handle, completion.logprobs, output.num_cached_tokens,
        )

    def send_kv(self, transfer_id: int, endpoint: Endpoint, pair_key: str) -> None:
        """Ship a prefilled request's KV to the decode replica that asked for it."""
        request_id = self._ready.pop(transfer_id)
        # The pinned blocks hold exactly the prompt: the first token's slot was never allocated.
        block_ids = [block.block_id for block in self.engine.kv_cache_manager.pinned[request_id]]
        self._sending[transfer_id] = request_id
        self.sender.send(transfer_id, block_ids, endpoint, pair_key)

    def drop(self, transfer_id: int) -> None:
        """The request will never be pulled (client gone, decode chose to recompute): unpin it."""
        request_id = self._ready.pop(transfer_id, None)
        if request_id is not None:
            self.engine.kv_cache_manager.release_pinned(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; blocks already promised to a decode replica stay pinned until that
        transfer ends (a streamed one times out waiting for layers that never come)."""
        self._params.pop(request_id, None)
        self._streaming.pop(request_id, None)
        self.engine.abort_request(request_id)
        if request_id not in self._ready.values() and request_id not in self._sending.values():
            self.engine.kv_cache_manager.release_pinned(request_id)

    def _release_sent(self) -> None:
        for result in self.sender.poll():
            request_id = self._sending.pop(result.transfer_id, None)
            if request_id is not None:
                self.engine.kv_cache_manager.release_pinned(request_id)
            if not result.ok:
                logger.warning("KV of request %s not delivered: %s", request_id, result.error)

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def close(self) -> None:
        self.sender.close()
