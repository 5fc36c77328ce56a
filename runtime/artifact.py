"""The artifact directory: everything a runtime needs to generate, with no re-tracing.

    model.kiln/
      manifest.json          format, versions, source hash, options, IR hash, {file: sha256, bytes},
                             and fields_sha256 over all of those
      graph.kir              the stateful graph's text form (kiln.ir.print_graph)
      weights.safetensors    graph.weights (safetensors only: loading never unpickles)
      weights.rank1.safetensors, ...   a tensor-parallel artifact's other ranks' shards (manifest
                             `tensor_parallel`: N): graph.kir is the same for every rank,
                             weights.safetensors is rank 0's
      tokenizer.json, tokenizer_config.json, generation_config.json, chat_template.jinja (as present)
      ...                    the backend's own files (Executable.save)

`read_artifact` checks the manifest (its fields against its fields_sha256: options such as
max_seq_len or threads are fixed at compile time, so an edited manifest is refused), every listed
file's size and sha256, that graph.kir parses and verifies, and that the weights match the
graph's parameters; any failure is an `ArtifactError` naming the file and what is wrong with it.

The sha256 of manifest.json itself stands for the whole artifact, since the manifest holds
every other file's sha256: `read_artifact(path, expected_sha256=...)` (`kiln.load`, `kiln
generate/serve --expect-sha256`) pins an artifact to the one compiled. Pin artifacts you did not
compile yourself: an artifact is code (an Inductor artifact's package holds a shared library
that loading runs), and hashes the artifact carries prove nothing against whoever made it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kiln.ir import Graph, ParseError, VerificationError, parse_graph, print_graph, to_torch, verify
from kiln.ir.registry import OpError, get_op
from kiln.runtime.errors import ArtifactError
from kiln.runtime.tokenizer import TOKENIZER_FILES

FORMAT = "kiln-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAPH_FILE = "graph.kir"
WEIGHTS_FILE = "weights.safetensors"
REQUIRED_KEYS = ("format_version", "backend", "options", "files")
FIELDS_HASH = "fields_sha256"


@dataclass
class ArtifactContents:
    """A checked artifact: its manifest and its graph with the weights attached."""

    directory: Path
    manifest: dict
    graph: Graph
    weights_check: Future | None = None  # the weights' sha256 check still running (defer_weights_hash)

    def finish_checks(self) -> None:
        """Wait for a deferred weights check; ArtifactError if the weights are damaged."""
        check, self.weights_check = self.weights_check, None
        if check is not None:
            check.result()

    @property
    def backend(self) -> str:
        return self.manifest["backend"]

    @property
    def options(self) -> dict:
        return self.manifest["options"]

    @property
    def paths(self) -> dict[str, Path]:
        """Every listed file by its name in the manifest."""
        return {name: self.directory / name for name in self.manifest["files"]}

    @property
    def tokenizer_dir(self) -> Path | None:
        """The directory holding tokenizer.json, or None for an artifact without a tokenizer."""
        return self.directory if "tokenizer.json" in self.manifest["files"] else None


def kiln_version() -> str:
    """The installed Kiln's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kiln")
    except PackageNotFoundError:
        return "0+unknown"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- writing ---------------------------------------------------------------------------------
