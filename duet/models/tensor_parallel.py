"""Tensor parallelism applied to a loaded Llama from outside its definition (as gpt-fast's
``tp.py`` does): each rank keeps its slice of every weight, and the modules where ranks must
meet are swapped for ones that do.

- Attention: a rank computes whole KV groups (a KV head and the query heads reading it), so its
  qkv rows, its KV cache and its attention call are those of a smaller model of the same group
  size. With fewer KV heads than ranks, each KV head is replicated on ``world_size /
  num_kv_heads`` ranks, which split its query heads. ``o_proj`` keeps the rank's heads' columns
  and its partial sums are added over the ranks: one all-reduce per attention block. An
  activation-ordered GPTQ ``o_proj`` (its groups of input features span every rank's heads) is
  kept whole instead: the ranks gather the heads' outputs, one all-gather, and each computes it.
- MLP: gate and up rows, down columns, split over the intermediate features; one all-reduce.
  An activation-ordered down projection splits by whole groups of its own order, and gate and
  up compute its share of the features in that order.
- Experts (a Mixtral, with expert parallelism): each rank holds a contiguous range of whole
  experts; every rank routes every token (the router is replicated, its choices identical),
  computes its own experts' weighted outputs, and the ranks add them (one all-reduce per MoE
  block). The tokens need no dispatch: after the attention's all-reduce every rank holds them
  all, so "all-to-all" reduces to each rank picking its experts' tokens. Without expert
  parallelism every rank holds all experts, each split over its features like the MLP above.
- Embedding and LM head split over the vocabulary: a token's row lives on one rank (the others
  add zeros, which is exact), and the ranks' logits are gathered whole on every rank, so every
  rank samples the same tokens from the same logits and keeps its own copy of the sequences.

A sum over ranks rounds differently from one rank's sum: tokens match TP=1's wherever the
logits are not near-ties (what the parity tests check, against transformers too).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from duet.config import ConfigError
from duet.distributed import TensorParallelGroup
from duet.kernels.fused import greedy_argmax
from duet.kernels.gguf import BLOCK
from duet.models.linear import Linear
from duet.models.llama import LlamaArch, LlamaForCausalLM
from duet.models.mixtral import MixtralArch, MixtralMoE
from duet.models.module import Module

logger = logging.getLogger(__name__)


def split_range(size: int, parts: int, index: int, unit: int = 1) -> slice:
    """Part ``index`` of ``parts`` near-equal contiguous parts of ``range(size)``, cut on
    multiples of ``unit`` (which must divide ``size``)."""
    units = size // unit
    return slice(index * units // parts * unit, (index + 1) * units // parts * unit)


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """The query heads and KV heads one rank computes (ranges of the model's heads)."""

    q_heads: slice
    kv_heads: slice

    @property
    def num_heads(self) -> int:
        return self.q_heads.stop - self.q_heads.start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.stop - self.kv_heads.start


def shard_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """Rank ``rank``'s heads: whole KV groups, or part of one replicated KV head's group."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv_heads = split_range(num_kv_heads, world_size, rank)
        return HeadShard(slice(kv_heads.start * group, kv_heads.stop * group), kv_heads)
    replicas = world_size // num_kv_heads
    if world_size % num_kv_heads or group < replicas:
        raise ConfigError(
            f"tensor_parallel_size={world_size} cannot split {num_heads} attention heads over {num_kv_heads} KV heads: "
            f"with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and at most {num_heads}"
        )
    kv_head = rank // replicas
    q_heads = split_range(group, replicas, rank % replicas)
    first = kv_head * group
    return HeadShard(slice(first + q_heads.start, first + q_heads.stop), slice(kv_head, kv_head + 1))


def check_layout(arch: LlamaArch, world_size: int, expert_parallel: bool) -> int:
    """Raise ``ConfigError`` unless ``world_size`` ranks can split ``arch``; return the most KV
    heads a rank holds (what sizes its KV cache)."""
    is_moe = isinstance(arch, MixtralArch)
    if expert_parallel and not is_moe:
        raise ConfigError("enable_expert_parallel needs a mixture-of-experts model (Mixtral); this one has no experts")
    if is_moe and world_size > 1:
        if expert_parallel and arch.num_experts < world_size:
            raise ConfigError(
                f"{arch.num_experts} experts cannot spread over {world_size} ranks; without enable_expert_parallel "
                "each rank takes a share of every expert's features instead"
            )
        if not expert_parallel and arch.intermediate_size < world_size:
            raise ConfigError(f"an expert's {arch.intermediate_size} features cannot split over {world_size} ranks")
    return max(shard_heads(arch.num_heads, arch.num_kv_heads, world_size, rank).num_kv_heads for rank in range(world_size))


def _offset(part: slice | torch.Tensor, by: int) -> slice | torch.Tensor:
    return part + by if isinstance(part, torch.Tensor) else slice(part.start + by, part.stop + by)


Rows = list[slice | torch.Tensor]  # output features: ranges, or index tensors, concatenated


@dataclasses.dataclass(frozen=True)
class PartOfWeight:
    """What a tensor-parallel shard holds of the whole weight (``[out_features, in_features]``):
    these rows, concatenated, and these input features (None: all; an index tensor where the
    shard takes them in an order of their own). A LoRA adapter's A and B are cut the same way
    (``duet.lora``)."""

    rows: Rows
    columns: slice | torch.Tensor | None
    out_features: int
    in_features: int


def shard_linear(linear: Linear, rows: Rows, columns: slice | None = None, in_input_order: bool = False) -> Linear:
    """A Linear holding these output rows (concatenated) and, with ``columns``, these input
    features of ``linear``; its GGUF blocks too where the columns fall on block boundaries (a
    weight kept as blocks alone must have them there). A weight whose input features are in an
    order of their own (``Linear.input_order``: GPTQ's activation order) splits by input
    features only where the caller hands the shard its input in that order
    (``in_input_order``): ``columns`` are then positions in it, and the shard takes its input
    as it comes."""
    reorders = linear.input_order is not None and columns is not None
    if reorders and not in_input_order:
        raise ConfigError("an activation-ordered GPTQ weight splits by input features only when its input comes in its order")
    shard = _shard(linear, rows, columns)
    shard.input_order = None if reorders else linear.input_order
    shard.input_quantization = linear.input_quantization
    whole_columns = linear.input_order[columns] if reorders else columns
    shard.part_of = PartOfWeight(rows, whole_columns, linear.out_features, linear.in_features)
    shard.use_int8_products()
    return shard


def _shard(linear: Linear, rows: Rows, columns: slice | None) -> Linear:
    if linear.weight is None:
        try:
            blocks = linear.gguf.shard(rows, columns)
        except ValueError as error:
            raise ConfigError(f"a weight kept as blocks alone splits by whole blocks only: {error}; choose another tensor_parallel_size") from None
        with torch.device("meta"):
            shard = Linear(blocks.in_features, blocks.codes.shape[0])
        shard.attach_gguf(blocks)
        shard.keep_blocks_only(linear.blocks_dtype)
        return shard
    weight = torch.cat([linear.weight[part] for part in rows])
    if columns is not None:
        weight = weight[:, columns]
    with torch.device("meta"):
        shard = Linear(weight.shape[1], weight.shape[0])
    shard.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    shard.pack_for_cpu()
    if linear.gguf is not None:
        try:
            shard.attach_gguf(linear.gguf.shard(rows, columns))
        except ValueError as error:
            logger.warning("a tensor-parallel shard computes from its float weight: %s", error)
    return shard


def _largest_over_ranks(group: TensorParallelGroup, largest: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude over every rank's part of it."""
    return torch.stack(group.all_gather(largest)).amax(0)


class SummedOverRanks(Module):
    """A module computing this rank's part of a sum (a Linear over its input features, its
    experts); the parts are added over the ranks."""

    def __init__(self, module: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.module = module
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.module(x))


class WholeInput(Module):
    """A Linear whose input features the ranks hold parts of, computed whole on every rank:
    each gathers the whole rows and takes the product as one process would, so no sum over
    ranks follows. For an input in an order of its own that the parts cut across (GPTQ's
    activation order on ``o_proj``: its groups span every rank's heads). ``parts``: each rank's
    input features, in order."""

    def __init__(self, module: Linear, parts: list[slice], group: TensorParallelGroup) -> None:
        super().__init__()
        self.module = module
        self.parts = parts
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(_gathered_rows(x, self.parts, self.module.in_features, self.group))


def _gathered_rows(x: torch.Tensor, parts: list[slice], width: int, group: TensorParallelGroup) -> torch.Tensor:
    """The whole rows of ``width`` features, each rank's ``x`` holding its part of them."""
    widest = max(part.stop - part.start for part in parts)
    gathered = group.all_gather(F.pad(x, (0, widest - x.shape[1])).contiguous())
    rows = x.new_empty(x.shape[0], width)
    for part, piece in zip(parts, gathered):
        rows[:, part] = piece[:, : part.stop - part.start]
    return rows


class WholeRowNorm(Module):
    """A norm over features that the ranks hold parts of (OLMo 2's q/k norms over all heads):
    every rank gathers the whole rows, normalises them as one process would, and keeps its part.
    ``parts`` are each rank's features (ranks sharing a replicated KV head hold the same)."""

    def __init__(self, norm: nn.Module, parts: list[slice], rank: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.norm = norm
        self.parts = parts
        self.rank = rank
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _gathered_rows(x, self.parts, self.norm.weight.shape[0], self.group)
        return self.norm(rows)[:, self.parts[self.rank]].contiguous()


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token outside them contributes zeros."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(hidden)


class VocabParallelLMHead(nn.Module):
    """This rank's rows of the LM head; every rank gets the whole logits, gathered."""

    def __init__(self, linear: Linear, part_sizes: list[int], group: TensorParallelGroup) -> None:
        super().__init__()
        self.linear = linear
        self.part_sizes = part_sizes
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:  # a step of prompt chunks alone: every rank skips the gather alike
            return x.new_empty(0, sum(self.part_sizes))
        logits = self.linear(x)
        widest = max(self.part_sizes)
        if logits.shape[1] < widest:  # a gather takes equal shapes: pad, then cut the padding off
            logits = F.pad(logits, (0, widest - logits.shape[1]))
        parts = self.group.all_gather(logits)
        return torch.cat([part[:, :size] for part, size in zip(parts, self.part_sizes)], dim=1)

    def argmax(self, x: torch.Tensor, excluded_token_ids: torch.Tensor) -> torch.Tensor:
        """The greedy tokens of the whole logits (``Linear.argmax``'s contract)."""
        return greedy_argmax(self(x).float(), excluded_token_ids)


def _shard_dense_mlp(mlp, dense: slice) -> None:
    """Keep ``dense``, this rank's features of a gated MLP: its rows of gate and up (and of their
    biases), its columns of down, whose output is then this rank's part of a sum over ranks.
    Where down takes its input in an order of its own (GPTQ's activation order), ``dense`` is a
    range of that order (whole groups), and gate and up compute its features in it."""
    size = mlp.down_proj.in_features
    order = mlp.down_proj.input_order
    features = dense if order is None else order[dense]
    mlp.gate_up_proj = shard_linear(mlp.gate_up_proj, [features, _offset(features, size)])
    if mlp.gate_up_bias is not None:  # the down projection's is added once, to the sum over ranks
        bias = torch.cat([mlp.gate_up_bias[features], mlp.gate_up_bias[_offset(features, size)]])
        mlp.gate_up_bias = nn.Parameter(bias, requires_grad=False)
    mlp.down_proj = shard_linear(mlp.down_proj, [slice(None)], dense, in_input_order=True)


def apply_tensor_parallel(model: LlamaForCausalLM, group: TensorParallelGroup, expert_parallel: bool = False) -> None:
    """Keep this rank's part of ``model`` (for a Mixtral, its experts with ``expert_parallel``,
    else its share of every expert's features: the layout is checked by ``check_layout`` first)
    and wire its collectives; ``model.arch`` becomes the rank's shape (its heads, KV heads and
    MLP features: what its KV cache holds)."""
    arch, rank, world_size = model.arch, group.rank, group.world_size
    heads = shard_heads(arch.num_heads, arch.num_kv_heads, world_size, rank)
    head_dim = arch.head_dim
    q_rows = slice(heads.q_heads.start * head_dim, heads.q_heads.stop * head_dim)
    k_rows = _offset(slice(heads.kv_heads.start * head_dim, heads.kv_heads.stop * head_dim), arch.num_heads * head_dim)
    v_rows = _offset(k_rows, arch.num_kv_heads * head_dim)

    def features_of(size: int, blocks_only: bool = False) -> slice:
        """Even parts that keep GGUF blocks whole where they can; weights that are blocks alone
        (quantized, or shipped packed) split by whole blocks, evenly or not."""
        whole_blocks = size % (BLOCK * world_size) == 0 or (blocks_only and size % BLOCK == 0)
        return split_range(size, world_size, rank, BLOCK if whole_blocks else 1)

    features = features_of(arch.intermediate_size)
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj = shard_linear(attention.qkv_proj, [q_rows, k_rows, v_rows])
        if attention.qkv_bias is not None:
            bias = torch.cat([attention.qkv_bias[rows] for rows in (q_rows, k_rows, v_rows)]).contiguous()
            attention.qkv_bias = nn.Parameter(bias, requires_grad=False)
        shards = [shard_heads(arch.num_heads, arch.num_kv_heads, world_size, index) for index in range(world_size)]
        q_parts = [slice(shard.q_heads.start * head_dim, shard.q_heads.stop * head_dim) for shard in shards]
        if attention.o_proj.input_order is None:
            attention.o_proj = SummedOverRanks(shard_linear(attention.o_proj, [slice(None)], q_rows), group)
        else:  # its groups span every rank's heads
            attention.o_proj = WholeInput(shard_linear(attention.o_proj, [slice(None)]), q_parts, group)
        attention.num_heads, attention.num_kv_heads = heads.num_heads, heads.num_kv_heads
        if attention.q_norm is not None and attention.qk_norm_across_heads:
            k_parts = [slice(shard.kv_heads.start * head_dim, shard.kv_heads.stop * head_dim) for shard in shards]
            attention.q_norm = WholeRowNorm(attention.q_norm, q_parts, rank, group)
            attention.k_norm = WholeRowNorm(attention.k_norm, k_parts, rank, group)
        attention.q_size, attention.kv_size = heads.num_heads * head_dim, heads.num_kv_heads * head_dim
        if isinstance(mlp, MixtralMoE):
            if expert_parallel:
                experts = split_range(arch.num_experts, world_size, rank)
                mlp.keep_experts(range(experts.start, experts.stop))
            else:
                mlp.keep_features(range(features.start, features.stop))
            if mlp.shared_expert is not None:  # split by features either way: the ranks' sum adds each part once
                shared = mlp.shared_expert
                _shard_dense_mlp(shared, features_of(shared.down_proj.in_features, blocks_only=shared.down_proj.weight is None))
            layer.mlp = SummedOverRanks(mlp, group)
            continue
        size = mlp.down_proj.in_features  # a dense layer of a MoE model has its own width
        _shard_dense_mlp(mlp, features_of(size, blocks_only=mlp.down_proj.weight is None))
        mlp.down_proj = SummedOverRanks(mlp.down_proj, group)
    vocab = [split_range(arch.vocab_size, world_size, index) for index in range(world_size)]
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight[vocab[rank]].contiguous(), vocab[rank].start, group)
    model.lm_head = VocabParallelLMHead(shard_linear(model.lm_head, [vocab[rank]]), [part.stop - part.start for part in vocab], group)
    whole_experts = isinstance(arch, MixtralArch) and expert_parallel
    intermediate_size = arch.intermediate_size if whole_experts else features.stop - features.start
    model.arch = dataclasses.replace(arch, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads, intermediate_size=intermediate_size)
    for module in model.modules():  # W8A8's row-parallel products (o, down): a row's scale spans every rank's features
        if isinstance(module, Linear) and module.input_quantization is not None and module.part_of.columns is not None:
            module.input_row_max = functools.partial(_largest_over_ranks, group)
