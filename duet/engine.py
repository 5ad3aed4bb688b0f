"""The single-process engine: scheduler, runner and detokenizer in one step loop."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from duet.block_pool import BlockIntegrityError
from duet.config import ConfigError, EngineArgs, resolve_dtype
from duet.detokenizer import IncrementalDetokenizer
from duet.kv_cache_manager import KVCacheManager
from duet.model_runner import ModelRunner
from duet.outputs import CompletionOutput, RequestOutput
from duet.request import Request, RequestStatus
from duet.sampling_params import SamplingParams
from duet.scheduler import Scheduler

logger = logging.getLogger(__name__)


class RequestValidationError(ValueError):
    """A request cannot be served as given; the message says what to change."""


@dataclass
class _Tracked:
    """A user request: its ``n`` child sequences and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    logprobs: list[list[dict[int, float]]] | None
    first_token_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class LLMEngine:
    """Owns the model and KV cache; ``add_request`` then ``step`` until nothing is unfinished."""

    def __init__(self, args: EngineArgs) -> None:
        from transformers import AutoTokenizer

        from duet.models.loader import load_model, max_positions, resolve_model_path

        torch.manual_seed(args.seed)
        self.args = args
        model_path = resolve_model_path(args.model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        dtype = resolve_dtype(args.dtype, args.device)
        model_max_len = max_positions(model_path)
        self.scheduler_config = args.scheduler_config(model_max_len)
        self.max_model_len = self.scheduler_config.max_model_len
        model = load_model(model_path, dtype, args.device, self.max_model_len)
        self.model_config = model.arch
        self.dtype = dtype
        cache_config = args.cache_config()
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks(ModelRunner.kv_bytes_per_block(model.arch, self.block_size, dtype))
        self.eos_token_id = self.tokenizer.eos_token_id
        self.kv_cache_manager = KVCacheManager(self.num_blocks, self.block_size, cache_config.enable_prefix_caching)
        self.speculative_config = args.speculative()
        draft_model = self._load_draft_model(model_path, model.arch) if self.speculative_config else None
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            self.scheduler_config.max_num_seqs,
            self.scheduler_config.max_num_batched_tokens,
            self.max_model_len,
            self.scheduler_config.enable_chunked_prefill,
            self.speculative_config.num_lookahead_tokens if self.speculative_config else 0,
        )
        self.runner = ModelRunner(
            model, self.num_blocks, self.block_size, dtype, args.device, self.eos_token_id, self.max_model_len,
            self.speculative_config, draft_model,
        )
        if args.device == "cpu":
            from duet.kernels import cpu_ops

            cpu_ops.load()  # compile (once per machine) now, not inside the first step
        self._tracked: dict[str, _Tracked] = {}
        self._child_to_parent: dict[str, str] = {}
        # Requests the last step ran and then restarted (it failed): the KV it wrote is gone.
        self.restarted_request_ids: list[str] = []
        logger.info(
            "engine ready: %s, %s, %d KV blocks of %d tokens, max_model_len=%d",
            model_path.name, dtype, self.num_blocks, self.block_size, self.max_model_len,
        )

    def _load_draft_model(self, model_path, arch):
        """Check the speculative config against the target; return the draft model that
        ``draft_model`` speculation runs (checked to share the tokenizer), else None."""
        from transformers import AutoTokenizer

        from duet.models.loader import load_model, resolve_model_path

        config = self.speculative_config
        if config.method == "layer_skip":
            if config.num_draft_layers >= arch.num_layers:
                raise ConfigError(
                    f"speculative_config.num_draft_layers={config.num_draft_layers} must be below the "
                    f"target's {arch.num_layers} layers"
                )
            return None
        if config.method != "draft_model":
            return None
        draft_path = resolve_model_path(config.model)
        draft_tokenizer = AutoTokenizer.from_pretrained(str(draft_path))
        if draft_tokenizer.get_vocab() != self.tokenizer.get_vocab() or draft_tokenizer.eos_token_id != self.eos_token_id:
            raise ConfigError(
                f"the draft model {config.model!r} does not share the target's tokenizer ({model_path.name}); "
                "speculative decoding needs a draft with the same vocabulary"
            )
        draft = load_model(draft_path, self.dtype, self.args.device, self.max_model_len)
        if draft.arch.vocab_size != arch.vocab_size:
            raise ConfigError(
                f"the draft model's output has {draft.arch.vocab_size} logits but the target's has {arch.vocab_size}"
            )
        logger.info("draft model %s: %d layers, hidden size %d", draft_path.name, draft.arch.num_layers, draft.arch.hidden_size)
        return draft

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request fits; return its effective max_tokens."""
        if not prompt_token_ids:
            raise RequestValidationError("the prompt is empty; send at least one token")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestValidationError(f"prompt token ids must be integers in [0, {vocab})")
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise RequestValidationError(
                f"the prompt has {num_prompt} tokens but max_model_len is {self.max_model_len}; "
                "shorten the prompt so at least one token can be generated"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise RequestValidationError(
                f"max_tokens={max_tokens} exceeds max_model_len={self.max_model_len} minus the "
                f"{num_prompt} prompt tokens; ask for at most {self.max_model_len - num_prompt}"
            )
        # A request may also hold slots for the draft tokens it writes past its last one.
        lookahead = self.scheduler.num_lookahead_tokens
        blocks_needed = -(-(num_prompt + max_tokens + lookahead) // self.block_size)
        if blocks_needed > self.num_blocks:
            raise RequestValidationError(
                f"the request needs up to {blocks_needed} KV blocks but the cache has {self.num_blocks}; "
                "lower max_tokens or give the engine more KV memory"
            )
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        if request_id in self._tracked:
            raise RequestValidationError(f"request id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        children = []
        for index in range(params.n):
            child_params = dataclasses.replace(params.choice(index), max_tokens=max_tokens)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            children.append(Request(child_id, prompt_token_ids, child_params, self.eos_token_id))
        self._track(request_id, prompt, prompt_token_ids, children, params)
        for child in children:
            self.scheduler.add_request(child)

    def _track(self, request_id, prompt, prompt_token_ids, children: list[Request], params: SamplingParams) -> None:
        """Follow a user request's children: detokenizers, logprobs, timing."""
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens)
            for _ in children
        ]
        logprobs = [[] for _ in children] if params.logprobs is not None else None
        tracked = _Tracked(request_id, prompt, list(prompt_token_ids), children, detokenizers, logprobs)
        tracked.metrics["arrival_time"] = time.monotonic()
        self._tracked[request_id] = tracked
        for child in children:
            self._child_to_parent[child.request_id] = request_id

    def add_transferred_request(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int | None, params: SamplingParams
    ) -> Request | None:
        """Track a request whose prompt KV another replica computes; it gets blocks for that KV
        now (None when the cache has no room) and joins the batch at ``admit_transferred``.
        The first token may be given later, with ``set_first_token``."""
        if params.n != 1:
            raise RequestValidationError("a prefilled request carries one completion; fan out n before prefill")
        if request_id in self._tracked:
            raise RequestValidationError(f"request id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        request = Request(request_id, prompt_token_ids, dataclasses.replace(params, max_tokens=max_tokens), self.eos_token_id)
        if self.kv_cache_manager.allocate_for_transfer(request, len(prompt_token_ids)) is None:
            return None
        self._track(request_id, None, prompt_token_ids, [request], params)
        if first_token_id is not None:
            self.set_first_token(request, first_token_id)
        return request

    def set_first_token(self, request: Request, token_id: int) -> None:
        """The token the prefill replica sampled (and the client has already received)."""
        request.append_output_token_ids([token_id])
        self._tracked[request.request_id].detokenizers[0].add_tokens([token_id])

    def admit_transferred(self, request: Request) -> None:
        """The prompt KV has arrived: publish its blocks and let the request decode."""
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv_cache_manager.cache_received(request)
        self.scheduler.add_prefilled_request(request)

    def recompute_transferred(self, request: Request) -> None:
        """The KV never arrived: compute the prompt (and first token) here instead."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        for child in tracked.children:
            self.scheduler.abort(child.request_id)
            self._child_to_parent.pop(child.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the requests that gained tokens (cumulative outputs)."""
        scheduler_output = self.scheduler.schedule()
        self.restarted_request_ids = []
        try:
            # Even an empty step goes to the runner: it may carry finished ids to forget.
            runner_output = self.runner.execute(scheduler_output)
        except Exception as error:  # noqa: BLE001 - one request's failure must not fail the others
            return self._recover(scheduler_output, error)
        changed = self.scheduler.update_from_output(scheduler_output, runner_output)
        logprobs_by_id = {}
        if runner_output.logprobs is not None:
            logprobs_by_id = dict(zip(runner_output.request_ids, runner_output.logprobs))
        now = time.monotonic()
        touched: dict[str, _Tracked] = {}
        for child in changed:
            parent_id = self._child_to_parent.get(child.request_id)
            tracked = self._tracked.get(parent_id) if parent_id else None
            if tracked is None:
                continue
            index = tracked.children.index(child)
            self._detokenize(tracked, index, child, logprobs_by_id.get(child.request_id))
            if tracked.first_token_time is None:
                tracked.first_token_time = now
                tracked.metrics["first_token_time"] = now
            touched[parent_id] = tracked
        return [self._make_output(tracked, now) for tracked in touched.values()]

    def _recover(self, scheduler_output, error: Exception) -> list[RequestOutput]:
        """A step failed: runner and scheduler drop what it did; its requests rerun alone until
        the one that fails alone is found, and only that one fails (see ``Scheduler.reset_step``)."""
        request_ids = list(scheduler_output.num_scheduled_tokens)
        self.runner.forget(
            set(request_ids) | scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids
        )
        failed = self.scheduler.reset_step(scheduler_output)
        if not failed:
            self.restarted_request_ids = request_ids
            logger.error(
                "engine step over %d requests failed (%r); rerunning them one at a time to find the cause",
                len(request_ids), error, exc_info=error,
            )
            return []
        outputs = []
        for child in failed:
            logger.error("request %s failed in a step of its own (%r); failing it alone", child.request_id, error)
            tracked = self._tracked.get(self._child_to_parent.get(child.request_id, ""))
            if tracked is not None:
                message = f"the engine failed on this request ({type(error).__name__}: {error})"
                outputs.append(self._fail(tracked, message))
        return outputs

    def _fail(self, tracked: _Tracked, message: str) -> RequestOutput:
        """End a user request with an error; its other completions stop too."""
        for child in tracked.children:
            self.scheduler.abort(child.request_id)
        output = self._make_output(tracked, time.monotonic())
        output.error = message
        return output

    def _detokenize(self, tracked: _Tracked, index: int, child: Request, step_logprobs) -> None:
        detokenizer = tracked.detokenizers[index]
        new_tokens = child.output_token_ids[detokenizer.num_tokens :]
        if tracked.logprobs is not None and step_logprobs:
            tracked.logprobs[index].extend(step_logprobs[: len(new_tokens)])
        stop = detokenizer.add_tokens(new_tokens)
        if stop is not None and not child.is_finished:
            child.stop_reason = stop
            child.truncate_output(detokenizer.num_tokens)
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_STOPPED)

    def _make_output(self, tracked: _Tracked, now: float) -> RequestOutput:
        outputs = []
        for index, (child, detokenizer) in enumerate(zip(tracked.children, tracked.detokenizers)):
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=detokenizer.stream_text(child.is_finished),
                    token_ids=list(child.output_token_ids),
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                    logprobs=tracked.logprobs[index] if tracked.logprobs is not None else None,
                )
            )
        finished = all(child.is_finished for child in tracked.children)
        if finished:
            tracked.metrics["finished_time"] = now
            self._tracked.pop(tracked.request_id, None)
            for child in tracked.children:
                self._child_to_parent.pop(child.request_id, None)
        return RequestOutput(
            request_id=tracked.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=tracked.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=min(child.num_cached_tokens for child in tracked.children),
            metrics=dict(tracked.metrics),
        )

    def stats(self) -> dict:
        """Counters and gauges for metrics and routing."""
        scheduler, manager = self.scheduler, self.kv_cache_manager
        spec = scheduler.spec_stats
        return dict(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(scheduler.prefilled),
            num_free_blocks=manager.num_free_blocks,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
        )

    def check_integrity(self, held_for_transfer: Collection[str] = ()) -> None:
        """KV bookkeeping holds and every held block has a holder someone tracks: a request the
        scheduler knows, or one whose KV is in transit (``held_for_transfer``, given by the node
        moving it). With no request in flight, every block is free."""
        manager = self.kv_cache_manager
        manager.check_integrity()
        known = set(self.scheduler.requests) | set(held_for_transfer)
        strays = sorted({*manager.req_to_blocks, *manager.pinned} - known)
        if strays:
            num_blocks = sum(len(manager.req_to_blocks.get(i, [])) + len(manager.pinned.get(i, [])) for i in strays)
            raise BlockIntegrityError(f"{num_blocks} blocks held for {len(strays)} requests nobody tracks: {strays[:8]}")