def save_artifact(
    directory,
    graph: Graph,
    executable,
    tokenizer_dir=None,
    manifest_fields: dict | None = None,
    extra_files: dict[str, str] | None = None,
    rank_weights: list | None = None,
) -> Path:
    """Write the artifact for `graph` (stateful, weights attached) and `executable` to `directory`.

    `manifest_fields` adds backend, backend_version, source_hash, options, ... to the manifest.
    `extra_files` ({name: text}, e.g. the graph-break report) are written and listed like the rest.
    `rank_weights`: for a tensor-parallel graph, the weights of ranks 1, 2, ... (graph.weights are
    rank 0's); the manifest records `tensor_parallel`.
    The artifact is assembled in a temporary sibling directory and moved into place, so a crash
    never leaves half an artifact; an existing artifact at `directory` is replaced, anything
    else there is refused.
    """
    directory = Path(directory)
    check_replaceable(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        graph_text = print_graph(graph)
        (staging / GRAPH_FILE).write_text(graph_text, encoding="utf-8")
        save_file(_weights_for_saving(graph), str(staging / WEIGHTS_FILE))
        names = [GRAPH_FILE, WEIGHTS_FILE, *_copy_tokenizer(tokenizer_dir, staging)]
        for rank, weights in enumerate(rank_weights or [], start=1):
            save_file(_weights_for_saving(graph, weights), str(staging / weights_file(rank)))
            names.append(weights_file(rank))
        names += _expand_dirs(staging, executable.save(staging) or [])
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
            names.append(name)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kiln_version": kiln_version(),
            **(manifest_fields or {}),
            **({"tensor_parallel": 1 + len(rank_weights)} if rank_weights else {}),
            "ir_hash": hashlib.sha256(graph_text.encode("utf-8")).hexdigest(),
            "files": {n: {"sha256": file_sha256(staging / n), "bytes": (staging / n).stat().st_size} for n in names},
        }
        write_manifest(staging, sealed(manifest))
        move_into_place(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def check_replaceable(directory: Path) -> None:
    """Refuse a `directory` that exists and holds something other than an artifact (or nothing)."""
    if directory.exists() and not (
        directory.is_dir() and (not any(directory.iterdir()) or (directory / MANIFEST).is_file())
    ):
        raise ArtifactError(
            f"{directory} exists and is not a Kiln artifact; refusing to overwrite it. "
            "Fix: choose another output path, or delete it first."
        )


def weights_file(rank: int) -> str:
    """The weights of `rank` in a (tensor-parallel) artifact."""
    return WEIGHTS_FILE if rank == 0 else f"weights.rank{rank}.safetensors"


def _weights_for_saving(graph: Graph, weights: dict | None = None) -> dict[str, torch.Tensor]:
    weights = graph.weights if weights is None else weights
    missing = [name for name in graph.params if name not in weights]
    if missing:
        raise ArtifactError(f"Cannot save: parameters {missing[:5]} have no weights attached to the graph.")
    out, seen = {}, set()
    for name in graph.params:
        t = weights[name].detach().cpu().contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen else t  # safetensors refuses shared storage (tied weights)
        seen.add(key)
    return out


def _copy_tokenizer(tokenizer_dir, staging: Path) -> list[str]:
    if tokenizer_dir is None:
        return []
    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ArtifactError(f"No tokenizer.json in {tokenizer_dir}. Fix: point at the model directory that has it.")
    names = [n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    for name in names:
        shutil.copyfile(tokenizer_dir / name, staging / name)
    return names


def _expand_dirs(root: Path, names: list[str]) -> list[str]:
    """Backend outputs as file names relative to root (a directory stands for its files)."""
    out = []
    for name in names:
        path = root / name
        out += (
            sorted(p.relative_to(root).as_posix() for p in path.rglob("*") if p.is_file()) if path.is_dir() else [name]
        )
    return out


def write_manifest(directory: Path, manifest: dict) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def move_into_place(staging: Path, directory: Path) -> None:
    """Rename the finished `staging` directory to `directory`, replacing an artifact there."""
    old = None
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        directory.rename(old)
    staging.rename(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fields_sha256(manifest: dict) -> str:
    """The sha256 of a manifest's fields but fields_sha256 (as canonical JSON: sorted keys, compact)."""
    fields = {key: value for key, value in manifest.items() if key != FIELDS_HASH}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def sealed(manifest: dict) -> dict:
    """The manifest with its fields_sha256 (what save_artifact writes)."""
    return {**manifest, FIELDS_HASH: fields_sha256(manifest)}


def manifest_sha256(directory) -> str:
    """The sha256 of an artifact's manifest.json: what `expected_sha256` pins (the manifest holds
    every other file's sha256, so this one hash stands for the whole artifact)."""
    return hashlib.sha256((Path(directory) / MANIFEST).read_bytes()).hexdigest()


# -- reading ---------------------------------------------------------------------------------
def read_artifact(
    directory,
    check_hashes: bool = True,
    rank: int = 0,
    expected_sha256: str | None = None,
    defer_weights_hash: bool = False,
) -> ArtifactContents:
    """Open and check an artifact (with `rank`'s weights, for a tensor-parallel one); raise
    ArtifactError saying which file is wrong and how. Other ranks' shards are size-checked only.
    `expected_sha256`: the sha256 manifest.json must have (see `manifest_sha256`); it pins the
    whole artifact, so it needs check_hashes.

    `defer_weights_hash`: the weights file (data, the largest: ~0.5 s of hashing for SmolLM2) is
    size-checked here and hashed on a thread while the caller readies the backend (hashlib and
    file reads release the GIL); the caller must call `finish_checks()` before using the
    weights' values. Every other file (code among them) is hashed before this returns."""
    directory = Path(directory)
    if expected_sha256 is not None and not check_hashes:
        raise ArtifactError(
            "expected_sha256 pins an artifact only when every file is checked against the manifest. "
            "Fix: leave check_hashes on (the default) when giving expected_sha256."
        )
    manifest = read_manifest(directory, expected_sha256)
    ranks = manifest.get("tensor_parallel", 1)
    if not 0 <= rank < ranks:
        raise ArtifactError(
            f"{directory} has weights for {ranks} rank(s), not for rank {rank}. "
            f"Fix: run it with torchrun --nproc-per-node {ranks}."
        )
    others = {weights_file(r) for r in range(ranks) if r != rank}
    deferred = weights_file(rank) if defer_weights_hash and check_hashes else None
    for name, entry in manifest["files"].items():
        _check_file(directory, name, entry, check_hashes and name not in others and name != deferred)
    weights_check = None
    if deferred in manifest["files"]:
        entry = manifest["files"][deferred]
        weights_check = _in_background(_check_file, directory, deferred, entry, True)
    graph = _read_graph(directory, manifest)
    graph.weights = _read_weights(directory, graph, weights_file(rank))
    return ArtifactContents(directory, manifest, graph, weights_check)


def _in_background(function, *args) -> Future:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-artifact-check")
    try:
        return pool.submit(function, *args)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


def read_manifest(directory: Path, expected_sha256: str | None = None) -> dict:
    """The manifest, checked for format, version, required keys and its fields_sha256 (and, given
    `expected_sha256`, that manifest.json's own sha256 is that)."""
    if not directory.is_dir():
        raise ArtifactError(
            f"Artifact directory {directory} does not exist. Fix: check the path, or create it "
            "with `compile-model MODEL -o " + str(directory) + "`."
        )
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(
            f"{directory} is not a Kiln artifact: {MANIFEST} is missing. Fix: point at a directory "
            "written by `compile-model`, or recompile."
        )
    data = path.read_bytes()  # read once: what is hashed is what is parsed
    if expected_sha256 is not None:
        _check_pin(path, data, expected_sha256)
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}). The artifact is damaged: recompile it.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArtifactError(
            f"{path} describes a foreign format ({found!r}, expected {FORMAT!r}). "
            "Fix: point at a directory written by `compile-model`."
        )
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise ArtifactError(
            f"{path}: format_version is {version!r}, not an integer. The artifact is damaged: recompile it."
        )
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: artifact format version {version} is newer than this Kiln supports "
            f"({FORMAT_VERSION}; Kiln {kiln_version()}). Fix: upgrade Kiln, or recompile the model "
            "with this version."
        )
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing or not isinstance(manifest["files"], dict):
        raise ArtifactError(f"{path} lacks {missing or ['a files table']}. The artifact is damaged: recompile it.")
    for name in (GRAPH_FILE, WEIGHTS_FILE):
        if name not in manifest["files"]:
            raise ArtifactError(f"{path} does not list {name}. The artifact is damaged: recompile it.")
    # Artifacts written before fields_sha256 have none; their fields are taken as they are.
    if FIELDS_HASH in manifest and manifest[FIELDS_HASH] != fields_sha256(manifest):
        raise ArtifactError(
            f"{path} was edited after compiling: its fields no longer match its {FIELDS_HASH} "
            "(options such as max_seq_len and threads are fixed when the artifact is compiled). "
            "Fix: restore the original manifest.json, or recompile with the options you want."
        )
    return manifest


