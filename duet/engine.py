"""The engine: a scheduler (with the KV connector's scheduler side) driving workers through an
executor. One request is one sequence of token ids; what comes out is ``TokenDelta``s. Text,
stop strings and ``n`` fan-out happen where text is made: the router, or the offline ``LLM``.

The same engine serves every role. A request with ``kv_send`` (on a prefill replica) stops
after its first token and its prompt KV goes to a decode replica; one with ``kv_receive`` (on
a decode replica) has its blocks reserved at once and joins the batch when its KV is in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time

import torch

from duet.block_pool import BlockIntegrityError
from duet.config import EngineArgs, import_object
from duet.dtypes import resolve_dtype, resolve_kv_cache_dtype
from duet.errors import InvalidRequestError, ReplicaFullError, WorkerDiedError
from duet.kv_cache_manager import KVCacheManager
from duet.kv_tier import KVTier
from duet.load import LoadTracker
from duet.lora import LoRAError, LoRASlots
from duet.messages import CoreStats, EngineRequest, EngineStats, KVDestination, TokenDelta
from duet.models.pipeline_parallel import stage_layers
from duet.models.tensor_parallel import check_layout
from duet.outputs import RunnerOutput, SchedulerOutput
from duet.request import Request
from duet.sampling_params import SamplingParams, fit_to_context
from duet.scheduler import Scheduler
from duet.spec_decode.draft_check import check_draft_model
from duet.structured_output import grammar_tokenizer
from duet.worker import WorkerConfig, kv_bytes_per_block

# A step that computed nothing and changed nothing (every request waits for KV on its way in or
# out) waits this long before the next: the loop would otherwise spin a core, about 50,000 empty
# steps a second, away from the prefill computing that KV on the same machine. A transfer that
# ends meanwhile is seen at most this much later.
IDLE_STEP_WAIT_S = 0.001

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns the scheduler and the executor; ``add_request``, then ``step`` until nothing is unfinished."""

    def __init__(self, args: EngineArgs) -> None:
        from transformers import AutoTokenizer

        from duet.models.loader import generation_eos_ids, max_positions, read_arch, resolve_model_path

        self.args = args
        model_path = resolve_model_path(args.model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self._tokenizer_path = str(model_path)
        self.eos_token_id = self.tokenizer.eos_token_id
        # generation_config.json's other EOS ids (Qwen and Gemma have several) end a sequence as
        # stop tokens do, unless it ignores EOS (as vLLM does).
        self.extra_eos_token_ids = tuple(token_id for token_id in generation_eos_ids(model_path) if token_id != self.eos_token_id)
        self.model_config = read_arch(model_path)
        self.dtype = resolve_dtype(args.dtype, args.device)
        self.scheduler_config = args.scheduler_config(max_positions(model_path))
        self.max_model_len = self.scheduler_config.max_model_len
        max_num_seqs = self.scheduler_config.max_num_seqs
        cache_config = args.cache_config()
        self.block_size = cache_config.block_size
        arch = self.model_config
        world_size = args.world_size
        # Checked here, before any worker starts; a rank's KV cache holds its own KV heads of its stage's layers.
        kv_heads_per_rank = check_layout(arch, args.tensor_parallel_size, args.enable_expert_parallel)
        layers_per_rank = max(len(stage_layers(arch.num_layers, args.pipeline_parallel_size, stage)) for stage in range(args.pipeline_parallel_size))
        self.kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.kv_bytes_per_block = kv_bytes_per_block(layers_per_rank, kv_heads_per_rank, arch.head_dim, self.block_size, self.kv_dtype)
        self.num_blocks = cache_config.num_blocks(self.kv_bytes_per_block)
        kv_offload = args.kv_offload_config()  # its fit checked by EngineArgs; an int8 tier's rows are the int8 cache's
        tier_dtype = torch.int8 if kv_offload is not None and kv_offload.quantized else self.kv_dtype
        tier_blocks = 0 if kv_offload is None else kv_offload.num_blocks(kv_bytes_per_block(layers_per_rank, kv_heads_per_rank, arch.head_dim, self.block_size, tier_dtype))
        self.speculative_config = args.speculative()
        self.kv_transfer_config = args.kv_transfer()
        self.pipeline_parallel_size = args.pipeline_parallel_size
        worker_config = WorkerConfig(
            model_path=str(model_path),
            dtype=str(self.dtype).removeprefix("torch."),
            device=args.device,
            max_model_len=self.max_model_len,
            quantization=args.quantization,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            eos_token_id=self.eos_token_id,
            seed=args.seed,
            kv_cache_dtype=args.kv_cache_dtype,
            speculative_config=self.speculative_config,
            draft_model_path=check_draft_model(self.speculative_config, self.model_config, self.tokenizer, self.eos_token_id, model_path),
            kv_transfer=self.kv_transfer_config,
            kv_offload=kv_offload,
            kv_tier_blocks=tier_blocks,
            world_size=world_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            lora_modules=tuple((args.lora_modules or {}).items()),
            max_lora_rank=args.max_lora_rank,
            max_loras=args.max_loras,
            max_cpu_loras=args.max_cpu_loras or args.max_loras,
            batch_invariant=args.batch_invariant,
            cascade_attention="off" if args.batch_invariant else args.cascade_attention,
            cuda_graph_max_num_seqs=0 if args.enforce_eager or args.device == "cpu" or world_size > 1 else max_num_seqs,
        )
        self.executor = import_object(args.executor())(worker_config)
        self.loras = LoRASlots(args.max_loras, args.lora_modules or {}, self.executor.check_lora)
        self.kv_endpoints = self.executor.kv_endpoints()
        tier = None if kv_offload is None else KVTier(tier_blocks)
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks, self.block_size, cache_config.enable_prefix_caching, tier, window=arch.kv_window
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            self.scheduler_config.max_num_seqs,
            self.scheduler_config.max_num_batched_tokens,
            self.max_model_len,
            self.scheduler_config.enable_chunked_prefill,
            self.speculative_config.num_lookahead_tokens if self.speculative_config else 0,
            self.loras,
            self.model_config.rope_original_max if self.model_config.rope_recompute else None,
            self.model_config.rope_cache_key,
        )
        self._logprobs: dict[str, list] = {}  # per request: top logprobs of tokens not yet reported
        self._prompt_logprobs: dict[str, list] = {}  # per request: its prompt tokens' top logprobs, until its first token
        self.load = LoadTracker()
        # The machine's cores, shared step by step with the other engines on it (``duet.cores``); the host sets it.
        self.core_share = None
        self.num_threads = torch.get_num_threads()  # its host sets them before it builds the engine
        logger.info(
            "engine ready: %s, %s, %d KV blocks of %d tokens in %s (%d bytes a block), max_model_len=%d, "
            "tensor_parallel_size=%d, pipeline_parallel_size=%d",
            model_path.name, self.dtype, self.num_blocks, self.block_size, str(self.kv_dtype).removeprefix("torch."),
            self.kv_bytes_per_block, self.max_model_len, args.tensor_parallel_size,
            args.pipeline_parallel_size,
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request fits; return its effective max_tokens."""
        if params.n != 1:
            raise InvalidRequestError("an engine request is one sequence: fan n out before (LLM and the router do)", "n")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        max_tokens = fit_to_context(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        if params.prompt_logprobs is not None and self.pipeline_parallel_size > 1:
            raise InvalidRequestError(
                "prompt_logprobs are not computed with pipeline parallelism (pipeline_parallel_size > 1)", "prompt_logprobs"
            )
        self.check_constraint(params)
        # A request may also hold slots for the draft tokens it writes past its last one.
        lookahead = self.scheduler.num_lookahead_tokens
        num_tokens, config = len(prompt_token_ids) + max_tokens, self.scheduler_config
        step = min(num_tokens, config.max_num_batched_tokens) if config.enable_chunked_prefill else num_tokens
        blocks_needed = self.kv_cache_manager.most_blocks_held(num_tokens + lookahead, step + lookahead)
        num_blocks = self.kv_cache_manager.block_pool.num_blocks  # (less the null block, with a window)
        if blocks_needed > num_blocks:
            raise InvalidRequestError(
                f"the request needs up to {blocks_needed} KV blocks but the cache has {num_blocks}; "
                "lower max_tokens or give the engine more KV memory", "max_tokens",
            )
        return max_tokens

    def check_constraint(self, params: SamplingParams) -> None:
        """Check a structured-output constraint against the model's tokenizer. A new constraint
        compiles (up to ~0.1 s, cached): a replica runs this off the engine thread."""
        if params.structured_outputs is not None:
            params.structured_outputs.check_tokens(self.grammar_tokenizer())

    def grammar_tokenizer(self):
        """llguidance's view of the model's tokenizer (``duet.structured_output.grammar_tokenizer``:
        built once per process, holding the GIL for ~0.25 s; a replica calls this before it serves)."""
        return grammar_tokenizer(self._tokenizer_path, self.model_config.vocab_size, self.eos_token_id)

    def check_lora(self, name: str, path: str | None) -> str:
        """The folder of LoRA adapter ``name`` (``path``, or the configured one), checked
        against the model the first time (loading it: a replica runs this off its engine thread first)."""
        try:
            return self.loras.resolve(name, path)
        except LoRAError as error:
            raise InvalidRequestError(str(error), "model") from None

    def add_request(self, request: EngineRequest) -> KVDestination | None:
        """Queue a sequence. With ``kv_receive`` its prompt's blocks are reserved now and the
        destination to hand the prefill replica is returned (``ReplicaFullError`` if no room)."""
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        lora_path = None if request.lora is None else self.check_lora(request.lora, request.lora_path)
        params = request.params
        if request.kv_send is None:
            max_tokens = self.validate(request.prompt_token_ids, params)
            if max_tokens != params.max_tokens:
                params = dataclasses.replace(params, max_tokens=max_tokens)
        else:  # computed here up to its first token, decoded elsewhere: that is what must fit here
            self.validate(request.prompt_token_ids, dataclasses.replace(params, max_tokens=1, min_tokens=0))
        if self.extra_eos_token_ids and not params.ignore_eos:
            stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.extra_eos_token_ids)))
            if stops != params.stop_token_ids:
                params = dataclasses.replace(params, stop_token_ids=stops)
        prompt_len = len(request.prompt_token_ids) if request.own_prompt_len is None else request.own_prompt_len
        arch = self.model_config
        # Phi-3's longrope: all of a sequence past its switch is long (a context's sequence has one more token).
        sequence_len = len(request.prompt_token_ids) + len(request.output_token_ids) + (request.own_prompt_len is not None)
        if arch.rope_recompute and sequence_len > arch.rope_original_max:
            prompt_len = max(prompt_len, sequence_len)
        queued = Request(
            request.request_id, request.prompt_token_ids, params, self.eos_token_id,
            output_token_ids=request.output_token_ids, kv_send=request.kv_send, lora=request.lora, lora_path=lora_path,
            prompt_len=prompt_len, cache_key=arch.rope_cache_key(prompt_len), num_pulled_tokens=request.kv_receive_tokens,
        )
        if request.kv_receive and self.kv_transfer_config is None:
            raise InvalidRequestError("this engine has no KV connector: it cannot receive prompt KV")
        request.check_pull()
        if params.logprobs is not None:
            self._logprobs[request.request_id] = []
        if params.prompt_logprobs is not None and not request.kv_receive and not request.output_token_ids:
            self._prompt_logprobs[request.request_id] = []
        if not request.kv_receive:
            self.scheduler.add_request(queued)
            return None
        transfer_id = secrets.randbits(62)
        if not self.scheduler.add_remote_request(queued, transfer_id):
            self._logprobs.pop(request.request_id, None)
            raise ReplicaFullError(f"no room for the {len(request.prompt_token_ids)}-token prompt of {request.request_id}")
        return KVDestination(transfer_id, self.kv_endpoints, self.kv_transfer_config.name)

    def freeze(self, request_id: str) -> list[int] | None:
        """Hold a decoding sequence still for a migration; its output tokens (None: it can move
        only by recompute). See ``Scheduler.freeze``."""
        return self.scheduler.freeze(request_id)

    def unfreeze(self, request_id: str) -> None:
        self.scheduler.unfreeze(request_id)

    def migrate(self, request_id: str, destination: KVDestination) -> bool:
        """Ship a frozen sequence's KV to another replica's reserved blocks and end it here."""
        if not self.scheduler.migrate(request_id, destination):
            return False
        self._logprobs.pop(request_id, None)  # all reported before it was frozen
        self._prompt_logprobs.pop(request_id, None)
        return True

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks come back (once no transfer uses them)."""
        self.scheduler.abort(request_id)
        self._logprobs.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[TokenDelta]:
        """Run one scheduling step; return what each sequence produced (or how it ended). With a
        ``core_share`` (``duet.cores``) the step computes on the threads its share gives, or a
        decoder skips it while prompts take the cores."""
        share = self.core_share
        # A prompt step's time includes its wait for decoders to yield: what the router and the
        # autoscalers read is the speed this engine gives, not the speed of its steps alone.
        started = time.perf_counter()
        plan = None
        if share is not None:
            scheduler = self.scheduler
            streams = [(r.request_id, r.num_output_tokens) for r in scheduler.running if r.output_token_ids]
            plan = share.before_step(streams, len(scheduler.waiting) + len(scheduler.running) + len(scheduler.prefilled))
            if plan is None:
                return []  # a decoder yielding to prompts (the engine loop waits a moment before the next)
        scheduler_output = self.scheduler.schedule(None if plan is None else plan.token_budget)
        failure = runner_output = None
        num_tokens = scheduler_output.total_num_scheduled_tokens
        with contextlib.nullcontext() if share is None else share.hold(num_tokens, plan.threads):
            try:
                # Even an empty step goes to the workers: it may carry finished ids and KV transfers.
                runner_output = self.executor.execute(scheduler_output)
            except WorkerDiedError:
                raise  # no request's fault, and no step can run again: the replica is replaced
            except Exception as error:  # noqa: BLE001 - one request's failure must not fail the others
                failure = error
            seconds = time.perf_counter() - started
        if failure is not None:
            return self._recover(scheduler_output, failure)
        self._observe_load(scheduler_output, runner_output, seconds)
        changed = self.scheduler.update_from_output(scheduler_output, runner_output)
        if not changed and scheduler_output.total_num_scheduled_tokens == 0 and not runner_output.kv_results:
            time.sleep(IDLE_STEP_WAIT_S)
        if runner_output.logprobs is not None:
            for request_id, logprobs in zip(runner_output.request_ids, runner_output.logprobs):
                if request_id in self._logprobs:
                    self._logprobs[request_id].extend(logprobs)
        for request_id, (position, entries) in runner_output.prompt_logprobs.items():
            scored = self._prompt_logprobs.get(request_id)
            if scored is not None and position <= len(scored) < position + len(entries):  # a prompt computed again (preempted) is scored once
                scored.extend(entries[len(scored) - position:])
        return [self._delta(request) for request in changed]

    def _observe_load(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput, seconds: float) -> None:
        num_decoding, num_decode_outputs = self.load.observe(scheduler_output, runner_output, seconds)
        if self.core_share is not None:
            self.core_share.observe_decode(num_decoding, num_decode_outputs)

    def _delta(self, request: Request) -> TokenDelta:
        if request.num_emitted_tokens == 0 and request.output_token_ids:
            self.load.observe_first_token(time.monotonic() - request.arrival_time)
        new_tokens = request.output_token_ids[request.num_emitted_tokens :]
        request.num_emitted_tokens = request.num_output_tokens
        logprobs = None
        if request.request_id in self._logprobs:
            pending = self._logprobs[request.request_id]
            logprobs, pending[:] = pending[: len(new_tokens)], []
        prompt_logprobs = None
        if new_tokens and request.request_id in self._prompt_logprobs:  # with the first token
            prompt_logprobs = [None, *self._prompt_logprobs.pop(request.request_id)]
        if request.is_finished:
            self._logprobs.pop(request.request_id, None)
            self._prompt_logprobs.pop(request.request_id, None)
            self.kv_cache_manager.remember_finished(request)
        return TokenDelta(
            request.request_id, new_tokens, logprobs, request.is_finished, request.finish_reason, request.stop_reason,
            request.num_cached_tokens, request.error, kv_lost=request.error is not None and request.finish_reason == "kv_lost",
            prompt_logprobs=prompt_logprobs,
        )

    def _recover(self, scheduler_output, error: Exception) -> list[TokenDelta]:
        """A step failed: workers and scheduler drop what it did; its requests rerun alone until
        the one that fails alone is found, and only that one fails (see ``Scheduler.reset_step``)."""
        request_ids = list(scheduler_output.num_scheduled_tokens)
        self.executor.forget(set(request_ids) | scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids)
        failed = self.scheduler.reset_step(scheduler_output)
        if not failed:
            logger.error(
                "engine step over %d requests failed (%r); rerunning them one at a time to find the cause",
                len(request_ids), error, exc_info=error,
            )
            return []
        for request in failed:
            logger.error("request %s failed in a step of its own (%r); failing it alone", request.request_id, error)
            request.error = f"the engine failed on this request ({type(error).__name__}: {error})"
        return [self._delta(request) for request in failed]

    def stats(self) -> EngineStats:
        """Counters and gauges for metrics and routing, each part from its owner (read off the
        engine thread)."""
        scheduler = self.scheduler
        return EngineStats(
            scheduler=scheduler.stats(),
            kv=self.kv_cache_manager.stats(
                kv_cache_dtype=self.args.kv_cache_dtype,
                kv_dtype=str(self.kv_dtype).removeprefix("torch."),
                kv_bytes_per_block=self.kv_bytes_per_block,
            ),
            transfer=scheduler.kv_connector.stats(),
            load=self.load.stats(),
            spec=scheduler.spec_stats.stats(),
            cores=self._core_stats(),
            lora=self.loras.stats(),
            worker_failure=self.worker_failure,
        )

    def _core_stats(self) -> CoreStats:
        share = self.core_share
        if share is None:
            return CoreStats(threads=self.num_threads, shared_cores=False, core_wait_s=0.0)
        return CoreStats(threads=share.last_threads, shared_cores=True, core_wait_s=share.waited_s)

    def cached_prefixes(self, block_hashes: list[int]) -> list[int]:
        """Those of ``block_hashes`` whose blocks are in the prefix cache (read off the engine
        thread: a stale answer only costs a routing choice)."""
        return [block_hash for block_hash in block_hashes if self.kv_cache_manager.is_cached(block_hash)]

    def check_integrity(self) -> None:
        """KV bookkeeping holds and every held block has a holder someone tracks: a request the
        scheduler knows, or a transfer the KV connector waits on. Idle, every block is free."""
        manager = self.kv_cache_manager
        manager.check_integrity()
        strays = sorted(set(manager.req_to_blocks) - set(self.scheduler.requests))
        stray_holds = sorted(set(manager.held) - self.scheduler.kv_connector.held)
        if strays or stray_holds:
            num_blocks = sum(len(manager.req_to_blocks[i]) for i in strays) + sum(len(manager.held[i]) for i in stray_holds)
            raise BlockIntegrityError(
                f"{num_blocks} blocks held for requests nobody tracks ({strays[:8]}) or transfers that ended ({stray_holds[:8]})"
            )

    def check_health(self) -> None:
        """Raise if a worker is gone (``WorkerDiedError``)."""
        self.executor.check_health()

    @property
    def worker_failure(self) -> str | None:
        """Why the engine cannot step any more (a worker died), once a step or a check found it."""
        return self.executor.failure

    def close(self) -> None:
        if self.core_share is not None:
            self.core_share.close()
        self.executor.close()
