"""LoRA adapters (PEFT's format) applied beside the base weights, per request, in one batch.

An adapter is a PEFT directory: ``adapter_config.json`` and ``adapter_model.safetensors``, with
``A [r, in]`` and ``B [out, r]`` for each projection it targets, scaled by ``lora_alpha / r``
(``/ sqrt(r)`` with rsLoRA). duet's fused products (q/k/v, gate/up) take their parts' adapters as
one: ``A`` the parts' rows stacked, ``B`` block-diagonal by part (a part the adapter leaves out
is zeros), the scale folded into ``B``. A step's rows of each adapter get ``x A^T B^T`` added to
the base product, which every row shares (``LoRAStep``, the step's rows by adapter, set around
the forward: ``Linear`` and the C++ decoder stack read it). On CPUs one C++ call adds every
row's update (``kernels/csrc/lora.cpp``), on CUDA devices one Triton launch
(``kernels/triton_lora.py``); elsewhere torch products per adapter. An adapter is kept in the
model's dtype. No adapter is merged into the weights.

A request names its adapter (``EngineRequest.lora``) and where it lies (``lora_path``: an
engine that does not hold it loads it from there); the prefix cache keys its blocks by both
(``duet.block_pool.chain_root``), so two adapters, or an adapter and the base, never share KV.
An engine holds at most ``max_loras`` adapters (``LoRASlots``): a request whose adapter is not
held waits until one held is used by no running request, which is unloaded, least recently
used first. The worker loads and unloads as the step's ``lora_ops`` say, before its forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from duet.config import ConfigError
from duet.messages import LoRAStats

_PREFIX = "base_model.model."


class LoRAError(ConfigError):
    """An adapter that cannot be applied to this model, with the reason."""


@dataclass
class LoRAWeights:
    """One Linear's update: ``x @ a.T @ bt`` (the scale folded into ``bt``, B transposed)."""

    a: torch.Tensor  # [rank of every part, in_features]
    bt: torch.Tensor  # [rank of every part, out_features]


@dataclass
class LoRAAdapter:
    name: str
    weights: dict[str, LoRAWeights]  # by duet module name (``layers.0.self_attn.qkv_proj``)

    def to(self, device: str) -> LoRAAdapter:
        """The adapter with its weights on ``device``."""
        return LoRAAdapter(self.name, {name: LoRAWeights(w.a.to(device), w.bt.to(device)) for name, w in self.weights.items()})


def load_adapter(name: str, path: str | Path, model, max_rank: int) -> LoRAAdapter:
    """The adapter at ``path`` for ``model`` (a loaded ``LlamaForCausalLM``), checked against
    it: a ``LoRAError`` names what does not fit (rank, targets, shapes, an unreadable path)."""
    from duet.models.loader import _fusion_plan
    from duet.models.linear import Linear

    path = Path(path)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        from safetensors.torch import load_file

        state = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, ValueError) as error:
        raise LoRAError(f"adapter {name!r}: cannot read a PEFT adapter at {path} ({error})") from None
    scaling = _check_config(name, config, max_rank)
    arch = model.whole_arch
    plan = _fusion_plan(arch)
    layers = getattr(model, "layers_held", range(arch.num_layers))  # a pipeline stage's of the whole model's
    weights, used = {}, set()
    for module_name, linear in decoder_of(model).named_modules():
        whole = _whole_name(module_name, layers.start)
        if not isinstance(linear, Linear) or whole.startswith("lm_head") or f"{whole}.weight" not in plan:
            continue
        parts = plan[f"{whole}.weight"]
        part_of = linear.part_of  # a tensor-parallel shard: the whole weight's shape, and its part of it
        out_features, in_features = (linear.out_features, linear.in_features) if part_of is None else (part_of.out_features, part_of.in_features)
        rows = _part_rows(arch, out_features, len(parts))
        found = [_part(name, state, part, in_features, part_rows, used) for part, part_rows in zip(parts, rows)]
        if not any(found):
            continue
        a = torch.cat([part[0] if part else torch.zeros(0, in_features) for part in found])
        b = torch.zeros(out_features, a.shape[0])
        row = column = 0
        for part, part_rows in zip(found, rows):
            if part:
                b[row : row + part_rows, column : column + part[1].shape[1]] = part[1] * scaling
                column += part[1].shape[1]
            row += part_rows
        if part_of is not None:  # the shard's rows of B, and its input features of A (a row-parallel shard's
            b = torch.cat([b[part] for part in part_of.rows])  # updates are then summed over the ranks with its products)
            a = a if part_of.columns is None else a[:, part_of.columns]
        held = linear.weight if linear.weight is not None else linear.gguf.codes
        dtype = linear.weight.dtype if linear.weight is not None else torch.float32  # the model's (blocks alone compute in fp32)
        weights[module_name] = LoRAWeights(a.to(held.device, dtype).contiguous(), b.T.to(held.device, dtype).contiguous())
    unused = sorted(key for key in set(state) - used if _layer_of(key) in (None, *layers))  # other stages' layers: theirs
    if unused:
        raise LoRAError(f"adapter {name!r}: {unused[0]} targets a module this model lacks or duet does not adapt ({len(unused)} such tensors)")
    if not weights and not any(_layer_of(key) is not None for key in state):
        raise LoRAError(f"adapter {name!r} at {path} holds no LoRA weights")
    return LoRAAdapter(name, weights)


