"""Checkpoints that ship quantized, written by compressed-tensors as llm-compressor writes them
(``pack-quantized`` W4A16, W4A16_ASYM as AWQ leaves it, and W8A16, with zero points too;
``int-quantized`` W8A8; ``float-quantized`` FP8), kept in their packed form: every packed weight
computes from blocks that dequantize to compressed-tensors' own dequantization bit for bit,
greedy output equals transformers running the same checkpoint, no float copy of a packed weight
is kept, and schemes duet does not compute exactly are refused naming the field."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from duet import LLM, SamplingParams
from duet.errors import UnsupportedCheckpointError
from duet.kernels.gguf import F8, Q8Z
from duet.models.linear import Linear
from duet.models.quantize import QuantizationError
from tests.compressed_writer import make_compressed_checkpoint, quantize_inputs_as_compressed_tensors, reference_file, reference_weights
from tests.conftest import make_tiny_model, refusals
from tests.reference import check_outputs, hf_greedy

# The writer, in the test extras. Found, not imported: it imports triton, which must not be
# imported before tests/kernels/test_triton_kernels.py chooses Triton's interpreter.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="compressed-tensors is not installed")

PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33, list(range(900, 917))]
NEW_TOKENS = 10
# (family, bits, group size: None for a scale per channel, shape overrides[, symmetric[, W8A8[,
# activation ordering[, static inputs]]]]): groups of 128 need 128-wide inputs.
SCHEMES = {
    "qwen3-w4-g32": ("qwen3", 4, 32, {}),
    "qwen3-w4-channel": ("qwen3", 4, None, {}),
    "llama-w4-g128": ("llama3-rope", 4, 128, dict(hidden_size=128, intermediate_size=256)),
    "qwen3-w8-g32": ("qwen3", 8, 32, {}),
    "phi3-w8-channel": ("phi3", 8, None, {}),
    "llama-w4-g128-asym": ("llama3-rope", 4, 128, dict(hidden_size=128, intermediate_size=256), False),  # AWQ's
    "qwen3-w4-channel-asym": ("qwen3", 4, None, {}, False),
    # 8-bit codes with zero points (q - z spans 9 bits): Q8Z blocks.
    "qwen3-w8-g32-asym": ("qwen3", 8, 32, {}, False),
    "phi3-w8-channel-asym": ("phi3", 8, None, {}, False),
    # W8A8 (int-quantized: int8 codes as they are; float-quantized: FP8), inputs quantized per token at run time.
    "qwen3-w8a8-channel": ("qwen3", 8, None, {}, True, "int"),
    "phi3-w8a8-g32": ("phi3", 8, 32, {}, True, "int"),
    "qwen3-fp8-channel": ("qwen3", 8, None, {}, True, "float"),
    "llama-fp8-channel": ("llama3-rope", 8, None, {}, True, "float"),  # plain Llama layers: the C++ decoder stack's
    # Static schemes: the inputs at one calibrated scale a tensor (FP8's default in llm-compressor).
    "qwen3-w8a8-static": ("qwen3", 8, None, {}, True, "int", None, True),
    "phi3-w8a8-static-asym": ("phi3", 8, None, {}, True, "int", None, "asymmetric"),
    "llama-fp8-static": ("llama3-rope", 8, None, {}, True, "float", None, True),
    # llm-compressor's GPTQ default: its config says so, its format is W4A16's.
    "llama-w4-g32-static-order": ("llama3-rope", 4, 32, {}, True, None, "static"),
    # Groups out of activation order (a weight_g_idx each), as compressed-tensors wrote them up to 0.18.
    "llama-w4-g32-group-order": ("llama3-rope", 4, 32, {}, True, None, "group"),
    "qwen3-w4-g32-asym-group-order": ("qwen3", 4, 32, {}, False, None, "group"),
    "qwen3-w8-g32-asym-group-order": ("qwen3", 8, 32, {}, False, None, "group"),
    "phi3-w8a8-g32-group-order": ("phi3", 8, 32, {}, True, "int", "group"),  # int-quantized: int8 codes as they are
}


def _schemes(names) -> list:
    """``names`` as parameters: a group-ordered one is slow (its writer is installed from the
    package index on first use and runs in a child process), kept out of the fast tier."""
    return [pytest.param(name, marks=pytest.mark.slow) if SCHEMES[name][6:7] == ("group",) else name for name in names]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer_dir):
    made = {}

    def get(name: str):
        if name not in made:
            family, bits, group_size, shape, *options = SCHEMES[name]
            symmetric, w8a8, actorder, static = options + [True, None, None, False][len(options):]
            root = tmp_path_factory.mktemp(name)
            source = make_tiny_model(root / "float", tiny_tokenizer_dir, family, **shape)
            path = make_compressed_checkpoint(
                source, root / "packed", bits, group_size, symmetric=symmetric, w8a8=w8a8, actorder=actorder, static_inputs=static,
            )
            # transformers loads no packed zero points (it expects them unpacked): an asymmetric
            # checkpoint's reference is transformers on its weights as compressed-tensors dequantizes them.
            # Nor does it read compressed-tensors' activation order by group any more.
            reference = path if symmetric and actorder != "group" else _dequantized_twin(path, root / "dequantized")
            # A W8A8 twin quantizes its inputs as compressed-tensors' own forward does.
            prepare = quantize_inputs_as_compressed_tensors(path) if reference != path and w8a8 else None
            made[name] = (path, hf_greedy(reference, PROMPTS, NEW_TOKENS, prepare=prepare))
        return made[name]

    return get


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def _reference_weights(path) -> dict[str, torch.Tensor]:
    """Each packed weight as compressed-tensors' own code dequantizes it (a group-ordered
    checkpoint's: as its writer's did, which reads its ``weight_g_idx``)."""
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    if config["config_groups"]["group_0"]["weights"].get("actorder") == "group":
        return load_file(reference_file(path))
    return reference_weights(path)


def _dequantized_twin(path, target):
    """The checkpoint as a float one: each packed weight replaced by compressed-tensors' own
    dequantization of it (a lossless reference: those are the weights)."""
    import shutil

    from safetensors.torch import save_file

    state = load_file(str(path / "model.safetensors"))
    weights = _reference_weights(path)
    packed = tuple(f"{name}_" for name in weights)  # x.weight_packed, x.weight_scale, ...
    floats = {name: tensor for name, tensor in state.items() if not name.startswith(packed) and name not in weights}
    floats |= {name: weight.contiguous() for name, weight in weights.items()}
    target.mkdir()
    for file in path.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            shutil.copy(file, target / file.name)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    save_file(floats, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _linears_and_their_weights(checkpoints, name: str):
    """The checkpoint's model, loaded, and each of its linear layers but the LM head with the
    weight compressed-tensors' own code dequantizes its parts to (fused products: their rows)."""
    from duet.models.loader import _fusion_plan, load_model

    path, _ = checkpoints(name)
    model = load_model(path, torch.float32, "cpu", 256)
    reference = _reference_weights(path)
    plan = _fusion_plan(model.arch)
    linears = [
        (module_name, linear, torch.cat([reference[part] for part in plan[f"{module_name}.weight"]]))
        for module_name, linear in model.named_modules() if isinstance(linear, Linear) and module_name != "lm_head"
    ]
    assert len(linears) == 4 * model.arch.num_layers  # q/k/v, o, gate/up, down
    return model, linears


