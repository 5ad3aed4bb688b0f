"""Roofline profiles: the profile ``duet simulate`` and ``duet plan`` run on, for hardware this
machine is not, from the model's shape and the device's figures.

    duet profile CONFIG --roofline h100 [--model-shape llama-2-13b | --model-shape config.json]
                 [--tp N] [--devices 8] [--max-num-seqs N]
                 [--flops F --bandwidth B --memory-gib M --link-bandwidth L]   (any preset's figure, or a device's all)

Each step takes the longer of its arithmetic at ``compute_efficiency`` of the device's peak and
its memory traffic at ``memory_efficiency`` of its bandwidth, plus a fixed cost a step
(``step_overhead_s``: launches, the scheduler); a replica of TP=N holds 1/N of the weights and
heads on each of its N devices and adds two all-reduces a layer over the link:

- a prompt chunk of ``T`` tokens after ``C`` cached ones: ``2 P T`` FLOPs of products (``P``: the
  parameters a token multiplies, its top-k experts' only) and ``4 L H d T (C + T/2)`` of
  attention (queries against keys, weights against values); it reads the weights once (every
  expert a chunk's tokens reach) and the KV of ``C + T`` tokens;
- a decode step of ``B`` sequences, ``C`` tokens of context in all: ``2 P B + 4 L H d C`` FLOPs;
  the weights once and the KV of ``C`` tokens read;
- a KV transfer of ``t`` tokens: ``t`` times a token's KV bytes over the link, plus its latency.

Decode steps are sampled on ``duet profile``'s own grids and fitted by its own least squares
(within 2% of the roofline up to a batch of 32 here); prompt steps' fit is read off the roofline
(``Roofline.prompt_fit``: the arithmetic's line, and reading the weights as its floor,
``floor_s``, which ``duet simulate`` honours); the samples are kept beside the fits. The KV
blocks are what ``memory_fraction`` of a device's memory holds beside its share of the weights.
Left out, and so optimistic: kernels below their roofline at small shapes, attention's own
kernel efficiency, speculation (no draft factor), the serving path's CPU, and contention
between replicas on one node. Figures of the presets are the vendors' dense bf16 peaks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Device:
    """One accelerator (or a CPU node), by its figures."""

    name: str
    flops: float  # dense FLOP/s at the model's dtype
    bandwidth: float  # memory bytes/s
    memory_bytes: float
    link_bandwidth: float  # bytes/s between devices (TP's all-reduces, KV transfers), one direction
    link_latency_s: float = 5e-6
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    step_overhead_s: float = 0.002
    memory_fraction: float = 0.9  # of its memory, what the weights and the KV cache may take


DEVICES = {
    "h100": Device("NVIDIA H100 SXM (roofline)", 989e12, 3.35e12, 80e9, 450e9),
    "h200": Device("NVIDIA H200 SXM (roofline)", 989e12, 4.8e12, 141e9, 450e9),
    "a100": Device("NVIDIA A100 SXM 80GB (roofline)", 312e12, 2.039e12, 80e9, 300e9),
}


@dataclass(frozen=True)
class ModelShape:
    """What a roofline needs of a decoder-only model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    experts: int = 0  # 0: a dense MLP
    experts_per_token: int = 0
    expert_intermediate: int = 0
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, config: dict, dtype_bytes: int = 2) -> ModelShape:
        """From a Hugging Face ``config.json``'s fields (Llama, Qwen, Mistral, Mixtral, Qwen MoE)."""
        heads = config["num_attention_heads"]
        experts = config.get("num_local_experts") or config.get("num_experts") or 0
        return cls(
            layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads, head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config.get("intermediate_size") or 0, vocab=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)), experts=experts,
            experts_per_token=(config.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate=(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0) if experts else 0,
            dtype_bytes=dtype_bytes,
        )

    @property
    def attention_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def expert_params(self) -> int:
        """One expert's (or the dense MLP's) gate, up and down weights."""
        return 3 * self.hidden * (self.expert_intermediate if self.experts else self.intermediate)

    @property
    def weight_bytes(self) -> float:
        mlp = self.expert_params * max(self.experts, 1)
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return (self.layers * (self.attention_params + mlp) + embeddings) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def active_params(self) -> float:
        """The parameters one token multiplies in the layers (its top-k experts')."""
        return self.layers * (self.attention_params + self.expert_params * max(self.experts_per_token, 1))

    def weights_read(self, tokens: int) -> float:
        """The weight bytes a step of ``tokens`` rows reads: the layers but the experts none of
        them reaches (routed evenly), and the LM head."""
        if not self.experts:
            layers = self.layers * (self.attention_params + self.expert_params)
        else:
            reached = self.experts * (1 - (1 - self.experts_per_token / self.experts) ** tokens)
            layers = self.layers * (self.attention_params + self.expert_params * reached)
        return (layers + self.vocab * self.hidden) * self.dtype_bytes