def _check_config(name: str, config: dict, max_rank: int) -> float:
    """The adapter's scale, from what ``adapter_config.json`` says; what duet does not
    apply exactly is refused, naming the field."""

    def refuse(field: str, value, wanted: str):
        raise LoRAError(f"adapter {name!r}: {field}={value!r} is not supported: duet applies {wanted}")

    if config.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", config.get("peft_type"), "LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        refuse("r", rank, "a positive rank")
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r}: rank {rank} is above max_lora_rank={max_rank}")
    for field, ok, wanted in (
        ("bias", config.get("bias", "none") == "none", "'none'"),
        ("use_dora", not config.get("use_dora"), "false"),
        ("fan_in_fan_out", not config.get("fan_in_fan_out"), "false"),
        ("modules_to_save", not config.get("modules_to_save"), "none"),
        ("rank_pattern", not config.get("rank_pattern"), "one rank for every module"),
        ("alpha_pattern", not config.get("alpha_pattern"), "one lora_alpha for every module"),
    ):
        if not ok:
            refuse(field, config.get(field), wanted)
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return scaling


def decoder_of(model):
    """The decoder whose module names key an adapter's weights (``LoRAAdapter.weights``, the C++
    decoder stack's): the model, or a pipeline stage's part of it."""
    return model.model if hasattr(model, "layers_held") else model


def _whole_name(module_name: str, first_layer: int) -> str:
    """A module's name in the whole model: a tensor-parallel rank wraps the row-parallel
    projections and the experts in ``SummedOverRanks`` (``.module``); a pipeline stage numbers
    its layers from 0 (``first_layer`` of the whole model's)."""
    name = module_name.replace(".module.", ".").removesuffix(".module")
    match = re.match(r"layers\.(\d+)(\..*)?$", name)
    return name if match is None or not first_layer else f"layers.{int(match.group(1)) + first_layer}{match.group(2) or ''}"


def _layer_of(key: str) -> int | None:
    """The decoder layer an adapter tensor belongs to, None for one of no layer."""
    match = re.search(r"\.layers\.(\d+)\.", key)
    return None if match is None else int(match.group(1))


