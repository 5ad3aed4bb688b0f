"""Shared fixtures: tiny random Llamas with the small tokenizer committed in
``tests/fixtures/tokenizer`` (the fast tier's: nothing to download), and the real SmolLM2
(downloaded and converted once per machine) for the tests marked ``slow``."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

# The integration tests run a local cluster, which listens on 127.0.0.1 only; every process that
# connects to it must say so before it first imports ray (see duet.cluster.deploy).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # duet.router.serve_internals.LOOPBACK_RAY_ENV

import pytest
import torch

from tests.tiny_families import RANDOM_NORMS, SHARP_ATTENTION, TINY_FAMILIES


# The session's exit status, kept for ``pytest_unconfigure``.
_exit_status: int | None = None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """End the process with the session's status once pytest is done, skipping the interpreter's
    and the native libraries' teardown, which sometimes crashed after every test had passed (a
    segmentation fault with no Python frame). Its cause is not found yet (docs/design.md, "Not
    built yet")."""
    if _exit_status is None or os.environ.get("DUET_TEST_NATURAL_EXIT") == "1":
        return  # a usage error, or asked to tear down as Python does (to look for the crash)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


INTEGRATION = Path(__file__).resolve().parent / "integration"
MULTINODE = INTEGRATION / "test_multinode.py"  # runs a Ray cluster of its own


def pin_cpu_rules() -> None:
    """Measure this CPU's rules here once and pass them on (``DUET_CPU_RULES``) to the processes
    started from now on: Ray's replicas and workers skip their timing (3-4 s each on a 2-core
    AVX2 EPYC, a process start) and take the ways this process takes."""
    from duet.kernels.cpu_rules import RULES_ENV
    from duet.models.linear_rules import measured_cpu_rules

    if RULES_ENV not in os.environ:
        os.environ[RULES_ENV] = json.dumps(measured_cpu_rules())


def pytest_collection_modifyitems(session, config, items) -> None:
    """The integration tests run last, in their order: their cluster, once started, stays up
    to the end of the session, and its idle processes (Serve's controller, proxy, routers and
    replicas) take about half a core, which the tests after them would share. The multi-node
    tests, which run a Ray cluster of their own, go first among them, before that one starts."""
    items.sort(key=lambda item: (item.path.is_relative_to(INTEGRATION), item.path != MULTINODE))


# The tiny models' tokenizer: byte-level BPE with SmolLM2's special tokens and chat template
# (tests/fixtures/make_tokenizer.py made it). Its size is their vocab_size, and the bound of the
# token ids the tests make up.
TINY_TOKENIZER_DIR = Path(__file__).resolve().parent / "fixtures" / "tokenizer"
TINY_VOCAB = 1024


def _ray_is_initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


_RAY_BEFORE = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Keeps the fast tier free of the download: a test that asks for the real SmolLM2 (directly
    or through ``smollm2_tokenizer``, ``parity_prompts``, ...) must be marked ``slow``."""
    item.stash[_RAY_BEFORE] = _ray_is_initialized()
    if "smollm2_dir" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} loads the real SmolLM2 but is not marked slow: mark it, or use the tiny fixtures", pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item) -> None:
    """Keeps the fast tier free of Ray: a test after which Ray runs where it did not before (it
    started or joined a cluster, and a fixture of its own did not stop it) must be marked
    ``slow``. Ray left running by an earlier slow test's session fixture is not this one's."""
    if not item.stash.get(_RAY_BEFORE, True) and _ray_is_initialized() and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} runs Ray but is not marked slow: mark it", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from duet.models.gguf_convert import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir() -> Path:
    """The small tokenizer's directory (tokenizer.json, tokenizer_config.json, chat template)."""
    return TINY_TOKENIZER_DIR


MISTRAL_CONTROL_TOKENS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


@pytest.fixture(scope="session")
def mistral_tokenizer_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """The small tokenizer with Mistral's control tokens added as special tokens (as Mistral
    7B v0.3's has them) and a Mistral-style chat template (``tests/fixtures/mistral/``)."""
    from transformers import AutoTokenizer

    target = tmp_path_factory.mktemp("mistral-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": MISTRAL_CONTROL_TOKENS})
    tokenizer.chat_template = (Path(__file__).parent / "fixtures" / "mistral" / "chat_template.jinja").read_text()
    tokenizer.save_pretrained(str(target))
    return target


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    """transformers' view of the small tokenizer (the tiny models')."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


def make_tiny_llama(target: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight Llama with the tokenizer of ``tokenizer_dir`` (its vocab_size the
    tokenizer's size), saved as a Hugging Face directory.

    ``overrides`` change the config; a smaller ``vocab_size`` keeps the first ids of the tokenizer.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).float()
    # Spread the logits so that greedy choices are not near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == settings["num_hidden_layers"]
    return target


def drain(engine, max_steps: int) -> tuple[dict[str, list[int]], dict[str, str | None]]:
    """Step ``engine`` until it has nothing left (at most ``max_steps`` steps): each request's
    tokens, and each finished request's error (None when it ended well)."""
    tokens, errors = {}, {}
    for _ in range(max_steps):
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            if delta.finished:
                errors[delta.request_id] = delta.error
        if not engine.has_unfinished_requests():
            break
    return tokens, errors


