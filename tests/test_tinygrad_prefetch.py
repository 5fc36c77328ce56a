"""Software prefetch in tinygrad's CPU kernels (backends/tinygrad/prefetch_loads.py): the loads
that stream a large buffer ask for the line 8 KiB on first, and nothing else changes.

Each run is a subprocess with tinygrad's compile cache off, so that its kernels are rendered
afresh (tinygrad reuses a kernel compiled in the same process, or cached on disk, by its AST
alone). The tiny model's weights are far under the 1 MiB threshold, so the runs lower it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kiln
from hf_oracle import eos_ids, hf_greedy, prompts
from kiln.frontend.checkpoint import load_model

pytest.importorskip("kiln.backends.tinygrad")

RUN = r"""
import json, re, sys, torch, kiln
from kiln.backends.tinygrad import prefetch_loads
from tinygrad.runtime.support import compiler_cpu

prefetch_loads.PREFETCH_MIN_BYTES = prefetch_loads.CODES_MIN_BYTES = 4096
artifact, prompt, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = kiln.load(artifact)
compile_c, sources = compiler_cpu.ClangCompiler.compile, []
def recording(self, src):
    sources.append(src)
    return compile_c(self, src)
compiler_cpu.ClangCompiler.compile = recording
tokens = llm.generate(prompt, max_new_tokens=8).token_ids
llm.executable.reset()
run = llm.executable.run
logits = [run(torch.tensor([prompt]), torch.arange(len(prompt))[None])]
logits.append(run(torch.tensor([tokens]), torch.arange(len(prompt), len(prompt) + 8)[None]))
torch.save(logits, out + ".pt")
prefetched = sum("__builtin_prefetch" in s for s in sources)
codes = [s for s in sources if "unsigned int* restrict" in s]  # kernels over packed int4/int8 codes
def prefetches_codes(src):  # a prefetch through a uint32 parameter: the packed codes themselves
    words = set(re.findall(r"unsigned int\* restrict (data\d+)_", src))
    return bool(words & set(re.findall(r"__builtin_prefetch\(\(const char\*\)\(\(?(data\d+)_", src)))
codes_prefetched = sum(prefetches_codes(s) for s in codes)
summary = {"tokens": tokens, "prefetched": prefetched, "codes": len(codes), "codes_prefetched": codes_prefetched}
json.dump(summary, open(out, "w"))
"""


def run_in_subprocess(artifact: Path, prompt: list[int], out: Path, prefetch: str) -> dict:
    env = {**os.environ, "CCACHE": "0", "KILN_TINYGRAD_PREFETCH": prefetch}
    subprocess.run([sys.executable, "-c", RUN, str(artifact), json.dumps(prompt), str(out)], env=env, check=True)
    return {**json.loads(out.read_text()), "logits": torch.load(f"{out}.pt", weights_only=True)}


@pytest.mark.parametrize("quantize", [None, "int4-g32"])
def test_prefetched_loads_give_the_same_floats_and_greedy_tokens(tiny_model_dirs, tmp_path, quantize):
    """The products of steps over a few tokens prefetch their weights, f32 or packed codes; the
    floats are those without prefetches, bit for bit."""
    source = tiny_model_dirs("llama")
    artifact = kiln.compile(
        str(source), out=tmp_path / "m.kiln", backend="tinygrad", max_seq_len=64, max_batch=1, quantize=quantize
    )
    (prompt,) = prompts([12], seed=5)
    on = run_in_subprocess(artifact, prompt, tmp_path / "on.json", "on")
    off = run_in_subprocess(artifact, prompt, tmp_path / "off.json", "off")
    assert on["prefetched"] > 0 and off["prefetched"] == 0
    assert (on["codes"] > 0) == (on["codes_prefetched"] > 0) == (quantize is not None)
    assert on["tokens"] == off["tokens"]
    if quantize is None:
        assert on["tokens"] == hf_greedy(load_model(source).model, prompt, 8, eos_ids(kiln.load(artifact)))
    for with_prefetch, without in zip(on["logits"], off["logits"]):  # a prompt, then 8 tokens at once
        assert torch.equal(with_prefetch, without)
