"""The tinygrad backend's own artifact file, and rebuilding an executable from an artifact.

tinygrad has no serialized program format that loads without tracing: a captured TinyJit
pickles, but unpickling runs arbitrary code, which an artifact must never need. What the
jitted steps are built from is already in the artifact (graph.kir and weights.safetensors);
`tinygrad.json` adds the settings that shaped them (tinygrad version, renderer, prefill chunk,
weight layouts) so that `load` rebuilds the same steps, and checks the tinygrad version.
Kernels recompile on the first calls after a load, from tinygrad's own compile cache on disk
when the same machine built them before.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

from kiln.backends.executable import BackendOptions
from kiln.ir import Graph
from kiln.ir.errors import ArtifactError

from .executable import TinygradExecutable
from .toolchain import chosen_renderer

INFO_FILE = "tinygrad.json"
INFO_FORMAT = 1


TinygradArtifactError = ArtifactError  # tinygrad.json is missing, damaged, or written by another tinygrad


def tinygrad_version() -> str:
    return version("tinygrad")


def write_backend_info(directory, executable: TinygradExecutable) -> list[str]:
    """Write tinygrad.json for `executable` into `directory`; returns [its name]."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    info = {
        "format": INFO_FORMAT,
        "tinygrad": tinygrad_version(),
        "renderer": chosen_renderer(),
        "prefill_chunk": executable.prefill_chunk,
        "stored_weights": {
            n: {"transposed": s.transposed, "rows": s.rows, "lanes": s.lanes, "packed": s.packed}
            for n, s in executable.layouts.stored.items()
        },
    }
    (directory / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return [INFO_FILE]


def read_backend_info(directory: Path) -> dict:
    path = Path(directory) / INFO_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TinygradArtifactError(
            f"cannot read {path} ({e}); recompile the artifact with --backend tinygrad"
        ) from None
    if info.get("format") != INFO_FORMAT:
        raise TinygradArtifactError(
            f"{path} has format {info.get('format')!r}, this Kiln reads {INFO_FORMAT}; recompile the artifact"
        )
    if info.get("tinygrad") != tinygrad_version():
        raise TinygradArtifactError(
            f"{path} was written with tinygrad {info.get('tinygrad')}, this is tinygrad "
            f"{tinygrad_version()}; recompile the artifact or install that version"
        )
    return info


def load(directory: Path, graph: Graph, weights, options: BackendOptions) -> TinygradExecutable:
    """Rebuild the executable from an artifact's graph, weights and tinygrad.json (no frontend)."""
    info = read_backend_info(directory)
    graph.weights = dict(weights)
    return TinygradExecutable(graph, options, weights, prefill_chunk=info["prefill_chunk"])
