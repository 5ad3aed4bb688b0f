"""Turns a ``SchedulerOutput`` into one forward pass and sampled tokens, on one worker.

The runner keeps its own copy of each request's tokens and block table (``runner_state``),
updated from the scheduler's diffs: the scheduler's block table is the only authority.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from duet.block_pool import NULL_BLOCK_ID
from duet.config import SpeculativeConfig
from duet.cuda_graphs import DecodeGraphs, unsupported
from duet.grammar_masks import GrammarMasks, MaskJob
from duet.kernels import cpu_ops
from duet.kernels.cascade import CascadePlanner, fit_rule
from duet.kernels.fused import greedy_argmax
from duet.kernels.kv_quant import row_width
from duet.lora import LoRAAdapter, LoRAStep, applied, decoder_of
from duet.model_inputs import BatchInputs, Span, build_batch
from duet.outputs import RunnerOutput, SchedulerOutput
from duet.runner_state import CachedRequestState
from duet.sampler import Sampler, advance_generator, build_sampling_metadata, make_generator, top_logprobs
from duet.spec_decode.decoder import SpeculativeDecoder
from duet.spec_decode.proposers import ModelProposer, NgramProposer


class ModelRunner:
    """Owns the model, the paged KV cache, the sampler, the matchers of constrained requests
    (``tokenizer_path``: where their grammars find the model's tokenizer) and, when configured,
    the speculative decoder."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: str,
        eos_token_id: int | None,
        max_model_len: int,
        speculative_config: SpeculativeConfig | None = None,
        draft_model: torch.nn.Module | None = None,
        tokenizer_path: str | None = None,
        cascade_attention: str = "off",
    ) -> None:
        arch = model.arch
        self.model = model
        self.block_size = block_size
        self.device = device
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.vocab_size = arch.vocab_size
        self.graphs: DecodeGraphs | None = None  # the decode step's CUDA graphs (capture_decode_graphs)
        self.kv_cache, self.kv_caches = allocate_kv_cache(arch, num_blocks, block_size, kv_dtype, device)
        self.cascade = _cascade_planner(cascade_attention, arch, next(model.parameters()).dtype, kv_dtype, block_size, device)
        self.requests: dict[str, CachedRequestState] = {}
        self.loras: dict[str, LoRAAdapter] = {}  # the adapters requests may name (``add_lora``)
        self.sampler = Sampler()
        self.grammar = None
        if tokenizer_path is not None:
            self.grammar = GrammarMasks(tokenizer_path, self.vocab_size, eos_token_id, overlap=device != "cpu")
        self.spec = None
        if speculative_config is not None:
            proposer = _make_proposer(speculative_config, self, draft_model, num_blocks, kv_dtype)
            self.spec = SpeculativeDecoder(speculative_config, proposer, self.vocab_size, max_model_len, eos_token_id)

    def capture_decode_graphs(self, max_num_seqs: int) -> str | None:
        """Capture the decode step in CUDA graphs for batches up to ``max_num_seqs``
        (``duet.cuda_graphs``); why not, where the model's forward cannot be captured."""
        reason = unsupported(self.model, self.kv_cache)
        if reason is not None:
            return reason
        try:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs, -(-self.max_model_len // self.block_size), self.device)
        except RuntimeError as error:  # the capture refused (an operation it cannot hold): the steps stay eager
            return f"the capture failed: {error}"
        return None

    def forget(self, request_ids) -> None:
        """Drop what the runner holds of these requests; one it meets again is sent whole."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            if self.grammar is not None:
                self.grammar.forget(request_id)
            if self.spec is not None:
                self.spec.forget(request_id)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        self.forget(scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids)
        for new in scheduler_output.new_requests:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = make_generator(params.seed, self.device)
                # A request resumed (after preemption, or on another replica) continues its random
                # stream where it stopped: one race per token already sampled, with speculation or
                # without (see duet.spec_decode.rejection).
                if not params.greedy:
                    advance_generator(generator, self.vocab_size, len(new.output_token_ids))
            self.requests[new.request_id] = CachedRequestState(
                new.request_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                params,
                list(new.block_ids),
                new.num_computed_tokens,
                generator,
                new.lora,
                len(new.prompt_token_ids) if new.prompt_len is None else new.prompt_len,
            )
        for cached in scheduler_output.cached_requests:
            state = self.requests[cached.request_id]
            del state.block_ids[cached.num_kept_blocks :]
            state.block_ids.extend(cached.new_block_ids)
            state.block_ids[: cached.num_dropped_blocks] = [NULL_BLOCK_ID] * cached.num_dropped_blocks
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput, request_ids: list[str] | None = None
    ) -> tuple[BatchInputs, torch.Tensor, list[str], list[tuple[str, int, int]]]:
        """The flat batch (of ``request_ids``, default the step's), the rows to compute logits for,
        the requests the sampling rows belong to (one row each, or one per draft token plus one
        for a request verifying drafts), and after them one row per prompt position whose next
        prompt token a request scores (``prompt_logprobs``): (request, position, that token)."""
        spans, logits_rows, row_owners, scored, scored_rows = [], [], [], [], []
        offset = 0
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id in scheduled if request_ids is None else request_ids:
            num_tokens = scheduled[request_id]
            state = self.requests[request_id]
            drafts = scheduler_output.scheduled_spec_token_ids.get(request_id, [])
            start = state.num_computed_tokens
            end = start + num_tokens - len(drafts)
            spans.append(Span(state.token_slice(start, end) + drafts, start, state.block_ids, state.prompt_len))
            if state.sampling_params.prompt_logprobs is not None:
                prompt = state.prompt_token_ids
                for position in range(start, min(end, len(prompt) - 1)):
                    scored_rows.append(offset + position - start)
                    scored.append((request_id, position, prompt[position + 1]))
            offset += num_tokens
            if end == state.num_tokens:
                num_rows = len(drafts) + 1
                logits_rows.extend(range(offset - num_rows, offset))
                row_owners.extend([request_id] * num_rows)
        batch = build_batch(spans, self.block_size, self.device, self.cascade)
        return batch, torch.tensor(logits_rows + scored_rows, dtype=torch.long, device=self.device), row_owners, scored

    def add_lora(self, adapter: LoRAAdapter) -> None:
        """Let requests name ``adapter``: its modules' updates apply to their rows."""
        self.loras[adapter.name] = adapter
        for name, module in decoder_of(self.model).named_modules():
            if name in adapter.weights:
                module.lora_name = name

    def _lora_step(self, scheduler_output: SchedulerOutput, request_ids: list[str] | None = None) -> LoRAStep | None:
        """The step's flat rows by adapter (``_prepare_inputs``' order), or those of ``request_ids``
        alone (a pipeline's micro-batch); None if no row has one."""
        if not self.loras:
            return None
        slots: dict[str, int] = {}
        row_slots: list[int] = []
        for request_id in scheduler_output.num_scheduled_tokens if request_ids is None else request_ids:
            lora, num_tokens = self.requests[request_id].lora, scheduler_output.num_scheduled_tokens[request_id]
            row_slots.extend([-1 if lora is None else slots.setdefault(lora, len(slots))] * num_tokens)
        if not slots:
            return None
        missing = sorted(set(slots) - set(self.loras))
        if missing:  # its load failed (its folder changed since the engine checked it): its requests fail
            raise RuntimeError(f"LoRA adapter {missing[0]!r} is not loaded here: its load from its folder failed")
        return LoRAStep([self.loras[name] for name in slots], row_slots, self.device)

    def _prompt_logprobs(self, logits: torch.Tensor, scored: list[tuple[str, int, int]]) -> dict[str, tuple[int, list[dict[int, float]]]]:
        """Each scoring request's first scored position and its prompt tokens' top logprobs."""
        nums = [self.requests[request_id].sampling_params.prompt_logprobs for request_id, _, _ in scored]
        entries = top_logprobs(logits.float().log_softmax(dim=-1), [token for _, _, token in scored], nums)
        out: dict[str, tuple[int, list[dict[int, float]]]] = {}
        for (request_id, position, _), entry in zip(scored, entries):
            out.setdefault(request_id, (position, []))[1].append(entry)
        return out

    def _forbidden_token_ids(self, state: CachedRequestState) -> tuple[int, ...]:
        """Tokens the request may not take next: EOS and its stop token ids before ``min_tokens``."""
        params = state.sampling_params
        # A complete constraint allows EOS alone: min_tokens cannot hold the output open.
        if len(state.output_token_ids) >= params.min_tokens or (self.grammar is not None and self.grammar.only_eos_left(state)):
            return ()
        return tuple(params.stop_token_ids) + (() if self.eos_token_id is None else (self.eos_token_id,))

    def _greedy_exclusions(self, row_owners: list[str], spec_token_ids: dict[str, list[int]], masks: MaskJob | None):
        """``[rows, E]`` token ids each row may not take (-1 pads), when the step needs no more of
        its logits than each row's greedy token — every row greedy, without penalties, logprobs,
        a grammar's mask or drafts to verify — so that the LM head need not write them; else None."""
        if not row_owners or spec_token_ids or masks is not None:
            return None
        states = [self.requests[request_id] for request_id in row_owners]
        if any(not p.greedy or p.has_penalties or p.logprobs is not None for p in (state.sampling_params for state in states)):
            return None
        forbidden = [[t for t in self._forbidden_token_ids(state) if t < self.vocab_size] for state in states]
        width = max(map(len, forbidden))
        return torch.tensor([ids + [-1] * (width - len(ids)) for ids in forbidden], dtype=torch.long, device=self.device)

    def _sampling_metadata(self, request_ids: list[str]):
        states = [self.requests[request_id] for request_id in request_ids]
        return build_sampling_metadata(
            params=[state.sampling_params for state in states],
            prompt_token_ids=[state.prompt_token_ids for state in states],
            output_token_ids=[state.output_token_ids for state in states],
            generators=[state.generator for state in states],
            forbidden_token_ids=[self._forbidden_token_ids(state) for state in states],
            vocab_size=self.vocab_size,
            device=self.device,
        )

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None) -> RunnerOutput:
        """One forward over the step's tokens, then sampling (and drafts for the next step).
        ``on_layer_done(i)`` is called once layer ``i``'s KV is in the cache."""
        self._update_states(scheduler_output)
        request_ids = list(scheduler_output.num_scheduled_tokens)
        if not request_ids:
            return RunnerOutput([], [])
        started = time.perf_counter()
        batch, logits_rows, row_owners, scored = self._prepare_inputs(scheduler_output)
        spec_token_ids = scheduler_output.scheduled_spec_token_ids
        masks = self._start_masks(row_owners, spec_token_ids)
        excluded = None if scored else self._greedy_exclusions(row_owners, spec_token_ids, masks)
        lora_step = self._lora_step(scheduler_output)
        graphs = self.graphs
        eager = graphs is None or on_layer_done is not None or lora_step is not None or scored
        if not eager and graphs.takes(batch.metadata, len(row_owners)):
            out = graphs.run(batch.input_ids, batch.positions, batch.metadata)
            out = out if excluded is None else greedy_argmax(out, excluded)
        else:
            with applied(lora_step):
                out = self.model(
                    batch.input_ids, batch.positions, self.kv_caches, batch.metadata, logits_rows, on_layer_done, excluded,
                )
        prompt_logprobs = {}
        if scored:
            out, prompt_logprobs = out[: len(row_owners)], self._prompt_logprobs(out[len(row_owners):], scored)
        if excluded is not None:  # out: each row's greedy token
            sampled, logprobs = {request_id: [token_id] for request_id, token_id in zip(row_owners, out.tolist())}, {}
            self._record(sampled)
        else:
            sampled, logprobs = self._sample(out, row_owners, spec_token_ids, masks)
        self._advance(scheduler_output, sampled)
        output = self._output(request_ids, sampled, logprobs, self._propose(scheduler_output, sampled, started))
        output.prompt_logprobs = prompt_logprobs
        return output

    def _advance(self, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Count the step's tokens as computed, but for the drafts verification rejected."""
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[request_id]
            num_rejected = 0
            drafts = scheduler_output.scheduled_spec_token_ids.get(request_id)
            if drafts:
                num_rejected = len(drafts) + 1 - len(sampled.get(request_id, []))
            state.num_computed_tokens += num_tokens - num_rejected

    def _propose(self, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]], started: float) -> dict[str, list[int]]:
        """The drafts for the next step (none without speculation), and the step's cost for the
        policy that sizes them (the step began at ``started``)."""
        if self.spec is None:
            return {}
        # Sampling returned host lists, so the device work is done and the time is real.
        verifies = bool(scheduler_output.scheduled_spec_token_ids)
        self.spec.step_cost.observe(scheduler_output.total_num_scheduled_tokens, time.perf_counter() - started, verifies=verifies)
        if not sampled:
            return {}
        states = [self.requests[request_id] for request_id in sampled]
        draft_token_ids = self.spec.propose(states, len(scheduler_output.num_scheduled_tokens))
        if self.grammar is not None:
            draft_token_ids = self._allowed_drafts(draft_token_ids)
        return draft_token_ids

    def _output(
        self, request_ids: list[str], sampled: dict[str, list[int]], logprobs: dict, draft_token_ids: dict[str, list[int]]
    ) -> RunnerOutput:
        errors = self.grammar.take_failures() if self.grammar is not None else {}
        return RunnerOutput(
            request_ids=request_ids,
            sampled_token_ids=[sampled.get(request_id, []) for request_id in request_ids],
            logprobs=[logprobs.get(request_id, []) for request_id in request_ids] if logprobs else None,
            draft_token_ids={request_id: drafts for request_id, drafts in draft_token_ids.items() if request_id not in errors},
            errors=errors,
        )

    def _start_masks(self, row_owners: list[str], spec_token_ids: dict[str, list[int]]) -> MaskJob | None:
        """Start filling the constrained rows' token masks (beside a GPU's forward pass; in line on a CPU)."""
        if self.grammar is None or not row_owners:
            return None
        owners = dict.fromkeys(row_owners)
        return self.grammar.start([(self.requests[owner], spec_token_ids.get(owner, [])) for owner in owners])

    def _allowed_drafts(self, draft_token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        """Drafts cut before the first token their request's constraint refuses (verifying it
        could only reject it) where the cut leaves the output's distribution as it is: greedy
        requests, and n-gram drafts (a proposal drawn from no distribution). A random draft of a
        draft model stays whole, and the mask makes its verification reject the refused token:
        a cut there would sample that position from the target instead of from the residual
        that exact rejection sampling needs."""
        allowed = {}
        deterministic = self.spec.config.method == "ngram"
        for request_id, drafts in draft_token_ids.items():
            state = self.requests[request_id]
            if deterministic or state.sampling_params.greedy:
                drafts = self.grammar.clip_drafts(state, drafts)
            if drafts:
                allowed[request_id] = drafts
        return allowed

    def _sample(
        self,
        logits: torch.Tensor,
        row_owners: list[str],
        spec_token_ids: dict[str, list[int]],
        masks: MaskJob | None,
    ) -> tuple[dict[str, list[int]], dict[str, list[dict[int, float]]]]:
        """Tokens per request that reached its last token: sampled, or verified drafts plus one.
        ``masks``: the constrained rows' token masks (``_start_masks``)."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, float]]] = {}
        if not row_owners:
            return sampled, logprobs
        if masks is not None:
            self.grammar.apply(logits, masks)
        plain_rows = [row for row, owner in enumerate(row_owners) if owner not in spec_token_ids]
        if plain_rows:
            plain_ids = [row_owners[row] for row in plain_rows]
            plain_logits = logits if len(plain_rows) == len(row_owners) else logits[plain_rows]
            result = self.sampler(plain_logits, self._sampling_metadata(plain_ids))
            for row, request_id in enumerate(plain_ids):
                sampled[request_id] = [result.sampled_token_ids[row]]
                if result.logprobs is not None and result.logprobs[row] is not None:
                    logprobs[request_id] = [result.logprobs[row]]
        if len(plain_rows) < len(row_owners):
            spec_rows = [row for row, owner in enumerate(row_owners) if owner in spec_token_ids]
            spec_ids = list(dict.fromkeys(row_owners[row] for row in spec_rows))
            states = [self.requests[request_id] for request_id in spec_ids]
            verified = self.spec.verify(logits[spec_rows], states, [spec_token_ids[i] for i in spec_ids])
            sampled.update(zip(spec_ids, verified))
        self._record(sampled)
        return sampled, logprobs

    def _record(self, sampled: dict[str, list[int]]) -> None:
        """The step's tokens join their requests' outputs (and advance their grammars)."""
        for request_id, token_ids in sampled.items():
            state = self.requests[request_id]
            state.output_token_ids.extend(token_ids)
            if self.grammar is not None:
                self.grammar.accept(state, token_ids)


def allocate_kv_cache(arch, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: str):
    """One [layers, 2, kv_heads, blocks, block_size, head_dim] tensor, and per layer its (key, value)
    views; a quantized cache's rows are ``head_dim + 1`` wide (``kernels.kv_quant``)."""
    shape = (arch.num_layers, 2, arch.num_kv_heads, num_blocks, block_size, row_width(arch.head_dim, kv_dtype))
    kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    return kv_cache, [(kv_cache[layer, 0], kv_cache[layer, 1]) for layer in range(arch.num_layers)]


def _cascade_planner(mode: str, arch, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int, device: str) -> CascadePlanner | None:
    """The runner's cascade attention (``duet.kernels.cascade``): on CPUs with the C++ kernels, or none."""
    if mode == "off" or device != "cpu" or cpu_ops.load() is None or arch.kv_window is not None:
        return None  # (every layer windowed: the kernels never cascade, and tables start with the null block)
    shape = (arch.num_heads, arch.num_kv_heads, arch.head_dim, dtype, kv_dtype, block_size)
    return CascadePlanner(mode, lambda: fit_rule(cpu_ops.load(), *shape))


def _make_proposer(config: SpeculativeConfig, runner: ModelRunner, draft_model, num_blocks: int, kv_dtype: torch.dtype):
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "layer_skip":
        caches = runner.kv_caches[: config.num_draft_layers]
        return ModelProposer(runner.model, caches, runner.block_size, runner.device, shares_target_cache=True)
    _, caches = allocate_kv_cache(draft_model.arch, num_blocks, runner.block_size, kv_dtype, runner.device)
    return ModelProposer(draft_model, caches, runner.block_size, runner.device, shares_target_cache=False)