def check_files(directory: Path) -> dict:
    """The manifest of the artifact at `directory`, after checking every file it lists (size and
    sha256) but nothing else: what the compile cache does before it reuses an artifact."""
    manifest = read_manifest(directory)
    for name, entry in manifest["files"].items():
        _check_file(directory, name, entry, check_hash=True)
    return manifest


def _check_pin(path: Path, data: bytes, expected: str) -> None:
    if not isinstance(expected, str) or len(expected.strip()) != 64:
        raise ArtifactError(
            f"expected_sha256 {expected!r:.80} is not a sha256 (64 hex digits). Fix: pass the "
            f"sha256 of the artifact's {MANIFEST} (`sha256sum {path}`)."
        )
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected.strip().lower():
        raise ArtifactError(
            f"{path} has sha256 {actual}, not the expected {expected.strip().lower()}: this is not "
            "the artifact that was pinned (changed, or another one). Fix: load the artifact you "
            "pinned, or pin this one only if you trust where it came from."
        )


def _check_file(directory: Path, name: str, entry: dict, check_hash: bool) -> None:
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts:
        raise ArtifactError(
            f"{directory / MANIFEST} lists {name!r}, which points outside the artifact. "
            "Refusing to read it: the artifact is damaged or hostile."
        )
    path = directory / name
    if not isinstance(entry, dict):
        raise ArtifactError(
            f"{directory / MANIFEST}: the entry for {name} is {entry!r}, not {{sha256, bytes}}. "
            "The artifact is damaged: recompile it."
        )
    if not path.is_file():
        raise ArtifactError(
            f"{path} is missing (listed in {MANIFEST}). The artifact is incomplete: "
            "copy it again in whole, or recompile."
        )
    size = path.stat().st_size
    if size != entry.get("bytes"):
        raise ArtifactError(
            f"{path} has {size} bytes but the manifest says {entry.get('bytes')}: the file is "
            "truncated or replaced. Fix: copy the artifact again, or recompile."
        )
    if check_hash and file_sha256(path) != entry.get("sha256"):
        raise ArtifactError(
            f"{path} does not match its sha256 in {MANIFEST}: the file is damaged. "
            "Fix: copy the artifact again, or recompile."
        )


