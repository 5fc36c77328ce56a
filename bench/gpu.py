"""Kiln-Inductor on CUDA: greedy equality with Hugging Face, and decode speed against the GPU's
copy bandwidth and Hugging Face's static cache + torch.compile, in one run.

    python bench/gpu.py prepare DIR            # here (CPU): artifacts for device="cuda"
    python bench/gpu.py check DIR              # there: everything below, a table at the end
    python bench/gpu.py prepare-real DIR       # here: the real SmolLM2 for CUDA, weights stripped
    python bench/gpu.py real DIR --gguf FILE   # there: the real SmolLM2, f16 and bf16, against HF
    python bench/gpu.py profile DIR [ROW[@VARIANT] ...]  # there: a decode step's kernels and host share

Artifacts compile where Kiln's pinned torch runs (`prepare`: an artifact for CUDA holds the IR
and weights; the GPU compiles it when it loads). Speed depends on shapes, not weight values, so
the large models travel as skeletons (the weights file's header alone) and `check` fills them
with random values of the recorded dtypes and shapes before loading them unhashed
(gpu_skeletons.py).

`check`:
1. the device-to-device copy bandwidth (bytes read + written per second), the ceiling;
2. greedy: each tiny random-weight architecture and family (tests/tiny_models.py) compiled f32, 48 new
   tokens at batch 1 and 2 against Hugging Face eager on the GPU in f32 with TF32 off, token for
   token, and the largest logit difference, teacher-forced (one process per architecture);
3. speed: a Llama-3.2-1B-shaped model in bf16, int8 and int4-g32 (tied embedding quantized too)
   and SmolLM2-135M's shape in f16: tg128 decode tokens/s through `llm.generate` after a
   one-token prompt, the weight bytes read per token over that time as GB/s and as a fraction of
   the copy bandwidth, pp512 tokens/s; beside Hugging Face's static cache + torch.compile
   (`generate(cache_implementation="static")`, which compiles the forward with CUDA graphs) on
   the same shapes, random weights; the f16 SmolLM2 and bf16 1B shapes also through the tinygrad
   backend on tinygrad's CUDA device (`-tinygrad` rows). Each row runs in its own process; they
   compile side by side, then time one at a time.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from gpu_skeletons import (  # noqa: E402
    compile_for_cuda,
    fill,
    restore_tokenizers,
    shaped_checkpoint,
    share_tokenizers,
    to_skeleton,
    weight_bytes,
)

ARCHES = (  # tests/tiny_models.py: ARCHITECTURES, then the FAMILIES with their own attention or routing
    *("gpt2", "llama", "qwen2", "mistral", "gemma3"),
    *("bloom", "mpt", "falcon", "gemma2", "mixtral", "olmoe"),
)
SPEED_ROWS = {  # name: (model, dtype, quantize, backend)
    "llama1b-bf16": ("llama1b", "bf16", None, "inductor"),
    "llama1b-int8": ("llama1b", "bf16", "int8", "inductor"),
    "llama1b-int4": ("llama1b", "bf16", "int4-g32", "inductor"),
    "smollm2-f16": ("smollm2", "f16", None, "inductor"),
    "smollm2-f16-tinygrad": ("smollm2", "f16", None, "tinygrad"),
    "llama1b-bf16-tinygrad": ("llama1b", "bf16", None, "tinygrad"),
}


# -- here: artifacts --------------------------------------------------------------------------
def prepare(directory: Path, rows: list[str]) -> None:
    import kiln
    from tiny_models import save_tiny_checkpoint

    directory.mkdir(parents=True, exist_ok=True)
    for arch in ARCHES:
        checkpoint = save_tiny_checkpoint(arch, directory / arch, seed=0)
        compile_for_cuda(kiln, checkpoint, directory / f"{arch}.kiln", "f32", None, max_batch=2, max_seq_len=128)
    for name in rows:
        model, dtype, quantize, backend = SPEED_ROWS[name]
        checkpoint = shaped_checkpoint(model, directory / "checkpoints")
        artifact = directory / f"{name}.kiln"
        compile_for_cuda(kiln, checkpoint, artifact, dtype, quantize, max_batch=1, max_seq_len=1024, backend=backend)
        to_skeleton(artifact)
        (directory / f"{model}.config.json").write_text((checkpoint / "config.json").read_text())
    share_tokenizers(directory)


# -- there: measurements ----------------------------------------------------------------------
def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (median of 20)."""
    a = torch.empty(1 << 29, dtype=torch.float32, device="cuda").normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * a.numel() * 4 / statistics.median(times[3:])


