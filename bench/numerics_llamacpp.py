"""llama.cpp's side of the numerics gate: `llama-perplexity --kl-divergence` on the text Kiln's is measured on.

    .venv/bin/python bench/llamacpp_baseline.py build      # once: llama-bench, llama-quantize, llama-perplexity
    .venv/bin/python bench/numerics_llamacpp.py [--types q8_0,q4_0,q4_k_m] [--threads 2]

The default model's GGUF (SmolLM2-135M-Instruct Q4_1, as packaged) is requantized by llama-quantize
to F32 (the base: the same dequantized weights Kiln's f32 reference runs) and to each type. The
base run (`--kl-divergence-base`) stores its full logits for the same windows bench/numerics.py
uses: Moby-Dick chapters 41-42, `-c 512`, every whole window, the second half of each scored (the
SmolLM2 GGUF adds no BOS, so the tokens are Kiln's tokenizer's). Each type's run
(`--kl-divergence`) then reports mean/median/p99 KLD, delta-p and the same-top-token rate, parsed
here into bench/results/numerics_llamacpp.json, with the file's tensor bits per weight.
The f32 base's perplexity (printed) is Kiln's f32 one on the same windows: 63.9665 against 63.9677,
so both tools score the same tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llamacpp_baseline import quantized_gguf, tool
from numerics import provenance

RESULTS = Path(__file__).parent / "results" / "numerics_llamacpp.json"
WINDOW = 512
NUMBER = r"(-?[0-9.]+(?:e-?[0-9]+)?)"
FIELDS = {  # llama-perplexity's summary lines -> our names (percentages turned into fractions below)
    "mean_kld": rf"Mean\s+KLD:\s+{NUMBER}\s+±\s+{NUMBER}",
    "max_kld": rf"Maximum KLD:\s+{NUMBER}",
    "p99_kld": rf"99\.0%\s+KLD:\s+{NUMBER}",
    "median_kld": rf"Median\s+KLD:\s+{NUMBER}",
    "delta_p_mean": rf"Mean\s+Δp:\s+{NUMBER}\s+±\s+{NUMBER}\s+%",
    "delta_p_rms": rf"RMS Δp\s*:\s+{NUMBER}\s+±\s+{NUMBER}\s+%",
    "same_top_rate": rf"Same top p:\s+{NUMBER}\s+±\s+{NUMBER}\s+%",
    "perplexity": rf"Mean PPL\(Q\)\s+:\s+{NUMBER}",
    "reference_perplexity": rf"Mean PPL\(base\)\s+:\s+{NUMBER}",
    "perplexity_ratio": rf"Mean PPL\(Q\)/PPL\(base\)\s+:\s+{NUMBER}",
}
PERCENT = {"delta_p_mean", "delta_p_rms", "same_top_rate"}


def parse(output: str) -> dict:
    """The measures of one `llama-perplexity --kl-divergence` run's output."""
    found = {}
    for name, pattern in FIELDS.items():
        match = re.search(pattern, output)
        if match is None:
            raise RuntimeError(f"llama-perplexity printed no {name} ({pattern}); its output ends:\n{output[-3000:]}")
        value = float(match.group(1))
        found[name] = value / 100 if name in PERCENT else value
        if name == "mean_kld":
            found["kld_stderr"] = float(match.group(2))
    return found


def bits_per_weight(gguf: Path) -> float:
    """Bits of the stored tensors per weight (Kiln's measure; no metadata or tokenizer counted)."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(gguf)).tensors
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="q8_0,q4_0,q4_k_m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunks", type=int, help="the first N windows (default: all; bench/numerics.py --windows N)")
    parser.add_argument("--out", default="out/numerics-llamacpp", help="where the GGUFs and the base logits go")
    args = parser.parse_args(argv)

    from kiln.frontend.default_model import default_gguf_path
    from kiln.moby_dick import evaluation_text

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = out / "moby-dick-41-42.txt"
    text.write_text(evaluation_text(), encoding="utf-8")
    perplexity = str(tool("llama-perplexity"))
    # --no-repack: this build's repacked weights crash on prompt batches on this CPU (AMX), as in
    # llamacpp_baseline.py; repacking changes the weights' layout, not their rounding.
    common = ["-t", str(args.threads), "-c", str(WINDOW), "--no-repack"]
    if args.chunks:
        common += ["--chunks", str(args.chunks)]
    base = out / f"f32-{args.chunks or 'all'}.kld"
    f32 = quantized_gguf(default_gguf_path(), "f32", out)
    if not base.is_file():
        output = run([perplexity, "-m", str(f32), "-f", str(text), "--kl-divergence-base", str(base), *common])
        print(re.findall(r"Final estimate: PPL = .*", output)[-1], file=sys.stderr)
    results = []
    for quant in args.types.split(","):
        gguf = quantized_gguf(default_gguf_path(), quant, out)
        output = run([perplexity, "-m", str(gguf), "--kl-divergence-base", str(base), "--kl-divergence", *common])
        chunks = re.search(r"over (\d+) chunks", output)
        entry = {
            **provenance(sys.argv[1:] if argv is None else list(argv)),
            "type": quant,
            "threads": args.threads,
            "window": WINDOW,
            "windows": int(chunks.group(1)) if chunks else None,
            "bytes_per_weight": bits_per_weight(gguf),
            **parse(output),
        }
        results.append(entry)
        print(json.dumps(entry), file=sys.stderr, flush=True)
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    done = {(r["type"], r["windows"]) for r in results}
    RESULTS.parent.mkdir(exist_ok=True)
    kept = [r for r in previous if (r["type"], r["windows"]) not in done]
    RESULTS.write_text(json.dumps(kept + results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
