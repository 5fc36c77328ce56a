"""Documents for the local lm-eval tasks (`custom_dataset` in the YAML files): nothing comes from a
hub. Moby-Dick's held-out chapters are Kiln's evaluation text (kiln/moby_dick.py, sha256-checked,
cached after the first fetch); the multiple-choice set is kiln_basic_mc.jsonl beside this file."""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset, DatasetDict

HERE = Path(__file__).parent


def moby_dick(**metadata) -> DatasetDict:
    """One document per held-out chapter (41 and 42), scored as rolling perplexity."""
    from kiln.moby_dick import EVALUATION_CHAPTERS, chapter_text

    return DatasetDict(
        {"test": Dataset.from_list([{"chapter": n, "page": chapter_text(n).strip()} for n in EVALUATION_CHAPTERS])}
    )


def basic_mc(**metadata) -> DatasetDict:
    """32 four-way general-knowledge questions: {"question", "choices", "answer" (index)}."""
    lines = (HERE / "kiln_basic_mc.jsonl").read_text(encoding="utf-8").splitlines()
    return DatasetDict({"test": Dataset.from_list([json.loads(line) for line in lines if line.strip()])})
