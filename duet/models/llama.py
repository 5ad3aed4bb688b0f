"""The decoder every architecture duet runs is built from, reading and writing the paged KV cache.

A Llama is the plain case; the other families configure its parts through ``LlamaArch``
(``duet.models.architectures`` reads each family's config): projection biases (Qwen 2's on
q/k/v; a Llama's on any), Granite's multipliers, per-head
q/k RMSNorm and a ``head_dim`` of its own (Qwen 3), scaled RoPE (Llama 3's ``rope_scaling``),
sliding windows per layer (Mistral, Phi-3, Gemma), fused checkpoint tensors (Phi-3), Gemma's
scaled embeddings, (1 + w) norms (added at load), norms around both blocks, GeGLU, its own
query scale, soft-capped scores and logits, a RoPE of its own for windowed layers, and none on
SmolLM3's NoPE layers; OLMo 2's blocks without norms before them and its q/k norms over all
heads at once; and, in
``duet.models.mixtral``, experts (Mixtral, Qwen 3 MoE).

The model sees one flat batch of tokens (every sequence's new tokens back to back) and
returns logits only for the rows the sampler needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from duet.kernels import AttentionMetadata, paged_attention
from duet.kernels.fused import add_rms_norm, greedy_argmax, rms_norm, rope_and_write_kv, silu_and_mul
from duet.models.decoder_stack import DecoderStack
from duet.lora import current_step as current_lora_step
from duet.models.linear import Linear
from duet.models.module import Module
from duet.models.rope import RopeRows, RotaryEmbedding, rope_scaling


@dataclass(frozen=True)
class LlamaArch:
    """The shape of a checkpoint and the parts its family configures (``from_hf_config`` reads
    a Llama's; ``duet.models.architectures`` every supported family's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    _: KW_ONLY  # the family's parts (a Llama has none of them)
    qkv_bias: bool = False  # q, k and v projections with biases (Qwen 2)
    o_bias: bool = False  # the o projection with one too (with q, k and v's: Llama's and Qwen 3's attention_bias)
    mlp_bias: bool = False  # gate, up and down projections with biases (Llama's mlp_bias)
    qk_norm: bool = False  # an RMSNorm over each head's query and key before RoPE (Qwen 3)
    qk_norm_across_heads: bool = False  # the q/k norms over all heads' features at once (OLMo 2), not each head's
    # RoPE's inverse frequencies and the factor on its cos/sin tables, where the config scales
    # them (``rope_scaling``: llama3, linear, yarn); None: the plain frequencies of ``rope_theta``.
    rope_inv_freq: tuple[float, ...] | None = None
    rope_attention_factor: float = 1.0
    rotary_dim: int | None = None  # RoPE over each head's first this many features (Phi-4-mini); None: all
    # A RoPE that depends on the sequence's length L (transformers' rule: a forward's last
    # position + 1, so a prompt's tokens all see the prompt's length): past ``rope_original_max``
    # ``longrope`` rotates by ``rope_long_inv_freq`` (``rope_inv_freq``: its short ones) and
    # ``dynamic`` (NTK) by frequencies recomputed from L and ``rope_dynamic_factor``.
    rope_long_inv_freq: tuple[float, ...] | None = None
    rope_dynamic_factor: float | None = None
    rope_original_max: int | None = None
    # Phi-3's longrope: a sequence computed short is computed again whole, long, once it passes
    # ``rope_original_max`` (transformers' Phi-3 drops its cache there), not only its new tokens.
    rope_recompute: bool = False
    # Each layer's window (a token sees its last ``window`` keys, itself included), None for a
    # layer of full attention; None: no windows.
    layer_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None  # windowed layers' own plain RoPE (Gemma 3); None: the global one
    nope_layers: tuple[int, ...] = ()  # layers whose queries and keys are not rotated (SmolLM3's every fourth)
    checkpoint_names: str = "llama"  # how the checkpoint names its tensors (``loader._fusion_plan``)
    # Gemma's parts.
    norm_offset: bool = False  # the checkpoint's norm weights w scale by 1 + w
    embed_scale: float | None = None  # embeddings times this (rounded to the weights' dtype)
    sandwich_norms: bool = False  # norms after attention and around the MLP too
    pre_norms: bool = True  # False (OLMo 2): blocks read the residual stream itself; norms after attention and MLP only
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_scale: float | None = None  # scores' scale (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # scores become cap * tanh(score / cap)
    final_softcap: float | None = None  # logits likewise
    # Granite's multipliers: on the embeddings, on each block's output before it joins the
    # residual stream, and a divisor of the logits (its attention_multiplier is ``query_scale``).
    embed_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_divisor: float | None = None

    @property
    def max_sequence_len(self) -> int:
        """The longest sequence the position table holds: the config's, a dynamic RoPE's times
        its factor (the length it stretches to, as vLLM takes it)."""
        if self.rope_dynamic_factor is not None:
            return int(self.max_position_embeddings * max(self.rope_dynamic_factor, 1.0))
        return self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        return None if self.layer_windows is None else self.layer_windows[layer]

    @property
    def kv_window(self) -> int | None:
        """How far back every layer's queries see, where every layer has a window (Mistral's
        ``sliding_window``; None where some layer sees the whole sequence, as Gemma's global
        ones): keys further back are read by no layer, and their KV blocks can go."""
        windows = self.layer_windows
        return None if windows is None or None in windows else max(windows)

    def rope_cache_key(self, prompt_len: int) -> int | None:
        """What a sequence's KV depends on besides its tokens and their positions, where its
        RoPE depends on its length (the prefix cache keys blocks by it): whether its prompt
        passes ``rope_original_max`` (longrope: its prompt's tokens rotate by the long
        frequencies), or the prompt's length (dynamic: by frequencies of that length); None
        where nothing does."""
        if self.rope_original_max is None or prompt_len <= self.rope_original_max:
            return None
        return 1 if self.rope_long_inv_freq is not None else prompt_len

    @classmethod
    def from_hf_config(cls, config, **parts) -> LlamaArch:
        """The shape from a transformers config; ``parts`` set the family's parts."""
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = dict(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )
        return cls(**{**shape, **rope_scaling(config, rope), **parts})


def narrow_windows(model: nn.Module, window: int) -> None:
    """Let every attention layer of ``model`` see at most its last ``window`` keys: a draft model
    drafting for a target whose KV blocks before its window are gone reads only what is held."""
    for module in model.modules():
        if isinstance(module, LlamaAttention):
            module.window = window if module.window is None else min(module.window, window)


class RMSNorm(Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise ``x``; with ``residual``, first add ``x`` into it (in place) and normalise the sum."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(Module):
    batch_invariant = False  # True: every row attends as a prompt chunk's (duet.models.batch_invariant)

    def __init__(self, arch: LlamaArch, layer: int = 0) -> None:
        super().__init__()
        self.window = arch.window(layer)
        self.local = self.window is not None  # its config windows it (Gemma 3 rotates those by a local base)
        self.rotates = layer not in arch.nope_layers
        self.softcap = arch.attn_softcap
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.query_scale or arch.head_dim**-0.5
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, arch.hidden_size)
        size = self.q_size + 2 * self.kv_size
        self.qkv_bias = nn.Parameter(torch.zeros(size), requires_grad=False) if arch.qkv_bias else None
        self.o_bias = nn.Parameter(torch.zeros(arch.hidden_size), requires_grad=False) if arch.o_bias else None
        self.qk_norm_across_heads = arch.qk_norm_across_heads
        q_width, k_width = (self.q_size, self.kv_size) if arch.qk_norm_across_heads else (arch.head_dim, arch.head_dim)
        self.q_norm = RMSNorm(q_width, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(k_width, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(self, x, positions, rotary: RotaryEmbedding | RopeRows, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.qk_norm_across_heads:  # each token's queries as one row, keys as another
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.q_norm is not None:  # per head, on rows of head_dim
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        rope_and_write_kv(q, k, v, positions, rotary.cos, rotary.sin, key_cache, value_cache, metadata.slot_mapping)
        out = paged_attention(q, key_cache, value_cache, metadata, self.scale, self.window, self.softcap, self.batch_invariant)
        out = self.o_proj(out.view(num_tokens, self.q_size))
        return out if self.o_bias is None else out + self.o_bias


class LlamaMLP(Module):
    """SwiGLU (GeGLU with ``activation="gelu_tanh"``): gate and up projections fused (gate's rows
    first), then down."""

    def __init__(self, arch: LlamaArch, intermediate_size: int | None = None) -> None:
        super().__init__()
        intermediate_size = intermediate_size or arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, arch.hidden_size)
        self.gate_up_bias = nn.Parameter(torch.zeros(2 * intermediate_size), requires_grad=False) if arch.mlp_bias else None
        self.down_bias = nn.Parameter(torch.zeros(arch.hidden_size), requires_grad=False) if arch.mlp_bias else None
        self.gelu = arch.activation == "gelu_tanh"
        self.by_row = False  # GeGLU's tanh one row at a time (duet.models.batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            out = self.down_proj(by_row(lambda rows: F.gelu(rows, approximate="tanh"), gate, self.by_row) * up)
        else:
            out = self.down_proj(silu_and_mul(gate_up))
        return out if self.down_bias is None else out + self.down_bias


def by_row(function, x: torch.Tensor, each_row: bool) -> torch.Tensor:
    """``function`` of ``x``'s rows; with ``each_row``, called on each row alone: torch's
    elementwise kernels split a tensor's values between vector and scalar code, and between
    threads, by the tensor's size, so a row's last bits could follow the rows beside it."""
    if not each_row or x.shape[0] <= 1:
        return function(x)
    return torch.stack([function(row) for row in x])


class LlamaDecoderLayer(Module):
    """Pre-norm block. It takes the normalised input and the residual stream, and returns
    the MLP output for the next norm to add in (norm and residual add are fused)."""

    def __init__(self, arch: LlamaArch, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch)
        self.residual_multiplier = arch.residual_multiplier

    def forward(self, x, residual, positions, rotary, kv_cache, metadata) -> torch.Tensor:
        attn_out = self.self_attn(x, positions, rotary, kv_cache, metadata)
        if self.residual_multiplier is None:
            return self.mlp(self.post_attention_layernorm(attn_out, residual))
        mlp_out = self.mlp(self.post_attention_layernorm(attn_out * self.residual_multiplier, residual))
        return mlp_out * self.residual_multiplier


class ResidualStream(Module):
    """In a block without a norm before it (OLMo 2's): what the norm's place gives is the residual
    stream itself (with ``residual``, once ``x`` is added into it), not a copy: attention and the
    MLP have read all of their input before the stream is next added into."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return x if residual is None else residual.add_(x)


class SandwichDecoderLayer(LlamaDecoderLayer):
    """Gemma's block: the attention's output normalised before it joins the residual stream, and
    the MLP between a norm of its own and one after it (whose output the next norm adds in).
    Without ``pre_norms`` (OLMo 2) the norms before attention and MLP are not there."""

    def __init__(self, arch: LlamaArch, layer: int = 0) -> None:
        super().__init__(arch, layer)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if arch.pre_norms else ResidualStream()
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if not arch.pre_norms:
            self.input_layernorm = ResidualStream()

    def forward(self, x, residual, positions, rotary, kv_cache, metadata) -> torch.Tensor:
        attn_out = self.self_attn(x, positions, rotary, kv_cache, metadata)
        residual.add_(self.post_attention_layernorm(attn_out))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(residual)))


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head, over a paged KV cache."""

    batch_invariant = False  # True: capped logits one row at a time (duet.models.batch_invariant)

    def __init__(self, arch: LlamaArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.whole_arch = arch  # ``arch`` becomes a tensor-parallel rank's share; this stays the model's
        # Given its (empty) weight, the table skips torch's random init, which under the meta
        # device imports torch._dynamo (over a second of a replica's start).
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.rotary = RotaryEmbedding(arch, max_positions)
        # Windowed layers' own RoPE (Gemma 3), or None: every layer takes ``rotary``.
        self.local_rotary = RotaryEmbedding(arch, max_positions, local=True) if arch.local_rope_theta is not None else None
        # NoPE layers' tables: none wide (the kernels rotate a head's first 2 * width features).
        self.no_rotary = RotaryEmbedding(arch, max_positions, rotates=False) if arch.nope_layers else None
        layer_class = SandwichDecoderLayer if arch.sandwich_norms else LlamaDecoderLayer
        self.layers = nn.ModuleList(layer_class(arch, index) for index in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size)
        self.use_decoder_stack = True  # False: every step's layers run in Python (tests compare the two)
        self._decoder_stack: DecoderStack | None = None
        self._decoder_stack_built = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        on_layer_done: Callable[[int], None] | None = None,
        excluded_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for the rows in ``logits_indices``, or with ``excluded_token_ids`` (``[rows, E]``,
        -1 for none) only each row's greedy token among the others (``Linear.argmax``: no
        logits written); ``on_layer_done(i)`` is called once layer ``i``'s KV is in the cache (a
        prefill node starts shipping it while the rest computes).

        Given fewer ``kv_caches`` than layers, only that many first layers run, followed by the
        final norm and LM head: the layer-skip draft.
        """
        residual = self.embed(input_ids)
        x = self.layers[0].input_layernorm(residual)
        mlp_out = self.run_layers(x, residual, positions, kv_caches, metadata, on_layer_done)
        hidden = self.norm(mlp_out, residual)[logits_indices]
        if excluded_token_ids is not None and self.arch.final_softcap is None and self.arch.logits_divisor is None:
            return self.lm_head.argmax(hidden, excluded_token_ids)
        logits = self.logits(hidden)
        return logits if excluded_token_ids is None else greedy_argmax(logits, excluded_token_ids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: the tokens' embeddings (times Gemma's scale, or Granite's multiplier)."""
        residual = self.embed_tokens(input_ids)
        if self.arch.embed_scale is not None:
            residual = residual * torch.tensor(self.arch.embed_scale).to(residual.dtype)  # fp32 first, as transformers
        if self.arch.embed_multiplier is not None:
            residual = residual * self.arch.embed_multiplier  # a Python float, as transformers
        return residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the final norm's rows (divided or soft-capped where the family does)."""
        logits = self.lm_head(hidden)
        if self.arch.logits_divisor is not None:
            logits = logits / self.arch.logits_divisor  # in the weights' dtype, as transformers
        logits = logits.float()
        cap = self.arch.final_softcap
        return logits if cap is None else by_row(lambda rows: torch.tanh(rows / cap), logits, self.batch_invariant) * cap

    def run_layers(self, x, residual, positions, kv_caches, metadata, on_layer_done=None) -> torch.Tensor:
        """The first ``len(kv_caches)`` layers, from the first one's normalised input ``x`` and
        the residual stream (added into in place): the last layer's MLP output, for the next
        norm (or the next pipeline stage) to add in. A step of short queries runs them in one
        C++ call (``decoder_stack``) where the model allows (with LoRA adapters' rows where their
        updates are C++ too), to the same bits."""
        lora = current_lora_step()
        native = lora is None or lora.native
        rows, rotary = self.rotary.for_step(positions, metadata)
        stack = self.decoder_stack() if on_layer_done is None and kv_caches and native and rotary is self.rotary else None
        if stack is not None and stack.takes(x, metadata):
            return stack.run(x, residual, rows, kv_caches, metadata, lora)
        mlp_out = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if mlp_out is not None:
                x = layer.input_layernorm(mlp_out, residual)
            if not layer.self_attn.rotates:
                mlp_out = layer(x, residual, positions, self.no_rotary, kv_cache, metadata)
            elif self.local_rotary is not None and layer.self_attn.local:
                mlp_out = layer(x, residual, positions, self.local_rotary, kv_cache, metadata)
            else:
                mlp_out = layer(x, residual, rows, rotary, kv_cache, metadata)
            if on_layer_done is not None:
                on_layer_done(index)
        return mlp_out

    def decoder_stack(self) -> DecoderStack | None:
        """The C++ stack over these layers, built at first use (the layers are final by then:
        loaded, sharded, packed), or None where they must run in Python."""
        if not self.use_decoder_stack:
            return None
        if not self._decoder_stack_built:
            self._decoder_stack = DecoderStack.build(self)
            self._decoder_stack_built = True
        return self._decoder_stack