@pytest.mark.parametrize("name", _schemes(SCHEMES))
def test_a_packed_checkpoint_computes_from_its_codes_and_matches_transformers(checkpoints, name):
    path, references = checkpoints(name)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    check_outputs(llm.generate(PROMPTS, _greedy()), references, name)
    llm.engine.check_integrity()


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-w4-g32", "llama-w4-g128", "phi3-w8-channel", "llama-w4-g128-asym", "qwen3-w4-channel-asym", "llama-w4-g32-static-order",
        "qwen3-fp8-channel", "llama-fp8-static", "qwen3-w8-g32-asym", "phi3-w8-channel-asym",
        *_schemes(["llama-w4-g32-group-order", "qwen3-w4-g32-asym-group-order", "qwen3-w8-g32-asym-group-order", "phi3-w8a8-g32-group-order"]),
    ],
)
def test_the_blocks_are_the_checkpoints_weights_bit_for_bit_and_no_float_copy_is_kept(checkpoints, name):
    """Fused products (q/k/v, gate/up; Phi-3's fused in the file) hold their parts' rows; a zero
    point's codes ``q - z`` are int8 blocks (Q8_0), a symmetric 4-bit scheme's Q4_1 blocks, FP8's
    float8 weights float8 blocks (a scale a channel, or the tensor's: ``llama-fp8-static``), 8-bit
    codes with zero points Q8Z blocks (``q - z`` spans 9 bits). Groups out of order (a
    ``weight_g_idx`` each): the blocks hold the input features sorted by group, and the Linear
    takes its input in that order."""
    from duet.models.loader import _fusion_plan

    model, linears = _linears_and_their_weights(checkpoints, name)
    state = load_file(str(checkpoints(name)[0] / "model.safetensors"))
    for module_name, linear, expected in linears:
        assert linear.weight is None and linear.packed_weight is None, f"{module_name} keeps a float weight"
        if name.endswith("group-order"):  # q/k/v (gate/up) read one input: GPTQ orders their features alike
            g_idx = state[_fusion_plan(model.arch)[f"{module_name}.weight"][0] + "_g_idx"]
            assert not torch.equal(g_idx, g_idx.sort().values), module_name  # the features were grouped out of order
            assert torch.equal(linear.input_order, torch.argsort(g_idx, stable=True)), module_name
            expected = expected[:, linear.input_order]
        else:
            assert linear.input_order is None, module_name
        assert torch.equal(linear.gguf.dequantize(), expected.float()), module_name
        assert linear.gguf.codes.element_size() * linear.gguf.codes.numel() <= expected.numel()  # at most a byte a weight
        if "fp8" in name:
            assert linear.gguf.qtype == F8
        elif name.startswith(("qwen3-w8", "phi3-w8")) and "asym" in name:
            assert linear.gguf.qtype == Q8Z
        else:
            assert linear.gguf.qtype == (3 if name.startswith(("qwen3-w4", "llama-w4")) and "asym" not in name else 8)
    assert model.lm_head.weight is not None  # left in floats by the checkpoint (``ignore: [lm_head]``)