# Shapes of models too big for this machine, as their config.json gives them (no download needed).
SHAPES = {
    "llama-2-7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=32000),
    "llama-2-13b": dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=40, intermediate_size=13824, vocab_size=32000),
    "llama-2-70b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672, vocab_size=32000),
    "llama-3.1-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    "llama-3.1-70b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672, vocab_size=128256),
    "mixtral-8x7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2),
}


def model_shape(name_or_path: str, dtype_bytes: int = 2) -> ModelShape:
    """A preset's shape (``SHAPES``), or a ``config.json``'s (or a model folder's)."""
    if name_or_path in SHAPES:
        return ModelShape.from_config(SHAPES[name_or_path], dtype_bytes)
    path = Path(name_or_path)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise SystemExit(f"--model-shape {name_or_path!r}: neither a preset ({', '.join(SHAPES)}) nor a config.json")
    return ModelShape.from_config(json.loads(path.read_text()), dtype_bytes)


@dataclass(frozen=True)
class Roofline:
    """A replica of ``tp`` devices running ``shape``: its steps' and transfers' seconds."""

    shape: ModelShape
    device: Device
    tp: int = 1

    def _seconds(self, flops: float, bytes_read: float, rows: int) -> float:
        d = self.device
        compute = flops / self.tp / (d.flops * d.compute_efficiency)
        memory = bytes_read / self.tp / (d.bandwidth * d.memory_efficiency)
        reduce = 0.0
        if self.tp > 1:  # two all-reduces a layer of the rows' hidden states (a ring: 2 (N-1)/N of the bytes each way)
            per_reduce = rows * self.shape.hidden * self.shape.dtype_bytes * 2 * (self.tp - 1) / self.tp
            reduce = 2 * self.shape.layers * (per_reduce / d.link_bandwidth + d.link_latency_s)
        return max(compute, memory) + reduce + d.step_overhead_s

    def attention_flops(self, queries: float, context: float) -> float:
        return 4 * self.shape.layers * self.shape.heads * self.shape.head_dim * queries * context

    def prompt_seconds(self, tokens: int, cached: int) -> float:
        s = self.shape
        flops = 2 * s.active_params() * tokens + 2 * s.vocab * s.hidden + self.attention_flops(tokens, cached + tokens / 2)
        return self._seconds(flops, s.weights_read(tokens) + (cached + tokens) * s.kv_bytes_per_token, tokens)

    def decode_seconds(self, rows: int, context: float) -> float:
        """A step of ``rows`` sequences with ``context`` tokens in all."""
        s = self.shape
        flops = 2 * (s.active_params() + s.vocab * s.hidden) * rows + self.attention_flops(1, context)
        return self._seconds(flops, s.weights_read(rows) + context * s.kv_bytes_per_token, rows)

    def prompt_fit(self, smallest_chunk: int) -> dict[str, float]:
        """The prompt steps' fit, read off the roofline rather than fitted: where the arithmetic
        binds, ``a + b T + c T (C + T/2)`` exactly; below it, reading the weights
        (``floor_s``, a chunk of ``smallest_chunk`` tokens' experts), which no line through both
        regimes gives (a least-squares line is 37% short at a 2,048-token chunk of 13B on an H100)."""
        s, d = self.shape, self.device
        flops_s = d.flops * d.compute_efficiency * self.tp
        reduce_row = reduce_base = 0.0
        if self.tp > 1:
            reduce_row = 2 * s.layers * s.hidden * s.dtype_bytes * 2 * (self.tp - 1) / self.tp / d.link_bandwidth
            reduce_base = 2 * s.layers * d.link_latency_s
        return {
            "base_s": d.step_overhead_s + reduce_base + 2 * s.vocab * s.hidden / flops_s,
            "per_token_s": 2 * s.active_params() / flops_s + reduce_row,
            "per_token_context_s": self.attention_flops(1, 1) / flops_s,
            "floor_s": d.step_overhead_s + reduce_base + s.weights_read(smallest_chunk) / self.tp / (d.bandwidth * d.memory_efficiency),
        }

    def transfer_seconds(self, tokens: int) -> float:
        return tokens * self.shape.kv_bytes_per_token / self.device.link_bandwidth + self.device.link_latency_s

    def num_blocks(self, block_size: int) -> int:
        d, s = self.device, self.shape
        free = d.memory_bytes * d.memory_fraction - s.weight_bytes / self.tp
        if free <= 0:
            raise SystemExit(f"{s.weight_bytes / 1e9:.1f} GB of weights over {self.tp} {d.name} devices leave no room for a KV cache: a larger --tp")
        return int(free // (block_size * s.kv_bytes_per_token / self.tp))


PROMPT_CHUNKS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PROMPT_CONTEXTS = (0, 256, 1024, 4096)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (64, 256, 1024, 4096)
TRANSFER_TOKENS = (128, 256, 512, 1024, 2048, 4096)


def roofline_pool(roofline: Roofline, engine_args: dict) -> dict:
    """A pool's profile (``duet profile``'s form) from ``roofline``, with the pool's settings
    (its token budget, context and sequences: samples within them) and the blocks the device holds."""
    from duet.benchmarks.profile import fit_decode

    budget, context, seqs = engine_args["max_num_batched_tokens"], engine_args["max_model_len"], engine_args["max_num_seqs"]
    prompts = [
        [t, c, roofline.prompt_seconds(t, c)] for c in PROMPT_CONTEXTS for t in PROMPT_CHUNKS if t <= budget and c + t < context
    ]
    decode = [
        [b, c, roofline.decode_seconds(b, b * c)] for c in DECODE_CONTEXTS for b in DECODE_BATCHES if b <= seqs and c < context
    ]
    return {
        "neighbours": None,
        "num_threads": roofline.tp,  # the devices a replica takes (``duet plan`` counts them as cores)
        "settings": {
            "max_num_batched_tokens": budget, "max_model_len": context, "max_num_seqs": seqs, "block_size": engine_args["block_size"],
            "num_blocks": roofline.num_blocks(engine_args["block_size"]), "dtype": f"{roofline.shape.dtype_bytes * 8}-bit",
        },
        "prompt": {"samples": prompts, "fit": roofline.prompt_fit(min(PROMPT_CHUNKS))},
        "decode": {"samples": decode, "fit": fit_decode(decode)},
        "speculation": None,
    }


def roofline_profile(pools: dict[str, dict], shape: ModelShape, device: Device, tp: int, devices: int, configs: list[str]) -> dict:
    """The whole profile: ``pools`` (stage: engine args) each at ``tp``, a node of ``devices``."""
    from duet.benchmarks.profile import fit_transfer

    roofline = Roofline(shape, device, tp)
    transfers = [[tokens, roofline.transfer_seconds(tokens)] for tokens in TRANSFER_TOKENS]
    return {
        "machine": {"cpu": device.name, "cores": devices, "flags": [], "roofline": {"device": asdict(device), "shape": asdict(shape), "tp": tp}},
        "configs": configs,
        "pools": {stage: roofline_pool(roofline, engine_args) for stage, engine_args in pools.items()},
        "transfer": {"samples": transfers, "fit": fit_transfer(transfers)},
    }


def device_from(name: str, flops: float | None, bandwidth: float | None, memory_gib: float | None, link: float | None) -> Device:
    """A preset (``DEVICES``) with any figure given instead, or a device of the figures alone."""
    memory = None if memory_gib is None else memory_gib * 2**30
    if name not in DEVICES:
        if None in (flops, bandwidth, memory, link):
            raise SystemExit(f"--roofline {name!r}: a preset ({', '.join(DEVICES)}) or every figure (--flops, --bandwidth, --memory-gib, --link-bandwidth)")
        return Device(f"{name} (roofline)", flops, bandwidth, memory, link)
    changes = {"flops": flops, "bandwidth": bandwidth, "memory_bytes": memory, "link_bandwidth": link}
    return replace(DEVICES[name], **{key: value for key, value in changes.items() if value is not None})


def add_arguments(parser) -> None:
    group = parser.add_argument_group("roofline (a profile of hardware this machine is not, computed: benchmarks/roofline.py)")
    group.add_argument("--roofline", default=None, metavar="DEVICE", help=f"a preset ({', '.join(DEVICES)}) or a name for the figures below")
    group.add_argument("--model-shape", default=None, help=f"a preset ({', '.join(SHAPES)}) or a config.json (default: the config's model)")
    group.add_argument("--tp", type=int, default=1, help="devices a replica spans (tensor parallel)")
    group.add_argument("--devices", type=int, default=8, help="devices a node has (duet plan's default --cores)")
    group.add_argument("--dtype-bytes", type=int, default=2, help="bytes a weight and a KV value take (2: bf16)")
    group.add_argument("--flops", type=float, default=None, help="dense FLOP/s")
    group.add_argument("--bandwidth", type=float, default=None, help="memory bytes/s")
    group.add_argument("--memory-gib", type=float, default=None)
    group.add_argument("--link-bandwidth", type=float, default=None, help="bytes/s between devices, one direction")
    group.add_argument("--max-num-seqs", type=int, default=None, help="sequences a replica batches (default: the config's)")


def from_arguments(args, pools: dict[str, dict], model_dir: str) -> dict:
    """``duet profile --roofline``'s profile of ``pools`` (stage: engine args)."""
    device = device_from(args.roofline, args.flops, args.bandwidth, args.memory_gib, args.link_bandwidth)
    shape = model_shape(args.model_shape or model_dir, args.dtype_bytes)
    if args.max_num_seqs:
        pools = {stage: engine_args | {"max_num_seqs": args.max_num_seqs} for stage, engine_args in pools.items()}
    return roofline_profile(pools, shape, device, args.tp, args.devices, args.config)