def _part_rows(arch, out_features: int, num_parts: int) -> list[int]:
    """The output rows of each part of a fused product (q, k, v; gate, up), or of a lone one."""
    if num_parts == 3:
        return [arch.num_heads * arch.head_dim] + [arch.num_kv_heads * arch.head_dim] * 2
    if num_parts == 2:
        return [out_features // 2, out_features // 2]
    return [out_features]


def _part(name: str, state: dict, part: str, in_features: int, rows: int, used: set) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One checkpoint projection's ``(A, B)`` in the adapter (None: it leaves the part out)."""
    base = _PREFIX + part.removesuffix(".weight")
    keys = (f"{base}.lora_A.weight", f"{base}.lora_B.weight")
    if not any(key in state for key in keys):
        return None
    if not all(key in state for key in keys):
        raise LoRAError(f"adapter {name!r}: {base} has one of lora_A and lora_B, not both")
    a, b = (state[key].float() for key in keys)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != rows or a.shape[0] != b.shape[1]:
        raise LoRAError(
            f"adapter {name!r}: {base} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, where this model's "
            f"projection takes {in_features} features to {rows}: an adapter of another base model"
        )
    used.update(keys)
    return a, b


_NONE = torch.empty(0)  # an adapter's A and B^T where it leaves a module out


class LoRAStep:
    """A forward's rows by adapter: ``adapters`` (those some row uses; a row's slot is its
    adapter's index, -1 for the base) and ``row_slots`` (int32, a slot per row)."""

    def __init__(self, adapters: list[LoRAAdapter], row_slots: list[int], device) -> None:
        self.adapters = adapters
        self.row_slots = torch.tensor(row_slots, dtype=torch.int32, device=device)
        self._rows = None  # each adapter's row indices, for the torch updates
        self._ops = None
        self._blocks = None  # the rows by adapter, for the Triton updates
        if self.row_slots.device.type == "cpu":
            from duet.kernels import cpu_ops

            self._ops = cpu_ops.load()
        elif self.row_slots.device.type == "cuda":
            from duet.kernels.triton_lora import LoRABlocks

            weights = [{name: (w.a, w.bt) for name, w in adapter.weights.items()} for adapter in adapters]
            self._blocks = LoRABlocks(weights, row_slots, device)

    @property
    def native(self) -> bool:
        """Whether the C++ updates serve this step (the decoder stack takes such steps)."""
        return self._ops is not None

    def weights(self, module_name: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The A and B^T of ``module_name`` of each slot's adapter (empty: it leaves it out)."""
        held = [adapter.weights.get(module_name) for adapter in self.adapters]
        return [w.a if w is not None else _NONE for w in held], [w.bt if w is not None else _NONE for w in held]

    def apply(self, module_name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base product of ``x``) with each adapter's update added to its rows."""
        if self._ops is not None:
            y = y.contiguous()
            self._ops.lora_add(y, x.contiguous(), self.row_slots, *self.weights(module_name))
            return y
        if self._blocks is not None:
            from duet.kernels.triton_lora import lora_add_triton

            y = y.contiguous()
            lora_add_triton(y, x.contiguous(), self._blocks, module_name)
            return y
        if self._rows is None:
            self._rows = [(self.row_slots == slot).nonzero().flatten() for slot in range(len(self.adapters))]
        for adapter, rows in zip(self.adapters, self._rows):
            weights = adapter.weights.get(module_name)
            if weights is None or rows.numel() == 0:
                continue
            update = (x.index_select(0, rows).to(weights.a.dtype) @ weights.a.T) @ weights.bt
            y = y.index_add(0, rows, update.to(y.dtype))
        return y


_STEP: contextvars.ContextVar[LoRAStep | None] = contextvars.ContextVar("duet_lora_step", default=None)


def current_step() -> LoRAStep | None:
    return _STEP.get()


@contextlib.contextmanager
def applied(step: LoRAStep | None):
    """Run the forward inside with ``step``'s adapters on their rows."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


class LoRASlots:
    """The engine's side: the adapters its worker holds, at most ``max_loras``, in order of last
    use, and the loads and unloads the next step carries to the worker. ``configured``: the
    adapters named in the engine's config (requests may name these without a path), the worker
    holding the first ``max_loras`` from the start. ``check``: the executor's check of an
    adapter it has not seen (raises ``LoRAError``)."""

    def __init__(self, max_loras: int, configured: dict[str, str], check) -> None:
        self.max_loras = max_loras
        self.configured = dict(configured)
        self._check = check
        self._checked = set(self.configured.items())  # the worker checked these at start
        self.held: OrderedDict[str, str] = OrderedDict(list(self.configured.items())[:max_loras])  # name: path
        self.ops: list[tuple[str, str | None]] = []  # (name, path) a load, (name, None) an unload: the next step's
        self.num_loads = self.num_evictions = 0

    def checked(self, name: str, path: str | None) -> bool:
        """Whether ``resolve`` of this adapter would be a lookup (no load to check it)."""
        return (name, path if path is not None else self.configured.get(name)) in self._checked

    def resolve(self, name: str, path: str | None) -> str:
        """The folder of a request's adapter ``name`` (``path``, or the configured one), checked
        the first time it is seen: ``LoRAError`` names what does not fit."""
        path = path if path is not None else self.configured.get(name)
        if path is None:
            raise LoRAError(f"no LoRA adapter {name!r} here; this engine has {sorted(self.configured) or 'none'}")
        if (name, path) not in self._checked:
            self._check(name, path)
            self._checked.add((name, path))
        return path

    def admit(self, name: str, path: str, running) -> bool:
        """Whether a request with adapter ``name`` at ``path`` may run now, beside ``running``
        (requests): held already, or loaded in place of one no running request uses."""
        if self.held.get(name) == path:
            self.held.move_to_end(name)
            return True
        in_use = {request.lora for request in running}
        if name in self.held:  # another folder under the same name: loaded again once unused
            if name in in_use:
                return False
            self._unload(name)
        if len(self.held) >= self.max_loras:
            victim = next((held for held in self.held if held not in in_use), None)
            if victim is None:
                return False
            self._unload(victim)
            self.num_evictions += 1
        self.held[name] = path
        self.ops.append((name, path))
        self.num_loads += 1
        return True

    def _unload(self, name: str) -> None:
        del self.held[name]
        self.ops.append((name, None))

    def take_ops(self) -> list[tuple[str, str | None]]:
        ops, self.ops = self.ops, []
        return ops

    def stats(self) -> LoRAStats:
        return LoRAStats(held=list(self.held), max_loras=self.max_loras, loads=self.num_loads, evictions=self.num_evictions)
