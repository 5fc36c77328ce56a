"""The compile cache: compiling the same checkpoint with the same options again copies the
artifact compiled before instead of capturing, lowering and packaging it again.

An entry is keyed by everything that decides what a compile writes: the checkpoint's content
(config.json, the safetensors weights, the tokenizer files), the options (and calibration
data's content), Kiln's version and a digest of its own source files, the versions of torch,
transformers and the backend, this host's CPU (architecture and instruction-set flags) and
thread count, and the environment variables that steer lowering (KILN_*, TORCHINDUCTOR_*, CC,
CXX, DEV). Before an entry is reused every file is checked against its manifest (size and
sha256); a damaged entry is deleted and the model compiled again, never loaded.

It lives in `$KILN_COMPILE_CACHE`, else `compiled/` under the Kiln cache (`$KILN_CACHE`, else
`$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`); `KILN_COMPILE_CACHE=off` turns it off. The least
recently used entries are deleted beyond `$KILN_COMPILE_CACHE_MAX_GB` (default 8) gigabytes.
Files are hard-linked between the cache and artifacts where the file system allows (copied
otherwise); manifest.json is always copied, since Kiln rewrites an artifact's manifest in place.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

CACHE_FORMAT = 1
CACHE_ENV = "KILN_COMPILE_CACHE"
MAX_GB_ENV = "KILN_COMPILE_CACHE_MAX_GB"
DEFAULT_MAX_GB = 8.0
OFF = ("off", "0", "false", "no")
ENTRY_ARTIFACT = "artifact"
ENTRY_KEY = "key.json"
HASH_MEMO = "file_hashes.json"
# The variables that locate caches or pick how the graph-break check runs change no artifact.
ENV_IGNORED = {"KILN_CACHE", CACHE_ENV, MAX_GB_ENV, "KILN_BREAK_CHECK", "TORCHINDUCTOR_CACHE_DIR"}
ENV_PREFIXES = ("KILN_", "TORCHINDUCTOR_")
ENV_NAMES = ("CC", "CXX", "DEV")
SOURCE_PACKAGES = ("kiln", "kiln.frontend", "kiln.ir", "kiln.passes", "kiln.backends", "kiln.runtime")
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".txt")


def cache_dir() -> Path | None:
    """Where compiled artifacts are cached, or None when `KILN_COMPILE_CACHE=off`."""
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() in OFF:
        return None
    if value:
        return Path(value).expanduser()
    from kiln.frontend.default_model import cache_root

    return cache_root() / "compiled"


def max_bytes() -> int:
    value = os.environ.get(MAX_GB_ENV, "").strip()
    try:
        gigabytes = float(value) if value else DEFAULT_MAX_GB
    except ValueError:
        from kiln.ir.errors import OptionError

        raise OptionError(f"{MAX_GB_ENV}={value!r} is not a number of gigabytes. Fix: e.g. {MAX_GB_ENV}=8.") from None
    return int(max(gigabytes, 0.0) * 1e9)


@dataclass(frozen=True)
class CacheKey:
    digest: str
    inputs: dict


def compile_key(checkpoint_dir: Path, options, backend_version: str, memo_dir: Path | None) -> CacheKey | None:
    """The key of compiling `checkpoint_dir` with `options` (CompileOptions); None when the
    options hold something the key cannot stand for (calibration given as another object)."""
    import torch

    calibration = _calibration_digest(options) if options.needs_calibration else None
    if calibration is False:
        return None
    memo = _HashMemo(memo_dir)
    inputs = {
        "format": CACHE_FORMAT,
        "checkpoint": checkpoint_digest(checkpoint_dir, memo),
        "options": {
            **asdict(options.backend_options()),
            "backend": options.backend,
            "tensor_parallel": options.tensor_parallel,
            "calibration": calibration,
        },
        "versions": {
            "kiln": _version("kiln"),
            "kiln_source": source_digest(memo),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "backend": backend_version,
        },
        "host": {"machine": platform.machine(), "cpu_flags": _cpu_flags_digest(), "threads": torch.get_num_threads()},
        "env": {
            name: value
            for name, value in sorted(os.environ.items())
            if (name.startswith(ENV_PREFIXES) or name in ENV_NAMES) and name not in ENV_IGNORED
        },
    }
    memo.save()
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return CacheKey(hashlib.sha256(text.encode("utf-8")).hexdigest(), inputs)


def checkpoint_digest(checkpoint_dir: Path, memo=None) -> str:
    """sha256 over what a compile reads of a checkpoint: config.json, the safetensors weights and
    the tokenizer files, each prefixed by its name."""
    from kiln.runtime.tokenizer import TOKENIZER_FILES

    memo = memo or _HashMemo(None)
    names = ["config.json", *sorted(p.name for p in checkpoint_dir.glob("*.safetensors")), *TOKENIZER_FILES]
    digest = hashlib.sha256()
    for name in names:
        path = checkpoint_dir / name
        if path.is_file():
            digest.update(f"{name}\0{memo.sha256(path)}\0".encode())
    return digest.hexdigest()


def source_digest(memo=None) -> str:
    """sha256 over Kiln's own source files: an edited checkout compiles differently under the
    same version number."""
    memo = memo or _HashMemo(None)
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(package)
        for root in spec.submodule_search_locations or []:
            for path in sorted(Path(root).rglob("*")):
                if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts and path.is_file():
                    digest.update(f"{package}/{path.relative_to(root).as_posix()}\0{memo.sha256(path)}\0".encode())
    return digest.hexdigest()


def _calibration_digest(options):
    """The content of the calibration data; "bundled" for the default; False when unknown."""
    source = options.calibration
    if source is None:
        return "bundled"
    if isinstance(source, (str, Path)):
        from kiln.runtime.artifact import file_sha256

        return file_sha256(Path(source).expanduser())
    try:
        import torch

        return hashlib.sha256(torch.as_tensor(source).cpu().contiguous().numpy().tobytes()).hexdigest()
    except (TypeError, ValueError, RuntimeError):
        return False


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _cpu_flags_digest() -> str:
    """The CPU's instruction-set flags: Inductor generates code for the vector ISA it finds."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as stream:
            flags = next((line for line in stream if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:16]


class _HashMemo:
    """File sha256s remembered by (path, size, mtime, inode), so an unchanged 500 MB checkpoint is
    not read again on every compile (as the GGUF conversion cache does)."""

    def __init__(self, directory: Path | None):
        self.path = directory / HASH_MEMO if directory is not None else None
        self.entries = self._read()
        self.changed = False

    def sha256(self, path: Path) -> str:
        stat = path.stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        name = str(path.resolve())
        known = self.entries.get(name)
        if isinstance(known, list) and len(known) == 2 and known[0] == stamp:
            return known[1]
        from kiln.runtime.artifact import file_sha256  # torch only when a file must be hashed

        value = file_sha256(path)
        self.entries[name] = [stamp, value]
        self.changed = True
        return value

    def save(self) -> None:
        if self.path is None or not self.changed:
            return
        live = {name: entry for name, entry in self.entries.items() if os.path.exists(name)}
        _write_json_atomically(self.path, live)

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}