def test_a_checkpoint_calibrated_in_activation_order_says_so_and_is_read_as_any_other(checkpoints):
    """llm-compressor's GPTQ records ``actorder: static`` by default (its groups stay in order):
    such a checkpoint was refused before, naming the field; its parity and blocks are checked above."""
    path, _ = checkpoints("llama-w4-g32-static-order")
    weights = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert weights["actorder"] in ("static", "weight")
    assert LLM(model=str(path), num_kv_blocks=16).engine.num_blocks == 16


def test_schemes_duet_does_not_compute_exactly_are_refused_naming_the_field(checkpoints, tmp_path):
    path, _ = checkpoints("qwen3-w4-g32")
    refusals(path, tmp_path, {
        "weights.group_size=16": lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=16),
        "input_activations='...' is not supported: duet reads weight-only": lambda q: q["config_groups"]["group_0"].update(
            input_activations={"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"}
        ),
        "quant_method='bitsandbytes' is not supported": lambda q: q.update(quant_method="bitsandbytes"),
        "weights.actorder='random' is not supported": lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="random"),
        "weights.symmetric='no' is not supported": lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric="no"),
    })
    with pytest.raises(QuantizationError, match="ships quantized .4-bit weights.: quantization='int8' does not apply"):
        LLM(model=str(path), num_kv_blocks=16, quantization="int8")
    w8a8, _ = checkpoints("qwen3-w8a8-channel")
    refusals(w8a8, tmp_path / "w8a8", {  # W8A8 with static scales, or one scale a tensor: not what duet computes
        "input_activations.dynamic=False is not supported": lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
        "input_activations.strategy='tensor' is not supported": lambda q: q["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"),
    })


def test_a_static_scheme_needs_one_input_scale_for_the_parts_of_a_fused_product(checkpoints, tmp_path):
    """q/k/v (and gate/up) read one input and are computed as one product: calibrated apart to
    different scales, they are refused, naming the parts; a Linear without its scale likewise."""
    import shutil

    from safetensors.torch import load_file, save_file

    from duet.errors import DamagedCheckpointError

    path, _ = checkpoints("qwen3-w8a8-static")
    state = load_file(str(path / "model.safetensors"))
    for name, edit in {"different": lambda t: t.update({"model.layers.0.self_attn.k_proj.input_scale": t["model.layers.0.self_attn.k_proj.input_scale"] * 2}),
                       "missing": lambda t: t.pop("model.layers.1.mlp.down_proj.input_scale")}.items():
        edited = tmp_path / name
        shutil.copytree(path, edited)
        tensors = dict(state)
        edit(tensors)
        save_file(tensors, str(edited / "model.safetensors"), metadata={"format": "pt"})
        error = UnsupportedCheckpointError if name == "different" else DamagedCheckpointError
        message = "q_proj, .*k_proj, .*v_proj quantize their one input with different input_scales" if name == "different" else "no input_scale for .*down_proj.weight"
        with pytest.raises(error, match=message):
            LLM(model=str(edited), num_kv_blocks=16)


