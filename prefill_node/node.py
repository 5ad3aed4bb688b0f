"""The engine in prefill role: computes prompts, samples the first token, ships the KV.

A plain class driven by ``step()``, so it can be tested in a process of its own; the Serve
deployment wraps it. A request's blocks stay pinned after its first token until the decode
replica acknowledges its KV (its full blocks stay in the prefix cache after that).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass

from duet.config import EngineArgs
from duet.detokenizer import hold_back_stop_prefix
from duet.engine import LLMEngine, RequestValidationError
from duet.kv_transfer import Endpoint, KVDestination, KVHandle, KVSender, engine_kv_spec
from duet.kv_transfer.transfer import STREAM_START_TIMEOUT_S, LayerProgress
from duet.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    """The first token. ``handle`` (to pull the KV with) is None when the request finished with
    that token, or when its KV is already streaming to a decode replica chosen up front.
    ``error`` says why the engine failed the request (it then has no token)."""

    request_id: str
    first_token_id: int | None
    text: str
    finish_reason: str | None
    handle: KVHandle | None
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed
    error: str | None = None


class PrefillNode:
    """An ``LLMEngine`` that stops each request after its first token and ships its KV."""

    def __init__(self, engine_args: EngineArgs, node_id: str, transfer_timeout_s: float = 30.0, host: str = "127.0.0.1") -> None:
        self.node_id = node_id
        self.engine = LLMEngine(engine_args)
        self.kv_spec = engine_kv_spec(self.engine)
        self.transfer_timeout_s = transfer_timeout_s
        self.sender = KVSender(self.engine.runner.kv_cache, self.kv_spec, host, transfer_timeout_s)
        self._params: dict[str, SamplingParams] = {}
        # transfer id -> (request whose KV waits to be pulled, when it stops waiting)
        self._ready: dict[int, tuple[str, float]] = {}
        self._sending: dict[int, str] = {}
        self._streaming: dict[str, LayerProgress] = {}
        self.engine.runner.layer_listener = self._on_layer_done

    @property
    def has_work(self) -> bool:
        """Prompts to compute, or KV still to be pulled or acknowledged."""
        return self.engine.scheduler.has_unfinished_requests() or bool(self._sending) or bool(self._ready)

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
            # The first layers come when the prompt's last chunk runs: after whatever is queued.
            self.sender.send(
                destination.transfer_id, destination.endpoint, destination.pair_key, progress, num_blocks,
                timeout_s=STREAM_START_TIMEOUT_S,
            )

    def step(self) -> list[PrefillResult]:
        """One engine step; returns the requests that got their first token (or failed)."""
        self._release_sent()
        self._drop_unclaimed()
        results = []
        outputs = self.engine.step()
        for request_id in self.engine.restarted_request_ids:
            # Layers it shipped came from blocks the failed step freed: the decode side must not
            # use them (it recomputes, by its policy), and the sender must not read on.
            if request_id in self._streaming:
                self._streaming[request_id].cancel()
        for output in outputs:
            if output.finished:
                results.append(self._result(output))
        return results

    def _result(self, output) -> PrefillResult:
        completion = output.outputs[0]
        params = self._params.pop(output.request_id)
        if output.error is not None:
            self._give_up(output.request_id)
            return PrefillResult(output.request_id, None, "", None, None, error=output.error)
        done = completion.finish_reason == "stop" or params.max_tokens == 1
        # A streamed request's KV is already on its way; it is unpinned on acknowledgement.
        streamed = self._streaming.pop(output.request_id, None) is not None
        handle = None
        if done and not streamed:
            self.engine.kv_cache_manager.release_pinned(output.request_id)
        elif not done and not streamed:
            transfer_id = secrets.randbits(62)
            self._ready[transfer_id] = (output.request_id, time.monotonic() + self.transfer_timeout_s)
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
        ready = self._ready.pop(transfer_id, None)
        if ready is None:
            raise KeyError(f"transfer {transfer_id} is unknown here, or was dropped unclaimed")
        request_id = ready[0]
        # The pinned blocks hold exactly the prompt: the first token's slot was never allocated.
        block_ids = [block.block_id for block in self.engine.kv_cache_manager.pinned[request_id]]
        self._sending[transfer_id] = request_id
        progress = LayerProgress.complete(self.kv_spec.num_layers, block_ids)
        self.sender.send(transfer_id, endpoint, pair_key, progress, len(block_ids))

    def drop(self, transfer_id: int) -> None:
        """The request will never be pulled (client gone, decode chose to recompute): unpin it."""
        ready = self._ready.pop(transfer_id, None)
        if ready is not None:
            self.engine.kv_cache_manager.release_pinned(ready[0])

    def abort(self, request_id: str) -> None:
        """Stop a request. KV waiting to be pulled is dropped; a transfer under way is given up,
        and its blocks stay pinned until the sender has let go of them."""
        self._params.pop(request_id, None)
        self.engine.abort_request(request_id)
        self._give_up(request_id)

    def _give_up(self, request_id: str) -> None:
        progress = self._streaming.pop(request_id, None)
        if progress is not None:
            progress.cancel()
        for transfer_id, (ready_id, _) in list(self._ready.items()):
            if ready_id == request_id:
                del self._ready[transfer_id]
        if request_id not in self._sending.values():
            self.engine.kv_cache_manager.release_pinned(request_id)

    def _drop_unclaimed(self) -> None:
        """KV nobody pulled in time (the router never came back for it) is unpinned."""
        now = time.monotonic()
        for transfer_id, (request_id, deadline) in list(self._ready.items()):
            if deadline <= now:
                logger.warning("KV of request %s was never pulled; unpinning its blocks", request_id)
                self.drop(transfer_id)

    def _release_sent(self) -> None:
        for result in self.sender.poll():
            request_id = self._sending.pop(result.transfer_id, None)
            if request_id is not None:
                self.engine.kv_cache_manager.release_pinned(request_id)
            if not result.ok:
                logger.warning("KV of request %s not delivered: %s", request_id, result.error)

    def check_integrity(self) -> None:
        """Blocks are held only by requests in the engine, KV waiting to be pulled and transfers."""
        pulled = [request_id for request_id, _ in self._ready.values()]
        self.engine.check_integrity([*pulled, *self._sending.values()])

    def close(self) -> None:
        self.sender.close()
