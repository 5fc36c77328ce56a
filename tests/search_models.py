"""The tiny models the beam search, contrastive search and token-ban tests share: compiled for
the reference backend with 4 KV rows, once per test process, next to the Hugging Face model."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import kiln
from kiln.frontend.checkpoint import load_model

MAX_SEQ_LEN, MAX_BATCH = 32, 4


@functools.cache
def searchable(source: Path):
    """(the kiln LLM, the Hugging Face model) of the tiny checkpoint at `source`."""
    root = Path(tempfile.mkdtemp(prefix="kiln_search_"))
    atexit.register(shutil.rmtree, root, True)
    path = kiln.compile(
        str(source), out=root / "model.kiln", backend="reference", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH
    )
    return kiln.load(path), load_model(source).model
