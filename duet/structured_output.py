"""What a request's output must match (vLLM's ``structured_outputs``), as llguidance grammars.

One of: a JSON schema, any JSON object, a regular expression, a choice of strings, or a grammar
(Lark, or GBNF/EBNF as llama.cpp and vLLM write it). Importable without torch: the router
refuses a bad constraint with a 400 before it admits the request, by the same check the
engine's offline API runs. The engine's side (a matcher per request, the batch's token masks)
is ``duet.grammar_masks``.

Why llguidance rather than xgrammar (``duet bench grammar`` measures both; both took every
schema of its set): its grammars are checked without torch (xgrammar imports torch, which the
router must not), and a request waits 0.3-1 ms for its first mask against xgrammar's 4-30 ms of
eager compilation. Its masks cost about twice xgrammar's per row (0.19 against 0.10 ms a step
for 32 rows): with the forward pass on a GPU the engine fills them on another thread meanwhile;
on a CPU, in line, they take 0.1 ms a step at batch 1 and 0.8 ms (1.5%) at batch 32.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from duet import reasoning
from duet.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# Compact JSON as Python's json.dumps writes it: a model may not pad its output with whitespace
# until max_tokens runs out. A schema may ask for other separators with llguidance's own
# "x-guidance" key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The longest constraint a request may bring, as text (a choice's strings as one JSON list): its
# grammar is compiled, checked against the tokenizer and built into a matcher on the engine's
# thread, between everyone's steps, in time that grows faster than its size (60,000 choices in
# 530 KB took 13 s). Tool and response schemas are a few KB.
MAX_CONSTRAINT_CHARS = 64 * 1024
# A GBNF/EBNF rule (``root ::= ...``) at the start of a line; Lark writes ``start: ...``.
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)


class StructuredOutputsError(InvalidRequestError):
    """The constraint cannot be used; the message names the problem (HTTP 400)."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message, param)


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint, validated when built.

    ``json``: a JSON schema (a dict, or its text; kept as compact text, the key its compiled
    grammar is cached under). ``json_object``: any JSON object. ``regex``: the whole output matches it
    (Rust regex syntax: no look-around, no backreferences). ``choice``: the output is one of
    these strings. ``grammar``: Lark, or GBNF/EBNF with ``root ::= ...``. ``reasoning``: where
    the output starts in or before its reasoning (``duet.reasoning``), which is left free.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning: str | None = None  # the constraint applies after the reasoning (duet.reasoning's modes)

    def __post_init__(self) -> None:
        if self.reasoning is not None and self.reasoning not in reasoning.MODES:
            raise StructuredOutputsError(f"reasoning must be one of {', '.join(reasoning.MODES)} or None, got {self.reasoning!r}")
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                f"structured_outputs takes exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}"
            )
        if self.json is not None:
            object.__setattr__(self, "json", _compact_schema(self.json))
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
            if not choice or not all(isinstance(item, str) and item for item in choice):
                raise StructuredOutputsError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputsError(f"{kind} must be a non-empty string")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise StructuredOutputsError(
                f"the {self.kind} constraint has {len(self.text)} characters; at most {MAX_CONSTRAINT_CHARS} are taken"
            )
        compiled_grammar(self.kind, self.text)  # raises when llguidance refuses it

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as one string: the key its compiled grammar is cached under."""
        if self.json_object:
            return ""
        if self.choice is not None:
            return json.dumps(list(self.choice))
        return getattr(self, self.kind)

    def grammar_text(self) -> str:
        """llguidance's grammar for this constraint (cached by its text), after the reasoning
        where it has one."""
        grammar = compiled_grammar(self.kind, self.text)
        return grammar if self.reasoning is None else reasoning.after_reasoning(grammar, self.reasoning)

    def check_tokens(self, tokenizer) -> None:
        """Raise ``StructuredOutputsError`` if the constraint names tokens the model's tokenizer
        (an ``llguidance.LLTokenizer``) lacks, such as an unknown special token or token id in a
        grammar: what the check made when the constraint was built cannot see."""
        problem = _tokenizer_problem(self.grammar_text(), tokenizer)
        if problem:
            raise StructuredOutputsError(f"the {self.kind} constraint does not fit this model's tokenizer: {first_line(problem)}")


def first_line(error: str) -> str:
    """llguidance's error without the parser state it dumps after the first line."""
    return error.strip().splitlines()[0] if error.strip() else "refused"


