"""The small tokenizer in ``tests/fixtures/tokenizer`` (the tiny models', the fast tier's) is what
``tests/fixtures/make_tokenizer.py`` makes, and loads as the tests take it: by transformers and
by the router's torch-free tokenizer, with SmolLM2's special tokens at the ids the tiny models'
configs name (BOS 1, EOS 2)."""

from __future__ import annotations

from tests.conftest import TINY_TOKENIZER_DIR, TINY_VOCAB
from tests.fixtures import make_tokenizer


def test_the_committed_files_are_what_the_script_makes():
    made = make_tokenizer.files()
    assert sorted(made) == sorted(path.name for path in TINY_TOKENIZER_DIR.iterdir())
    for name, text in made.items():
        assert (TINY_TOKENIZER_DIR / name).read_text(encoding="utf-8") == text, f"{name}: run python -m tests.fixtures.make_tokenizer"


def test_transformers_and_the_router_load_it_alike(tiny_tokenizer):
    from duet.router.tokenizer import RouterTokenizer

    assert len(tiny_tokenizer) == TINY_VOCAB == make_tokenizer.VOCAB_SIZE
    assert (tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id) == (1, 2, 2)
    assert tiny_tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    router = RouterTokenizer(TINY_TOKENIZER_DIR)
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    ids = router.encode_chat(conversation)
    expected = tiny_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    text = tiny_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM") and text.endswith("<|im_start|>assistant\n")