class CompileCache:
    """The entries under `root`: root/<key digest>/{artifact/, key.json}."""

    def __init__(self, root: Path):
        self.root = root

    def entry(self, key: CacheKey) -> Path:
        return self.root / key.digest

    def lookup(self, key: CacheKey) -> tuple[Path | None, str | None]:
        """(the entry's artifact, checked file by file, or None; why an entry was dropped, or None)."""
        from kiln.runtime.artifact import check_files
        from kiln.runtime.errors import ArtifactError

        entry = self.entry(key)
        if not entry.is_dir():
            return None, None
        artifact = entry / ENTRY_ARTIFACT
        try:
            check_files(artifact)
        except (ArtifactError, OSError) as error:
            shutil.rmtree(entry, ignore_errors=True)
            return None, str(error)
        os.utime(entry)  # its last use, for eviction
        return artifact, None

    def copy_out(self, artifact: Path, out: Path, source: str) -> Path:
        """The cached `artifact` as a new artifact at `out` (replacing one there); its manifest
        names `source` as the checkpoint it was compiled from."""
        from kiln.runtime.artifact import MANIFEST, move_into_place, sealed, write_manifest

        manifest = json.loads((artifact / MANIFEST).read_text(encoding="utf-8"))
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            _link_files(artifact, staging, manifest["files"])
            if manifest.get("source") != source:
                manifest = sealed({**manifest, "source": source})
                write_manifest(staging, manifest)
            else:
                shutil.copyfile(artifact / MANIFEST, staging / MANIFEST)
            staging.chmod(0o755)
            move_into_place(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return out

    def store(self, key: CacheKey, artifact: Path) -> None:
        """Add the artifact just compiled under `key`, then evict beyond the size bound. A cache
        that cannot be written is skipped: the compile itself succeeded."""
        from kiln.runtime.artifact import MANIFEST

        entry = self.entry(key)
        staging = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{key.digest[:12]}.", dir=self.root))
            manifest = json.loads((artifact / MANIFEST).read_text(encoding="utf-8"))
            (staging / ENTRY_ARTIFACT).mkdir()
            _link_files(artifact, staging / ENTRY_ARTIFACT, manifest["files"])
            shutil.copyfile(artifact / MANIFEST, staging / ENTRY_ARTIFACT / MANIFEST)
            (staging / ENTRY_KEY).write_text(json.dumps(key.inputs, indent=1, sort_keys=True) + "\n")
            staging.chmod(0o755)
            if entry.exists():
                shutil.rmtree(entry)
            staging.rename(entry)
        except OSError:
            return
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        self.evict(max_bytes())

    def entries(self) -> list[tuple[Path, int, float]]:
        """(entry, bytes, last use) of every entry, least recently used first."""
        found = []
        for entry in self.root.iterdir() if self.root.is_dir() else []:
            if entry.is_dir() and not entry.name.startswith("."):
                size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
                found.append((entry, size, entry.stat().st_mtime))
        return sorted(found, key=lambda item: item[2])

    def evict(self, limit: int) -> None:
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for entry, size, _ in entries:
            if total <= limit:
                break
            shutil.rmtree(entry, ignore_errors=True)
            total -= size

    def clear(self) -> tuple[int, int]:
        """Delete every entry (and unfinished ones); (entries, bytes) deleted."""
        entries = self.entries()
        for entry, _, _ in entries:
            shutil.rmtree(entry, ignore_errors=True)
        for leftover in self.root.glob(".*") if self.root.is_dir() else []:
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
        return len(entries), sum(size for _, size, _ in entries)


def _link_files(source: Path, target: Path, names) -> None:
    """Hard-link (or copy, across file systems) each listed file of `source` into `target`."""
    for name in names:
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source / name, destination)
        except OSError:
            shutil.copy2(source / name, destination)


def _write_json_atomically(path: Path, data) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(handle, "w") as stream:
            json.dump(data, stream, sort_keys=True)
        os.replace(temporary, path)
    except OSError:
        pass