def _read_graph(directory: Path, manifest: dict) -> Graph:
    path = directory / GRAPH_FILE
    text = path.read_text(encoding="utf-8", errors="replace")
    if "ir_hash" in manifest and hashlib.sha256(text.encode("utf-8")).hexdigest() != manifest["ir_hash"]:
        raise ArtifactError(
            f"{path} does not match the manifest's ir_hash: the graph was changed after compiling. Fix: recompile."
        )
    try:
        graph = parse_graph(text)
    except ParseError as e:
        raise ArtifactError(f"{path} does not parse: {e}. Fix: recompile (or use a Kiln that reads this IR).") from None
    try:
        _complete_attributes(graph)
        verify(graph)
    except (VerificationError, OpError) as e:
        raise ArtifactError(f"{path} parses but does not verify: {e}. Fix: recompile.") from None
    return graph


def _complete_attributes(graph: Graph) -> None:
    """Give each node the attributes and trailing optional inputs its op gained after the artifact
    was compiled, at their defaults (which keep the op's earlier meaning: an older artifact's
    attention has no ALiBi slopes and no token tree), so artifacts of an older Kiln keep loading.
    An unknown attribute stays an error."""
    for node in graph.nodes:
        opdef = get_op(node.op)
        node.attrs = opdef.complete_attrs(node.attrs)
        if not opdef.variadic and len(node.inputs) < len(opdef.inputs):
            node.inputs = list(node.inputs) + [None] * (len(opdef.inputs) - len(node.inputs))


def _read_weights(directory: Path, graph: Graph, name: str = WEIGHTS_FILE) -> dict[str, torch.Tensor]:
    path = directory / name
    try:
        weights = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{path} is not a readable safetensors file ({e}). Fix: recompile.") from None
    missing = sorted(set(graph.params) - set(weights))
    extra = sorted(set(weights) - set(graph.params))
    if missing or extra:
        raise ArtifactError(
            f"{path} does not match {GRAPH_FILE}'s parameters (missing {missing[:5]}, "
            f"unexpected {extra[:5]}). Fix: recompile."
        )
    for name, value in graph.params.items():
        t = weights[name]
        if tuple(t.shape) != value.type.shape or t.dtype != to_torch(value.type.dtype):
            raise ArtifactError(
                f"{path}: weight {name} is {t.dtype} {list(t.shape)} but {GRAPH_FILE} "
                f"declares {value.type}. Fix: recompile."
            )
    return weights
