"""The ingress's client API: OpenAI-compatible HTTP over the prefill and decode pools.

Per request: authorize, parse, tokenize (off the event loop), validate, admit (or 429), fan
``n`` and prompt lists out into sequences, run each through ``Orchestrator`` and merge their
deltas into one response or one SSE stream. A client that goes away cancels the handler, and
the orchestrator's clean-up frees the request's blocks in both pools.

``RouterIngress`` is not a deployment by itself: ``duet.cluster.admin`` adds the operators'
endpoints (``/duet/...``, their own key) and makes the Serve ingress of both.
"""

import asyncio
import hmac
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from duet.errors import InvalidRequestError
from duet.router.admission import AdmissionQueue, Admitted, QueueFullError, QueueWaitError
from duet.router.balance import StageBalancer
from duet.router.errors import ApiError, api_error_from, bad_request
from duet.router.metrics import RouterMetrics
from duet.router.pd import Orchestrator
from duet.router.chat import ChatRenderer
from duet.router.chat_request import ChatCompletionRequest, TokenizeRequest
from duet.router.protocol import BodyTooLargeError, CompletionRequest, DetokenizeRequest, parse_json_object, read_body
from duet.router.delivery import Form, respond
from duet.router.responses import ResponseBuilder, error_body
from duet.router.responses_api import ResponsesRequest
from duet.router.responses_output import ResponsesForm
from duet.router.roles import RoleKeeper, RoleSettings, RoleView
from duet.router.serve_internals import live_replicas, new_call_context, pool_members, pool_size, pool_stats
from duet.router.run import Run, SequenceSpec
from duet.router.tokenizer import RouterTokenizer
from duet.sampling_params import fit_to_context, truncate_prompt
from duet.tool_calls import HERMES, ToolFormat

app = FastAPI(title="duet", docs_url=None, redoc_url=None)


def _invalid(error: ValidationError) -> ApiError:
    """A body that does not parse: a 400 naming its first bad field."""
    first = max(error.errors(), key=lambda found: len(found["loc"]))  # the deepest: a union's branch that came closest
    param = ".".join(str(part) for part in first["loc"] if "[" not in str(part)) or None  # not the union's branch names
    return bad_request(f"{param}: {first['msg']}" if param else first["msg"], param)


def bearer_matches(request: Request, keys: list[bytes]) -> bool:
    """Whether the request's ``Authorization: Bearer`` token is one of ``keys`` (each compared
    in constant time, all of them, so the time taken says nothing of which came close)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token_bytes = token.strip().encode()
    matches = [hmac.compare_digest(token_bytes, key) for key in keys]
    return scheme.lower() == "bearer" and any(matches)


@app.exception_handler(ApiError)
async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return error.response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own refusals (no such route, wrong method) in OpenAI's shape."""
    error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {error.detail}"
    return JSONResponse(error_body(message, error_type, code=error.status_code), error.status_code, headers=error.headers)


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    return api_error_from(error).response()