def greedy_one(directory: Path, arch: str) -> dict:
    import transformers

    import kiln
    from cuda_onnxruntime import PROMPTS, first_difference, hf_greedy, logit_gap

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory / arch, dtype=torch.float32, attn_implementation="eager"
    )
    hf = hf.cuda().eval()  # eager: ALiBi and soft-capping families have no SDPA path
    expected = hf_greedy(hf, PROMPTS, 48)
    llm = kiln.load(directory / f"{arch}.kiln", device="cuda")
    single = [llm.generate(p, max_new_tokens=48, temperature=0, ignore_eos=True).token_ids for p in PROMPTS]
    batch = [r.token_ids for r in llm.generate(PROMPTS, max_new_tokens=48, temperature=0, ignore_eos=True)]
    return {
        "logit_gap": logit_gap(llm, hf, "cuda", expected[0]),
        "batch1_equal": single == expected,
        "batch2_equal": batch == expected,
        "first_difference": [first_difference(single, expected), first_difference(batch, expected)],
        "decode_graphs": llm.executable.captured_batches,
    }


def kiln_row(directory: Path, name: str, turn) -> dict:
    import kiln

    artifact = directory / f"{name.split('@')[0]}.kiln"  # row@variant: the row's artifact (filled by check)
    fill(artifact)
    started = time.perf_counter()
    llm = kiln.load(artifact, device="cuda", check_hashes=False)
    prompt = [1]
    llm.generate(prompt, max_new_tokens=16, temperature=0, ignore_eos=True)  # compiles decode
    long_prompt = torch.randint(100, 1000, (1, 512))
    llm.executable.run(long_prompt, torch.arange(512)[None], last_only=True)  # compiles prefill
    ready_s = time.perf_counter() - started
    with turn():
        stats = [llm.generate(prompt, max_new_tokens=128, temperature=0, ignore_eos=True).stats for _ in range(5)]
        pp = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.executable.run(long_prompt, torch.arange(512)[None], last_only=True)
            pp.append(512 / (time.perf_counter() - start))
    tok_s = statistics.median(s.decode_tokens_per_s for s in stats)
    return {"tg128": tok_s, "pp512": statistics.median(pp), "load_compile_s": ready_s, "bytes": weight_bytes(artifact)}


def hf_row(directory: Path, model: str, dtype: str, turn) -> dict:
    """Hugging Face's static cache + torch.compile, random weights of the same shape."""
    import transformers

    from cuda_onnxruntime import TORCH_DTYPES

    config = transformers.AutoConfig.from_pretrained(directory / f"{model}.config.json")
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[dtype]).eval()
    ids = torch.tensor([[1]], device="cuda")

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            cache_implementation="static",
        )
        torch.cuda.synchronize()
        return time.perf_counter() - start

    started = time.perf_counter()
    for _ in range(2):  # compiles, records its CUDA graphs (a static cache per length)
        generate(129), generate(1)
    ready_s = time.perf_counter() - started
    with turn():
        rates = [128 / (generate(129) - generate(1)) for _ in range(5)]
    return {"tg128": statistics.median(rates), "load_compile_s": ready_s}


