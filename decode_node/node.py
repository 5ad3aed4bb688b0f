"""The engine in decode role: pulls prompt KV from prefill replicas and keeps generating.

A plain class driven by ``step()``, so it can be tested in a process of its own; the Serve
deployment wraps it. Three ways in: a prefilled request, either ``reserve``d before its
prefill (its KV streams in layer by layer while it computes) or ``accept``ed after it (its
KV is pulled then), ``submit_local`` a short prompt (prefilled here, skipping the prefill
pool), and, when a transfer fails, recompute the prompt here (policy ``recompute``) or
fail the request (policy ``fail``).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from duet.config import EngineArgs
from duet.engine import LLMEngine
from duet.kv_transfer import Endpoint, KVDestination, KVHandle, KVReceiver, engine_kv_spec
from duet.kv_transfer.transfer import STREAM_START_TIMEOUT_S
from duet.outputs import RequestOutput
from duet.request import Request
from duet.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FAILURE_POLICIES = ("recompute", "fail")


class NoKVCapacityError(RuntimeError):
    """The decode replica has no free blocks for this request's prompt right now; try another."""


@dataclass
class TransferFailure:
    request_id: str
    error: str


class DecodeNode:
    """An ``LLMEngine`` whose requests mostly arrive with their prompt's KV computed elsewhere."""

    def __init__(
        self,
        engine_args: EngineArgs,
        node_id: str,
        host: str = "127.0.0.1",
        local_prefill_threshold: int = 0,
        on_transfer_failure: str = "recompute",
        transfer_timeout_s: float = 30.0,
    ) -> None:
        if on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {FAILURE_POLICIES}, got {on_transfer_failure!r}")
        self.node_id = node_id
        self.local_prefill_threshold = local_prefill_threshold
        self.on_transfer_failure = on_transfer_failure
        self.engine = LLMEngine(engine_args)
        self.kv_spec = engine_kv_spec(self.engine)
        self.receiver = KVReceiver(self.engine.runner.kv_cache, self.kv_spec, host, transfer_timeout_s, name=node_id)
        self._incoming: dict[int, Request] = {}  # transfer id -> request whose KV is on its way
        self._aborted: set[str] = set()
        # Streamed requests whose KV has arrived (or failed) before their first token did.
        self._awaiting_first_token: dict[str, tuple[Request, bool, str | None]] = {}
        self.failures: list[TransferFailure] = []

    @property
    def endpoint(self) -> Endpoint:
        return self.receiver.endpoint

    @property
    def pending_transfers(self) -> int:
        """Requests reserved or accepted whose KV (or first token) has not arrived yet."""
        return len(self._incoming) + len(self._awaiting_first_token)

    @property
    def has_work(self) -> bool:
        return self.engine.scheduler.has_unfinished_requests() or self.pending_transfers > 0

    def wants_local_prefill(self, num_prompt_tokens: int) -> bool:
        return num_prompt_tokens < self.local_prefill_threshold

    def submit_local(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params)

    def accept(self, handle: KVHandle, params: SamplingParams) -> str:
        """Reserve blocks and expect the KV; returns the pair key the prefill node must send on."""
        request = self.engine.add_transferred_request(
            handle.request_id, list(handle.prompt_token_ids), handle.first_token_id, params
        )
        if request is None:
            raise NoKVCapacityError(f"no room for the {handle.num_kv_tokens}-token prompt of {handle.request_id}")
        return self._expect(handle.transfer_id, request, handle.source)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, source: str) -> KVDestination:
        """Choose this replica before prefill runs: blocks are reserved now, and the prefill
        node streams the KV into them while it computes (``PrefillNode.submit(destination=)``).
        The first token follows through ``set_first_token``."""
        request = self.engine.add_transferred_request(request_id, list(prompt_token_ids), None, params)
        if request is None:
            raise NoKVCapacityError(f"no room for the {len(prompt_token_ids)}-token prompt of {request_id}")
        transfer_id = secrets.randbits(62)
        # The prompt may wait behind others on the prefill replica before its layers stream.
        pair_key = self._expect(transfer_id, request, source, STREAM_START_TIMEOUT_S)
        return KVDestination(transfer_id, self.endpoint, pair_key)

    def _expect(self, transfer_id: int, request: Request, source: str, timeout_s: float | None = None) -> str:
        try:
            pair_key = self.receiver.expect(transfer_id, self.engine.kv_cache_manager.block_ids(request.request_id), source, timeout_s)
        except BaseException:
            self.engine.kv_cache_manager.free(request)
            self.engine.abort_request(request.request_id)
            raise
        self._incoming[transfer_id] = request
        return pair_key

    def set_first_token(self, request_id: str, token_id: int) -> None:
        incoming = self._find_incoming(request_id)
        request = incoming[1] if incoming is not None else None
        parked = self._awaiting_first_token.pop(request_id, None)
        if parked is not None:
            request = parked[0]
        if request is None:
            return  # aborted meanwhile
        self.engine.set_first_token(request, token_id)
        if parked is not None:
            self._continue(*parked)

    def _find_incoming(self, request_id: str) -> tuple[int, Request] | None:
        return next(((tid, request) for tid, request in self._incoming.items() if request.request_id == request_id), None)

    def step(self) -> list[RequestOutput]:
        """Admit arrived KV, handle failed transfers, then one engine step."""
        for result in self.receiver.poll():
            request = self._incoming.pop(result.transfer_id, None)
            if request is None:
                continue
            if request.request_id in self._aborted:
                self._aborted.discard(request.request_id)
                self.engine.kv_cache_manager.free(request)
            elif request.num_output_tokens == 0:
                self._awaiting_first_token[request.request_id] = (request, result.ok, result.error)
            else:
                self._continue(request, result.ok, result.error)
        return self.engine.step()

    def _continue(self, request: Request, arrived: bool, error: str | None = None) -> None:
        if arrived:
            self.engine.admit_transferred(request)
        else:
            self._on_failure(request, error or "transfer failed")

    def _on_failure(self, request: Request, error: str) -> None:
        logger.warning("KV of request %s did not arrive (%s); policy %s", request.request_id, error, self.on_transfer_failure)
        if self.on_transfer_failure == "recompute":
            self.engine.recompute_transferred(request)
        else:
            self.engine.kv_cache_manager.free(request)
            self.engine.abort_request(request.request_id)
            self.failures.append(TransferFailure(request.request_id, error))

    def abort(self, request_id: str) -> None:
        """Stop a request. Its transfer is cancelled; its blocks are freed when the receiver lets
        go of them (at once, unless the KV is being written into them right now)."""
        incoming = self._find_incoming(request_id)
        if incoming is not None:
            self._aborted.add(request_id)
            self.receiver.cancel(incoming[0])
        parked = self._awaiting_first_token.pop(request_id, None)
        if parked is not None:
            self.engine.kv_cache_manager.free(parked[0])
        self.engine.abort_request(request_id)

    def check_integrity(self) -> None:
        """Blocks are held only by requests in the engine and by KV on its way or parked."""
        in_transit = [request.request_id for request in self._incoming.values()]
        self.engine.check_integrity([*in_transit, *self._awaiting_first_token])

    def close(self) -> None:
        self.receiver.close()