class RouterIngress:
    """The client API's handlers (``duet.cluster.admin.DuetIngress`` is the deployment).
    ``prefill`` is None when colocated; ``api_keys``: the client keys, any one of which a
    request must bear (none: open); ``roles``: the application's ``roles`` section (None:
    each pool serves its own role)."""

    def __init__(
        self,
        prefill,
        decode,
        model_id: str,
        lora_modules: dict[str, str],
        model_dir: str,
        max_model_len: int,
        block_size: int,
        local_prefill_threshold: int,
        adaptive_local_prefill: bool,
        ttft_s: float,
        tpot_s: float,
        on_transfer_failure: str,
        max_migrations: int,
        max_running_sequences: int,
        max_queued_requests: int,
        max_queue_wait_s: float | None,
        max_prompts_per_request: int,
        max_body_bytes: int,
        api_keys: list[str],
        roles: dict | None = None,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "auto",
    ) -> None:
        self.model_id = model_id
        self.lora_modules = dict(lora_modules)  # the config's LoRA adapters (duet.lora), name: folder
        self.loras = dict(lora_modules)  # those a request's model may name now (``duet.cluster.admin`` loads and unloads)
        self.max_model_len = max_model_len
        self.max_body_bytes = max_body_bytes
        self.api_keys = [key.encode() for key in api_keys]
        self.tokenizer = RouterTokenizer(model_dir)
        self.chat = ChatRenderer(self.tokenizer, tool_call_parser, reasoning_parser)
        self.pools = {"colocated": decode} if prefill is None else {"prefill": prefill, "decode": decode}
        self.app_name = serve.get_replica_context().app_name
        balancer = view = self.role_keeper = None
        if prefill is not None:
            if roles is not None and roles["move"]:  # the balancer's 'pools' are the replicas serving each role
                view = RoleView(pool_members, pool_size)
                self.role_keeper = RoleKeeper(view, self.pools, RoleSettings(**roles), ttft_s, tpot_s, new_call_context)
            # Without adaptivity, the static threshold decides alone: no stats to read.
            stats = (lambda pool: None) if not adaptive_local_prefill else view.stats if view is not None else pool_stats
            balancer = StageBalancer(
                stats, pool_size if view is None else view.size, local_prefill_threshold, ttft_s, tpot_s, block_size=block_size
            )
        self.orchestrator = Orchestrator(prefill, decode, block_size, balancer, on_transfer_failure, max_migrations, view)
        self.max_prompts_per_request = max_prompts_per_request
        self.admission = AdmissionQueue(max_running_sequences, max_queued_requests, max_queue_wait_s)
        role_changes = (lambda: self.role_keeper.changes | {"shed": self.role_keeper.shed}) if self.role_keeper is not None else dict
        self.metrics = RouterMetrics(model_id, self._pool_stats, self.admission, self.orchestrator, self._autoscaler, role_changes)

    def _pool_stats(self) -> dict:
        return {pool: stats for pool in self.pools if (stats := pool_stats(pool)) is not None}

    def _autoscaler(self) -> dict[str, dict]:
        """The latest decision of each autoscaled pool's policy (the deployment knows them)."""
        return {}

    # -- open endpoints

    @app.get("/health")
    async def health(self) -> Response:
        """200 once a replica of every pool answers; 503 naming the pool that does not."""
        for name, pool in self.pools.items():
            try:
                await asyncio.wait_for(pool.check_health.remote(), 10)
            except Exception as error:  # noqa: BLE001 - any failure means not healthy
                reason = "no answer within 10 s" if isinstance(error, asyncio.TimeoutError) else str(getattr(error, "cause", None) or error)
                return ApiError(503, f"the {name} pool is not healthy: {reason}", "service_unavailable", retry_after=5).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        # Off the loop: a collector may wait on another process (the autoscalers' board).
        return Response(await asyncio.to_thread(generate_latest, self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- API endpoints

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        card = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "duet", "max_model_len": self.max_model_len}
        adapters = [card | {"id": name, "root": path, "parent": self.model_id} for name, path in sorted(self.loras.items())]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        try:
            prompts = body.prompts()
        except ValueError as error:
            raise bad_request(str(error), "prompt") from None
        if len(prompts) > self.max_prompts_per_request:
            raise bad_request(
                f"the request has {len(prompts)} prompts; this server takes at most {self.max_prompts_per_request} per request",
                "prompt",
            )
        try:
            body.check_best_of()
        except InvalidRequestError as error:
            raise bad_request(str(error), error.param) from None
        encoded = await asyncio.to_thread(self._encode_prompts, prompts)
        truncated = [self._truncate(body, ids) for ids in encoded]
        prompts = [prompt if len(ids) == len(kept) else kept for prompt, ids, kept in zip(prompts, encoded, truncated)]
        encoded = truncated
        # best_of ranks sequences by the log-probability of their tokens: they carry theirs.
        logprobs = body.logprobs if body.num_sequences == body.n else max(body.logprobs or 0, 0)
        echo_prompts = None
        if body.echo:  # each prompt as sent, or its tokens' text (none where one is not a token id: the engine refuses it)
            echo_prompts = await asyncio.to_thread(
                lambda: [(prompt if isinstance(prompt, str) else self.tokenizer.decode(ids) or "", ids)
                         for prompt, ids in zip(prompts, encoded)]
            )
        return await self._generate(body, encoded, body.max_tokens, logprobs, chat=False, echo_prompts=echo_prompts)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._chat(await self._parse(request, ChatCompletionRequest))

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, through the chat path (``duet.router.responses_api``)."""
        body = await self._parse(request, ResponsesRequest)
        try:
            chat = body.chat_request()
        except ValidationError as error:
            raise _invalid(error) from None
        except InvalidRequestError as error:
            raise bad_request(str(error), error.param) from None
        return await self._chat(chat, ResponsesForm(body))

    async def _chat(self, body: ChatCompletionRequest, form: Form | None = None) -> Response:
        try:
            prompt = await asyncio.to_thread(self.chat.prompt, body)
        except InvalidRequestError as error:
            raise bad_request(str(error), error.param) from None
        return await self._generate(
            body, [self._truncate(body, prompt.token_ids)], body.effective_max_tokens, body.num_logprobs, chat=True, reads_calls=prompt.reads_calls,
            reasoning_mode=prompt.reasoning_mode, form=form,
        )

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        body = await self._parse(request, TokenizeRequest)
        try:
            chat = body.chat()
            if chat is None:
                tokens = await asyncio.to_thread(self.tokenizer.encode, body.prompt, body.add_special_tokens)
            else:
                tokens = await asyncio.to_thread(lambda: self.tokenizer.encode_chat_text(self.chat.render(chat)))
        except InvalidRequestError as error:
            raise bad_request(str(error), error.param) from None
        return JSONResponse({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": None})

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        body = await self._parse(request, DetokenizeRequest)
        text = await asyncio.to_thread(self.tokenizer.decode, body.tokens)
        if text is None:
            raise bad_request(f"tokens: every id must be in [0, {self.tokenizer.vocab_size})", "tokens")
        return JSONResponse({"prompt": text})

    # -- the request pipeline

    def _authorize(self, request: Request) -> None:
        if self.api_keys and not bearer_matches(request, self.api_keys):
            raise ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'", "authentication_error")

    async def _parse(self, request: Request, schema):
        self._authorize(request)
        payload = await self._json_object(request)
        try:
            body = schema.model_validate(payload)
        except ValidationError as error:
            raise _invalid(error) from None
        self._adapter(body.model)
        return body

    def _adapter(self, model: str) -> tuple[str, str] | None:
        """The LoRA adapter ``model`` names, name and folder (None: the base model); else OpenAI's 404."""
        if model == self.model_id:
            return None
        path = self.loras.get(model)
        if path is None:
            served = ", ".join(repr(name) for name in (self.model_id, *sorted(self.loras)))
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}", "not_found_error", "model")
        return model, path

    async def _json_object(self, request: Request) -> dict:
        """The body, read within ``max_body_bytes`` (413 past it), as a JSON object (400 if not one)."""
        too_large = ApiError(413, f"request body over the {self.max_body_bytes}-byte limit", "invalid_request_error")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        try:
            raw = await read_body(request.stream(), self.max_body_bytes)
        except BodyTooLargeError:
            raise too_large from None
        try:
            return parse_json_object(raw)
        except ValueError as error:
            raise bad_request(str(error)) from None

    def _encode_prompts(self, prompts: list) -> list[list[int]]:
        encoded = []
        for prompt in prompts:
            if isinstance(prompt, str):
                encoded.append(self.tokenizer.encode(prompt))
            elif all(isinstance(token, int) for token in prompt):
                encoded.append(list(prompt))
            else:
                raise bad_request("prompt must be a string, a list of strings, or lists of token ids", "prompt")
        return encoded

    def _truncate(self, body, prompt_token_ids: list[int]) -> list[int]:
        """The prompt as the request's ``truncate_prompt_tokens`` asks."""
        try:
            return truncate_prompt(prompt_token_ids, body.truncate_prompt_tokens, self.max_model_len)
        except InvalidRequestError as error:
            raise bad_request(str(error), error.param) from None

    def _sequences(
        self,
        body,
        encoded: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        reasoning_mode: str | None = None,
        tool_format: ToolFormat | None = None,
    ) -> list[SequenceSpec]:
        sequences = []
        for prompt_index, prompt_token_ids in enumerate(encoded):
            try:
                budget = fit_to_context(len(prompt_token_ids), max_tokens, self.max_model_len)
                params = body.sampling_params(budget, logprobs, tool_format or HERMES, reasoning_mode)
                if params.structured_outputs is not None:
                    params.structured_outputs.check_tokens(self.tokenizer.grammar_tokenizer())
            except InvalidRequestError as error:
                raise bad_request(str(error), error.param) from None
            for index in range(body.num_sequences):
                choice = prompt_index * body.num_sequences + index
                sequences.append(SequenceSpec(choice, prompt_index, body.sequence_params(params, index)))
        return sequences

    def _check_pools(self) -> None:
        """Every sequence needs the decoding pool: refused (503) once all its replicas have been
        silent for ``POOL_DOWN_S``. Reports reach this process through Serve's controller, which
        a loaded machine holds up for seconds at a time (every pool's reports then age together);
        a replica that truly stopped fails Serve's health check and leaves the pool sooner. A
        silent prefill pool refuses nothing: its contexts are computed on decode when a call to
        it fails, and all of them there once Serve lists none of its replicas."""
        name = self.orchestrator.decode_pool
        if self.role_keeper is not None:
            self.role_keeper.start()
        if live_replicas(name) == 0 and not (self.role_keeper is not None and live_replicas("prefill")):  # a prefill replica takes decode
            self.metrics.rejected.labels(self.model_id, "503").inc()
            raise ApiError(503, f"the {name} pool has no healthy replica; retry later", "service_unavailable", retry_after=5)

    async def _generate(
        self,
        body,
        encoded,
        max_tokens,
        logprobs,
        chat: bool,
        reads_calls: ToolFormat | None = None,
        reasoning_mode: str | None = None,
        echo_prompts: list[tuple[str, list[int]]] | None = None,
        form: Form | None = None,
    ) -> Response:
        """``reads_calls``: tool calls in this format are read from the output; ``reasoning_mode``:
        its reasoning is parted from its content, and its constraint applies after it
        (``duet.reasoning``); ``echo_prompts``: each prompt's text and tokens go before its output;
        ``form`` writes the answer out (``duet.router.delivery``)."""
        if body.response_format is not None or body.structured_outputs is not None or reads_calls:
            # Checking a new constraint takes milliseconds: off the loop that streams every response.
            sequences = await asyncio.to_thread(self._sequences, body, encoded, max_tokens, logprobs, reasoning_mode, reads_calls)
        else:
            sequences = self._sequences(body, encoded, max_tokens, logprobs, reasoning_mode)
        lora = self._adapter(body.model)
        self._check_pools()
        arrival = time.monotonic()
        try:
            queued_s = await self.admission.acquire(len(sequences))
        except QueueFullError as error:
            self.metrics.rejected.labels(self.model_id, "429").inc()
            raise ApiError(429, f"the server is at capacity: {error}", "rate_limit_error", retry_after=1) from None
        except QueueWaitError as error:
            self.metrics.rejected.labels(self.model_id, "503").inc()
            retry_after = min(60, math.ceil(error.retry_after_s))
            raise ApiError(503, f"the server is overloaded: {error}", "service_unavailable", retry_after=retry_after) from None
        admitted = Admitted(self.admission, len(sequences))
        self.metrics.queue_time.observe(queued_s)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        want_logprobs = (body.num_logprobs if chat else body.logprobs) is not None
        builder = ResponseBuilder(
            request_id, body.model, chat, self.tokenizer.token_text, want_logprobs, body.return_token_ids, reads_calls, reasoning_mode,
            echo_prompts, body.n,
        )
        run = Run(
            self.orchestrator, self.tokenizer, self.metrics, request_id, encoded, sequences, arrival, self.tokenizer.skipped_ids(reads_calls),
            lora=lora,
        )
        return await respond(run, builder, body, admitted, form)