def one_at_a_time(directory: Path, count: int, name: str):
    """A context in which this row alone times: after every row is ready (or 300 s), one by one."""

    @contextmanager
    def turn():
        (directory / f"ready.{name}").touch()
        deadline = time.time() + 300
        while len(list(directory.glob("ready.*"))) < count and time.time() < deadline:
            time.sleep(0.5)
        with open(directory / "timing.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    return turn


def in_parallel(directory: Path, jobs: list[tuple[str, list[str]]]) -> dict:
    """Run `gpu.py job ...` for each (name, args) side by side; each prints its JSON last."""
    for stale in directory.glob("ready.*"):
        stale.unlink()
    env = {**os.environ, "KILN_GPU_JOBS": str(len(jobs))}
    processes = {
        name: subprocess.Popen(
            [sys.executable, __file__, "job", str(directory), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for name, args in jobs
    }
    results, deadline = {}, time.time() + float(os.environ.get("KILN_GPU_JOB_SECONDS", "420"))
    for name, process in processes.items():
        try:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            process.kill()
            output = process.communicate()[0] + "\ntimed out"
        lines = output.strip().splitlines()
        try:
            results[name] = json.loads(lines[-1])
        except (ValueError, IndexError):
            results[name] = {"error": "\n".join(lines[-15:])}
        print(f"{name}: {results[name]}", flush=True)
    return results


def job(directory: Path, kind: str, name: str) -> dict:
    turn = one_at_a_time(directory, int(os.environ.get("KILN_GPU_JOBS", "1")), name)
    try:
        with variant_env(name):
            if kind == "greedy":
                return greedy_one(directory, name)
            if kind == "kiln":
                return kiln_row(directory, name, turn)
            if kind == "real":
                from gpu_real import real_dtype

                return real_dtype(directory, name)
            model, dtype = name.split(":")
            return hf_row(directory, model, dtype, turn)
    except BaseException:
        (directory / f"ready.{name}").touch()  # the others need not wait for this one
        raise


@contextmanager
def variant_env(name: str):
    """The environment of ROW@VARIANT's decode form (VARIANTS) while it runs; a plain row's as is."""
    saved = dict(os.environ)
    os.environ.update(VARIANTS[name.split("@")[1]] if "@" in name else {})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def fill_rows(directory: Path, names: list[str]) -> None:
    """Each row's artifact filled once (ROW@VARIANT rows share ROW's), before jobs that read it start."""
    for artifact in dict.fromkeys(name.split("@")[0] for name in names):
        fill(directory / f"{artifact}.kiln")


VARIANTS = {  # row@variant: the same artifact under another decode form (backends/inductor/cuda_*.py)
    "sdpa": {"KILN_CUDA_DECODE_ATTENTION": "sdpa"},
    "fused": {"KILN_CUDA_DECODE_ATTENTION": "fused"},
    "gemv": {"KILN_CUDA_DECODE_LINEAR": "triton"},
    "kiln": {"KILN_CUDA_DECODE_ATTENTION": "fused", "KILN_CUDA_DECODE_LINEAR": "triton"},
    "cublas": {"KILN_CUDA_DECODE_TUNING": "0"},
}


def check(directory: Path, out: Path | None, variants: list[str] = ()) -> None:
    restore_tokenizers(directory)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    arches = [a for a in ARCHES if (directory / f"{a}.kiln").is_dir()]
    chosen = os.environ.get("KILN_GPU_GREEDY", "1")  # "0": speed alone; "bloom,mpt": those arches' greedy
    if chosen != "1":
        arches = [a for a in arches if a in chosen.split(",")]
    greedy = in_parallel(directory, [(a, ["greedy", a]) for a in arches])
    rows = [n for n in SPEED_ROWS if (directory / f"{n}.kiln").is_dir()]
    fill_rows(directory, rows)
    rows += [v for v in variants if v.split("@")[0] in rows]
    baselines = sorted({SPEED_ROWS[n.split("@")[0]][:2] for n in rows})
    jobs = [(n, ["kiln", n]) for n in rows] + [(f"hf:{m}:{d}", ["hf", f"{m}:{d}"]) for m, d in baselines]
    speed = in_parallel(directory, jobs)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_GBps": bandwidth / 1e9,
        "greedy": greedy,
        "speed": speed,
    }
    table = speed_table(report)
    print(table)
    if out is not None:
        out.write_text(json.dumps(report, indent=1) + "\n\n" + table)


def speed_table(report: dict) -> str:
    bandwidth, speed = report["copy_GBps"], report["speed"]
    lines = [
        f"{report['device']}, torch {report['torch']}, copy bandwidth {bandwidth:.0f} GB/s (read + write)",
        "| row | weights GB | tg128 tok/s | GB/s | of copy bw | pp512 tok/s | HF static+compile tok/s | vs HF |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in speed.items():
        if name.startswith("hf:") or "error" in row:
            continue
        model, dtype = SPEED_ROWS[name.split("@")[0]][:2]
        hf = speed.get(f"hf:{model}:{dtype}", {}).get("tg128")
        gbps = row["bytes"] * row["tg128"] / 1e9
        lines.append(
            f"| {name} | {row['bytes'] / 1e9:.2f} | {row['tg128']:.0f} | {gbps:.0f} | {gbps / bandwidth:.0%} | "
            f"{row['pp512']:.0f} | {hf or float('nan'):.0f} | {row['tg128'] / hf if hf else float('nan'):.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["prepare", "prepare-real", "check", "real", "profile", "fill", "job"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--rows", nargs="*", default=list(SPEED_ROWS), help="speed rows to prepare")
    parser.add_argument("--out", type=Path, help="check, real: write the report here")
    parser.add_argument("--gguf", type=Path, help="real: SmolLM2's GGUF file")
    parser.add_argument("--variants", nargs="*", default=[], help=f"check: ROW@VARIANT rows too ({sorted(VARIANTS)})")
    args = parser.parse_args(argv)
    if args.action == "prepare":
        prepare(args.directory, args.rows)
    elif args.action == "prepare-real":
        from gpu_real import prepare_real

        prepare_real(args.directory)
    elif args.action == "check":
        check(args.directory, args.out, args.variants)
    elif args.action == "real":
        from gpu_real import real

        real(args.directory, args.gguf, args.out)
    elif args.action == "profile":
        from gpu_profile import profile

        for name in args.rest or ["smollm2-f16"]:  # bench/gpu_run.sh runs one process per row
            turn = one_at_a_time(args.directory, int(os.environ.get("KILN_GPU_JOBS", "1")), name)
            report = args.out and args.out.with_suffix(f".{name.replace('@', '_')}.md")  # names that travel back
            with variant_env(name):
                profile(args.directory, name, report, turn)
    elif args.action == "fill":
        restore_tokenizers(args.directory)
        fill_rows(args.directory, args.rest)
    else:
        print(json.dumps(job(args.directory, *args.rest)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
