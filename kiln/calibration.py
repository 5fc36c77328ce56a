"""Calibration tokens for data-aware quantization schemes (`--quantize int4-g64-awq`).

`kiln.compile(..., calibration=...)` takes a text file, token ids, or None for the bundled
Moby-Dick chapters (kiln/moby_dick.py); this turns any of them into the [sequences, length]
token rows the quantize phase runs the model on, and a line saying where they came from (for
the manifest).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.ir.errors import KilnError

SEQUENCES = 4  # windows of LENGTH tokens: 2048 tokens in all, enough for per-channel statistics
LENGTH = 512


class CalibrationSourceError(KilnError, ValueError):
    """The calibration text or tokens cannot be used."""


def calibration_tokens(source, tokenizer_path: Path, max_seq_len: int) -> tuple[torch.Tensor, str]:
    """(token rows [sequences, length], description) from `source`: None (bundled Moby-Dick
    chapters), a path to a UTF-8 text file, or token ids (a list, or a 1-D/2-D tensor)."""
    length = min(LENGTH, max_seq_len)
    if source is None or isinstance(source, (str, Path)):
        text, description = _text(source)
        from kiln.runtime.tokenizer import Tokenizer

        ids = Tokenizer.from_dir(Path(tokenizer_path).parent).encode(text, add_special_tokens=False)
    else:
        ids, description = torch.as_tensor(source, dtype=torch.int64), "token ids given to kiln.compile"
        if ids.dim() == 2:
            return ids[:, :length], description
        ids = ids.tolist()
    if len(ids) < length:
        length = len(ids)
    if length < 16:
        raise CalibrationSourceError(
            f"calibration ({description}) has {len(ids)} tokens; give at least a few "
            "hundred (a paragraph or more of text like the model's inputs)"
        )
    rows = min(SEQUENCES, len(ids) // length)
    return torch.tensor(ids[: rows * length], dtype=torch.int64).view(rows, length), description


def check_source(source) -> None:
    """Fail early (before the model loads) on a calibration file that does not exist."""
    if isinstance(source, (str, Path)) and not Path(source).is_file():
        raise CalibrationSourceError(
            f"calibration file {source} does not exist. Fix: give a UTF-8 text file "
            "(or leave it out for the bundled Moby-Dick chapters)."
        )


def _text(source) -> tuple[str, str]:
    if source is None:
        from kiln.moby_dick import CALIBRATION_SOURCE, calibration_text

        return calibration_text(), CALIBRATION_SOURCE
    check_source(source)
    path = Path(source)
    return path.read_text(encoding="utf-8", errors="replace"), f"text file {path.name}"