def make_tiny_mixtral(target: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight Mixtral (4 experts, 2 per token) with the tokenizer of ``tokenizer_dir``."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**settings)).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # no near-ties among greedy choices
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    return target


def make_tiny_model(
    target: Path, tokenizer_dir: Path, family: str, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """A random-weight checkpoint of one of ``TINY_FAMILIES``, saved by transformers itself with the
    tokenizer of ``tokenizer_dir`` (in shards of ``max_shard_size``, with their index, if given)."""
    import transformers
    from transformers import AutoTokenizer

    config_name, model_name, shape = TINY_FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    settings = dict(
        vocab_size=len(tokenizer), num_hidden_layers=2, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    settings.update(shape)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**settings)).float()
    with torch.no_grad():
        if settings["tie_word_embeddings"]:  # the layers' outputs grow, or the input embedding drowns them
            for name, weight in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    weight.mul_(8.0)
        else:
            model.lm_head.weight.mul_(8.0)  # no near-ties among greedy choices
        for name, bias in model.named_parameters():  # transformers starts biases at zero: nothing would test them
            if name.endswith(".bias"):
                bias.normal_(0.0, 0.2)
        if family in RANDOM_NORMS:
            for name, weight in model.named_parameters():
                if name.endswith("norm.weight"):
                    weight.normal_(1.0, 0.3)
        if family in SHARP_ATTENTION:  # peaked scores: a token's rotation decides what it attends to
            config = model.config
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            qk_rows = (config.num_attention_heads + config.num_key_value_heads) * head_dim
            for name, weight in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight")):  # OLMo 2 normalises q/k: its norms scale them
                    weight.mul_(SHARP_ATTENTION[family])
                elif name.endswith("qkv_proj.weight"):  # Phi-3's fused q, k, v: q's and k's rows
                    weight[:qk_rows].mul_(SHARP_ATTENTION[family])
    model.save_pretrained(str(target), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(str(target))
    return target


def refusals(path: Path, tmp_path: Path, edits: dict) -> None:
    """For each ``message: edit``, ``path`` linked file by file into a folder of ``tmp_path`` with
    its ``quantization_config`` changed by ``edit``: loading it is refused with ``message``."""
    from duet import LLM
    from duet.errors import UnsupportedCheckpointError

    config = json.loads((path / "config.json").read_text())
    for index, (message, edit) in enumerate(edits.items()):
        edited = tmp_path / f"edited-{index}"
        edited.mkdir(parents=True)
        for file in path.iterdir():
            if file.name != "config.json":
                (edited / file.name).symlink_to(file)
        changed = json.loads(json.dumps(config))
        edit(changed["quantization_config"])
        (edited / "config.json").write_text(json.dumps(changed))
        with pytest.raises(UnsupportedCheckpointError, match=re.escape(message)):
            LLM(model=str(edited), num_kv_blocks=16)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_gguf_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from tests.gguf_writer import make_tiny_gguf_llama

    return make_tiny_gguf_llama(tmp_path_factory.mktemp("tiny-gguf-llama"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def parity_prompts(smollm2_tokenizer) -> list[list[int]]:
    from duet.benchmarks.prompts import encode_conversations, parity_conversations

    return encode_conversations(smollm2_tokenizer, parity_conversations())


@pytest.fixture(scope="session")
def parity_references(smollm2_dir, parity_prompts):
    """transformers' greedy tokens for the 16 parity prompts, computed once per test session."""
    from duet.benchmarks.prompts import PARITY_NEW_TOKENS
    from tests.reference import hf_greedy

    return hf_greedy(smollm2_dir, parity_prompts, PARITY_NEW_TOKENS, processes=2)