def test_experts_shipped_in_float8_are_refused(tmp_path, tiny_tokenizer_dir):
    """compressed-tensors 0.20 leaves transformers' fused experts in floats; earlier versions
    quantized each expert's linears (FP8 Mixtral checkpoints ship so). duet keeps float8 weights
    as blocks, and quantizes inputs, for linear layers only: refused, not computed on floats and
    unquantized inputs. (The expert's weight is made float8 here as those versions wrote it.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    source = make_tiny_model(tmp_path / "float", tiny_tokenizer_dir, "qwen3-moe")
    path = make_compressed_checkpoint(source, tmp_path / "fp8", 8, None, w8a8="float")
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    scale = state[name].abs().amax(1, keepdim=True) / 448
    state[name], state[name + "_scale"] = (state[name] / scale).to(torch.float8_e4m3fn), scale
    edited = tmp_path / "edited"
    shutil.copytree(path, edited)
    save_file(state, str(edited / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedCheckpointError, match=f"{name} ships packed, and duet computes it from floats only .quantized experts"):
        LLM(model=str(edited), num_kv_blocks=16)


@pytest.mark.slow
@pytest.mark.parametrize("name", _schemes(["qwen3-w4-g32", "llama-w4-g32-group-order", "phi3-w8a8-g32-group-order"]))
def test_tp2_shards_the_packed_codes_and_matches_transformers(ray_cluster, checkpoints, name):
    """A group-ordered one's o_proj is kept whole on each rank and its down projection split by
    whole groups of its own order, as GPTQ's activation order is."""
    path, references = checkpoints(name)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        check_outputs(llm.generate(PROMPTS, _greedy()), references, f"{name} at TP=2")
    finally:
        llm.engine.close()


@pytest.mark.parametrize(
    "name", ["qwen3-w8a8-channel", "phi3-w8a8-g32", "qwen3-fp8-channel", "qwen3-w8a8-static", "phi3-w8a8-static-asym", "llama-fp8-static"]
)
def test_w8a8_quantizes_each_products_input_as_compressed_tensors_does(checkpoints, name):
    """A 70-token prompt's log-probabilities, every product's input quantized row by row (or at
    the checkpoint's calibrated scale for the whole tensor: a static scheme), against
    transformers running the same checkpoint: most within a few ulps, a few rows apart where an
    input sat on a rounding boundary (products summed in another order move it across, and the
    code it takes changes by one step of 1/127.5 of the row's largest value, and attention carries
    that to the positions after it): how many depends on the CPU's order of additions (9 of 69
    rows past 1e-4 for qwen3-w8a8-channel on a 2-core AMD EPYC with AVX512-BF16, at most 5 on
    the Xeons before), so at most a fifth are allowed. The same model with its inputs left in
    floats is off at most rows (what the comparison would miss)."""
    from tests.duet.test_length_rope import transformers_run

    path, _ = checkpoints(name)
    prompt = PROMPTS[1]
    _, _, expected = transformers_run(path, prompt)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def errors() -> torch.Tensor:
        output = llm.generate([prompt], params)[0]
        got = [output.prompt_logprobs[position][prompt[position]] for position in range(1, len(prompt))]
        return (torch.tensor(got, dtype=torch.float64) - torch.tensor(expected, dtype=torch.float64)).abs()

    quantized = errors()
    assert quantized.median() < 1e-5 and (quantized > 1e-4).sum() <= len(quantized) // 5 and quantized.max() < 1e-2, quantized.tolist()
    linears = [module for module in llm.engine.executor.worker.runner.model.modules() if isinstance(module, Linear)]
    assert sum(linear.input_quantization is not None for linear in linears) == len(linears) - 1  # all but the LM head
    for linear in linears:
        linear.input_quantization = None
    assert errors().median() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-w8a8-channel", "phi3-w8a8-g32", "phi3-w8a8-static-asym"])
