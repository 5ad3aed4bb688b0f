"""Batch-invariant inference (``batch_invariant: true``): a request's tokens and logprobs, bit for
bit, whatever shares its steps, however its prompt is chunked and whether its prefix was cached.

A row's values change with the batch wherever a kernel's order of additions depends on the
batch. Under this mode every computation a token depends on is free of that:

- **Products** (every ``Linear``, the LM head included) sum each output over k in one fixed
  order, a fused multiply-add a k from zero, whatever the row count, the row's place and the
  threads, where oneDNN and MKL choose kernels, blockings and splits by the row count
  (``Linear.make_batch_invariant``): GGUF blocks with AVX-512's panel layout by panels for every
  row count (as the default takes them from 12 rows or so), other weights through a kernel of
  their own over the float weight laid out in panels (``kernels/csrc/batch_invariant.cpp``), in
  place of oneDNN's packed copy, and blocks alone without the panel layout (CPUs without
  AVX-512) by tiles of rows for every row count.
- **Attention** of every query row, prompt chunks, decode steps and speculative verification
  alike, goes through the C++ prompt kernel (``kernels/csrc/prompt_attention.cpp``): a row's
  scores, online softmax and weighted sum run over the keys in chunks of fixed size from
  position 0 (under a sliding window, from the first chunk it sees), computed per row, so a
  row's output is the same in any chunk, any batch, and from cached or recomputed keys.
- **Experts** (``MixtralMoE``): each expert's two products go by the same panels as a
  ``Linear``'s, and a token adds its experts' outputs in their index order.
- **Norms, RoPE, activations, embeddings** were per row already (``cpu_ops``' kernels are
  parallel over rows, each row reduced in one order); so is the sampler (per-row softmax, a
  seeded generator per request). Gemma's GeGLU and capped logits go through torch's tanh, whose
  elementwise kernels split a tensor's values between vector and scalar code, and between
  threads, by the tensor's size: under this mode it is called on one row at a time
  (``llama.by_row``). Attention's soft caps are the prompt kernel's, per row.

What is not built yet: GPU models (the Triton path). ``make_batch_invariant`` refuses them.
"""

from __future__ import annotations

from torch import nn

from duet.config import ConfigError
from duet.kernels import cpu_ops
from duet.kernels.torch_attention import supports_batch_invariance
from duet.models.linear import Linear


def make_batch_invariant(model: nn.Module) -> None:
    """Make every product of ``model`` sum in one order whatever the rows (``Linear.
    make_batch_invariant``) and every attention row take the prompt kernel; a ``ConfigError``
    saying why, before changing anything but products already made so, where ``model`` has parts
    that are not built for it."""
    from duet.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
    from duet.models.mixtral import MixtralMoE

    def refuse(reason: str) -> None:
        raise ConfigError(f"batch_invariant: the model {reason}; not built yet")

    if cpu_ops.load_gguf() is None or cpu_ops.load() is None:
        refuse("needs duet's C++ CPU kernels, which are off (DUET_CPU_OPS=0) or did not build here")
    if not isinstance(model, LlamaForCausalLM):
        refuse(f"is a {type(model).__name__}")
    if any(param.device.type != "cpu" for param in model.parameters()):
        refuse("is not on the CPU")
    for module in model.modules():
        if isinstance(module, LlamaAttention):
            if not supports_batch_invariance(module.head_dim):
                refuse(f"has a head size ({module.head_dim}) the C++ prompt attention does not take")
    for module in model.modules():
        if isinstance(module, Linear):
            module.make_batch_invariant()
        elif isinstance(module, LlamaAttention):
            module.batch_invariant = True
        elif isinstance(module, MixtralMoE):
            module.make_batch_invariant()
        elif isinstance(module, LlamaMLP):
            module.by_row = True
    model.batch_invariant = True
