"""The llama.cpp baseline: `llama-bench` on the default model's GGUF, requantized to f32, q8_0 and
q4_0 by `llama-quantize`, timed turn by turn beside Kiln in bench.py (`--llamacpp f32,q8_0,q4_0`);
`llama-perplexity` gives bench/numerics_llamacpp.py its KL divergences.

llama.cpp is not a Python dependency: its three tools are built once from the llama.cpp sources
vendored in the `llama-cpp-python` sdist on PyPI (no model hub, no git):

    python bench/llamacpp_baseline.py build        # -> ~/.cache/kiln/llama.cpp/bin (10-15 min, 2 cores)

`KILN_LLAMA_CPP` names another directory holding those tools. The build is
native (`GGML_NATIVE`): llama.cpp uses every instruction set this CPU has (AVX2, AVX-512, VNNI),
as its users' builds do. Each timed repetition is one `llama-bench -r 1` call (model load and
warm-up outside the time it reports); the row's tokens/s is llama-bench's own. Prompts run with
`--repack 0`: this build's repacked weights, its fastest decode path (q4_0 tg128 1.5x faster than
without), crash on prompt batches on this machine's CPU (a Xeon with AMX); decode keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp 0c1e570 (2026-10-01)
TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity")
QUANT_TYPES = {"f32": "F32", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M"}


def tools_dir() -> Path:
    if os.environ.get("KILN_LLAMA_CPP"):
        return Path(os.environ["KILN_LLAMA_CPP"])
    from kiln.frontend.default_model import cache_root

    return cache_root() / "llama.cpp" / "bin"


def tool(name: str) -> Path:
    path = tools_dir() / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: build llama.cpp's tools with `python bench/llamacpp_baseline.py "
            "build`, or point KILN_LLAMA_CPP at a directory holding " + ", ".join(TOOLS)
        )
    return path


def build(jobs: int = 2) -> Path:
    """Download the sdist (PyPI), build TOOLS, copy them to tools_dir()."""
    out = tools_dir()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp], check=True
        )
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = source / "build"
        subprocess.run(
            [
                "cmake",
                "-S",
                str(source),
                "-B",
                str(build_dir),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
                "-DBUILD_SHARED_LIBS=OFF",
            ],
            check=True,
        )
        subprocess.run(["cmake", "--build", str(build_dir), "--target", *TOOLS, f"-j{jobs}"], check=True)
        out.mkdir(parents=True, exist_ok=True)
        for name in TOOLS:
            shutil.copy2(build_dir / "bin" / name, out / name)
    return out


def quantized_gguf(source: Path, quant: str, out_dir: Path) -> Path:
    """`source` requantized to `quant` (f32, q8_0, q4_0, q4_1, q4_k_m) by llama-quantize, made once."""
    if quant not in QUANT_TYPES:
        raise ValueError(f"llama.cpp baseline type {quant!r}: choose from {', '.join(QUANT_TYPES)}")
    target = out_dir / f"{source.stem}-{quant}.gguf"
    if not target.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        done = subprocess.run(
            [str(tool("llama-quantize")), "--allow-requantize", str(source), str(partial), QUANT_TYPES[quant]],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"llama-quantize failed for {quant}:\n{done.stderr[-2000:]}")
        partial.rename(target)
    return target


class LlamaCppRunner:
    """prefill(n) / generate(n) like bench.py's runners; each call returns the seconds llama-bench
    itself measured (bench.measure uses them instead of the call's wall time)."""

    def __init__(self, gguf: Path, threads: int, quant: str):
        self.gguf, self.threads = gguf, threads
        self.name = f"llama.cpp-{quant}"
        self.weight_bytes = gguf.stat().st_size

    def _rate(self, prompt: int, generated: int) -> float:
        command = [
            str(tool("llama-bench")),
            "-m",
            str(self.gguf),
            "-t",
            str(self.threads),
            "-r",
            "1",
            "-p",
            str(prompt),
            "-n",
            str(generated),
            "-o",
            "json",
        ]
        if prompt:  # its repacked weights (the fast decode path) crash on prompts on this CPU (AMX)
            command += ["--repack", "0"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"llama-bench failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
        return float(json.loads(done.stdout)[0]["avg_ts"])

    def prefill(self, n: int):
        return lambda: n / self._rate(n, 0)

    def generate(self, n: int):
        """Seconds for the n - 1 decode steps bench.measure counts (a 1-token generate costs 0)."""
        if n <= 1:
            return lambda: 0.0
        return lambda: (n - 1) / self._rate(0, n)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "where"])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    print(build(args.jobs) if args.command == "build" else tools_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