def test_w8a8_at_tp2_scales_each_row_over_every_ranks_features(ray_cluster, checkpoints, name):
    """A row's scale is its largest magnitude over all its features, which o and down split over
    the ranks: each rank takes the largest of every rank's, so the prompt's log-probabilities are
    transformers' within as many rounding-boundary rows as one process's (a rank scaling
    by its own features alone moves every row of those products), and greedy tokens are too. A
    static scheme's one scale holds on every rank."""
    from tests.duet.test_length_rope import transformers_run

    path, references = checkpoints(name)
    prompt = PROMPTS[1]
    _, _, expected = transformers_run(path, prompt)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
        got = [output.prompt_logprobs[position][prompt[position]] for position in range(1, len(prompt))]
        errors = (torch.tensor(got, dtype=torch.float64) - torch.tensor(expected, dtype=torch.float64)).abs()
        assert errors.median() < 1e-5 and (errors > 1e-4).sum() <= len(errors) // 5 and errors.max() < 1e-2, errors.tolist()
        check_outputs(llm.generate(PROMPTS, _greedy()), references, f"{name} at TP=2")
        llm.engine.check_integrity()
    finally:
        llm.engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_inputs_in_one_call_are_the_torch_compositions_bit_for_bit(dtype):
    """FP8 W8A8's inputs in one C++ call (``float8_rows``) are ``per_token_codes``' codes times
    scales in torch, in fp32 and in bf16 (every step rounded to bf16), on rows with a zero row,
    values half-way between float8 codes, subnormal codes, an outlier and a NaN (its row all NaN);
    and at a static scheme's scale, ``StaticInput``'s torch composition."""
    from duet.kernels import cpu_ops
    from duet.kernels.w8a8 import FLOAT8_PER_TOKEN, FLOAT8_STATIC, StaticInput, dynamic_per_token, per_token_codes

    ops = cpu_ops.load_gguf()
    if ops is None:
        pytest.skip("no C++ toolchain")
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 576, generator=generator) * torch.logspace(-4, 3, 40)[:, None]).to(dtype)
    x[3] = 0
    x[5, :6] = torch.tensor([448.0, 1.0625, -1.1875, 0.01, 2.0**-9 * 1.5, 3.0]).to(dtype)  # scale 1: ties, a subnormal
    x[7, 100] = 1e4
    x[9, 9] = float("nan")
    codes, scales = per_token_codes(x, FLOAT8_PER_TOKEN)
    expected = codes * scales
    got = ops.float8_rows(x)
    assert got.dtype == dtype and torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
    assert got[9].isnan().all() and scales[5].item() == 1.0 and got[5, 1].item() in (1.0, 1.125)
    assert torch.equal(dynamic_per_token(x[:8], FLOAT8_PER_TOKEN), expected[:8])  # the Python path takes the call
    # a static scheme's one calibrated scale (fp32 or bf16, as the checkpoint has it): each step in
    # the dtype torch's type promotion gives it, as StaticInput composes it in torch
    for scale_dtype in (torch.float32, torch.bfloat16):
        static = StaticInput(FLOAT8_STATIC, torch.tensor([0.0371], dtype=scale_dtype))
        expected = static.in_torch(x)
        got = ops.float8_rows(x, static.scale)
        assert got.dtype == dtype and torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0)), scale_dtype
        assert torch.equal(static(x[:8]), got[:8])
    half = StaticInput(FLOAT8_STATIC, torch.tensor([0.0371], dtype=torch.float16))  # a scale the call does not take: torch's way
    assert not half.in_one_call and torch.equal(half(x[:8]), half.in_torch(x[:8]))


@pytest.mark.parametrize("name", ["llama-fp8-channel", "llama-fp8-static"])
def test_fp8_w8a8_runs_in_the_decoder_stack_to_the_loops_bits(checkpoints, name):
    """FP8 W8A8 (per token, or at a static scale) with plain Llama layers leaves Python for the C++
    decoder stack (its inputs quantized there by the same call), which computes each short step
    to the very bits of the layer loop; its greedy parity with transformers is checked above."""
    from tests.duet.test_decoder_stack import _check_every_short_step, _generate

    path, _ = checkpoints(name)
    llm = LLM(model=str(path), num_kv_blocks=1024, max_num_seqs=136, max_num_batched_tokens=2048)
    model = llm.engine.executor.worker.runner.model
    linears = [module for module in model.modules() if isinstance(module, Linear) and module.input_quantization is not None]
    assert model.decoder_stack() is not None and linears and all(linear.float8_inputs_in_one_call for linear in linears)
    rows = _check_every_short_step(model)
    _generate(llm, [1, 5, 60, 136])
    assert {1, 5, 60, 136} <= set(rows["stack"]) and rows["python"]
    llm.engine.check_integrity()