def _compact_schema(schema: str | dict) -> str:
    """The schema as compact JSON text. Keys keep their order: a schema's properties are
    generated in the order it lists them."""
    try:
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, dict):
            raise StructuredOutputsError(f"a JSON schema is an object, got {type(schema).__name__}")
        return json.dumps(schema, separators=(",", ":"))
    except json.JSONDecodeError as error:
        raise StructuredOutputsError(f"the JSON schema is not JSON: {error}") from None
    except RecursionError:  # a hostile schema nested about a thousand levels deep
        raise StructuredOutputsError("the JSON schema is nested too deeply") from None


_TOKENIZER_BUILD = threading.Lock()


def grammar_tokenizer(tokenizer_path: str, vocab_size: int, eos_token_id: int | None):
    """llguidance's view of a model's Hugging Face tokenizer: one per process and model, shared by
    the engine's checks and its runner's matchers. Built from ``tokenizer.json`` as the router
    builds its own (~0.25 s for 49k tokens, no transformers); from transformers' tokenizer (1-3 s)
    only for a model without one. The build holds the GIL throughout, stalling every thread of
    the process (a replica's engine and event loop: its streams and reports), so it is built once
    even when threads ask at once, and a replica builds it before it serves."""
    with _TOKENIZER_BUILD:
        return _grammar_tokenizer(tokenizer_path, vocab_size, eos_token_id)


def build_before_serving(build) -> None:
    """Call ``build`` (a grammar tokenizer's) before a process serves. A tokenizer llguidance
    cannot read is logged and left to fail the constrained requests alone."""
    try:
        build()
    except Exception as error:  # noqa: BLE001 - any refusal of the tokenizer: the rest of the model serves
        logger.warning("llguidance cannot read this model's tokenizer (%s): constrained requests will fail", error)


@functools.lru_cache(maxsize=4)
def _grammar_tokenizer(tokenizer_path: str, vocab_size: int, eos_token_id: int | None):
    import llguidance

    tokenizer_json = Path(tokenizer_path) / "tokenizer.json"
    if tokenizer_json.is_file():
        return llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=eos_token_id)
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)


@functools.lru_cache(maxsize=256)
def _tokenizer_problem(grammar: str, tokenizer) -> str:
    """What llguidance finds wrong with a grammar against a tokenizer ("" if nothing): once per
    constraint, not once per sequence of an ``n`` fan-out."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar, tokenizer)


@functools.lru_cache(maxsize=256)
def compiled_grammar(kind: str, text: str) -> str:
    """The checked llguidance grammar of one constraint; raises ``StructuredOutputsError``
    naming what llguidance refused (an unsupported schema keyword, an invalid regex, ...)."""
    import llguidance

    matcher = llguidance.LLMatcher
    try:
        if kind == "json":
            grammar = matcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            grammar = matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(text)
        elif kind == "choice":
            grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(item) for item in json.loads(text)))
        elif _GBNF_RULE.search(text):
            grammar = llguidance.grammar_from("gbnf", text)
        else:
            grammar = matcher.grammar_from_lark(text)
    except ValueError as error:
        raise StructuredOutputsError(f"invalid {kind}: {error}") from None
    problem = matcher.validate_grammar(grammar)
    if problem:
        what = {"json": "JSON schema", "json_object": "JSON object grammar"}.get(kind, kind)
        raise StructuredOutputsError(f"unsupported or invalid {what}: {problem.strip()}")
    return grammar
