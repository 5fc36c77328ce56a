"""Kiln-ORT on CUDA (onnxruntime-gpu): greedy equality with Hugging Face, and decode/prefill speed.

    python bench/cuda_onnxruntime.py prepare DIR                      # here: artifacts + checkpoints
    python bench/cuda_onnxruntime.py check DIR [--speed ART ...]      # on the GPU machine

Artifacts are compiled where Kiln's pinned torch runs (`prepare`): ONNX models are
provider-neutral, so the GPU machine only loads them (`kiln.load` never imports the frontend)
with `device="cuda"` and runs them with onnxruntime-gpu's CUDAExecutionProvider.

`check`:
1. Greedy: for each tiny random-weight model in DIR (tests/tiny_models.py), 64 new tokens at
   batch 1 and batch 2 (prompts of different lengths) from Kiln-ORT on CUDA against Hugging
   Face eager (fp32) on the same checkpoint, token for token.
2. Speed, for each `--speed` artifact (e.g. SmolLM2 fp32 and int4): pp64 and pp512 (one
   prefill call) and tg128 (decode steps after a 1-token prompt), tokens/s mean ± sd.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ARCHES = ("llama", "qwen2", "mistral", "gemma3")
PROMPTS = [[5, 17, 33, 8, 91, 2, 40], [7, 7, 12, 60, 3, 19, 25, 44, 11, 80, 4, 9, 31]]


def prepare(directory: Path, dtype: str) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import save_tiny_checkpoint

    import kiln

    for arch in ARCHES:
        checkpoint = save_tiny_checkpoint(arch, directory / arch, seed=0)
        kiln.compile(str(checkpoint), out=directory / f"{arch}.kiln", backend="onnxruntime", max_seq_len=128,
                     max_batch=2, dtype=dtype)
        print(f"prepared {arch}")


def on_cuda(artifact: Path):
    import kiln
    from kiln.backends import onnxruntime as ort_backend

    llm = kiln.load(artifact)
    options = dataclasses.replace(llm.executable.options, device=os.environ.get("KILN_CHECK_DEVICE", "cuda"))
    llm.executable = ort_backend.load(artifact, llm.graph, {}, options)
    return llm


def logit_gap(artifact: Path, continuation: list[int]) -> list[float]:
    """max |logits(CUDA) - logits(CPU)| of the same executable for the prompt, then each of the
    first 4 tokens of `continuation` fed one by one (teacher-forced): a numeric difference stays
    near 1e-5, a wrong cache shows up as O(1) from the first decode step."""
    import kiln
    from kiln.backends import onnxruntime as ort_backend

    llm = kiln.load(artifact)
    cpu = llm.executable
    cuda = ort_backend.load(artifact, llm.graph, {}, dataclasses.replace(cpu.options, device="cuda"))
    prompt = PROMPTS[0]
    feeds = [(torch.tensor([prompt]), torch.arange(len(prompt))[None])]
    feeds += [(torch.tensor([[t]]), torch.tensor([[len(prompt) + i]])) for i, t in enumerate(continuation[:4])]
    return [float((cuda.run(*f) - cpu.run(*f)).abs().max()) for f in feeds]


def greedy_check(directory: Path) -> dict:
    import transformers

    results = {}
    for arch in ARCHES:
        # the oracle runs in the artifact's dtype: f16 on the GPU, f32 on the CPU
        dtype = json.loads((directory / f"{arch}.kiln" / "manifest.json").read_text())["options"]["dtype"]
        device = "cuda" if dtype != "f32" else "cpu"
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            directory / arch, dtype={"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]).to(device).eval()
        expected = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device=device)
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                                  do_sample=False, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
        llm = on_cuda(directory / f"{arch}.kiln")
        single = [llm.generate(p, max_new_tokens=64, temperature=0, ignore_eos=True).token_ids for p in PROMPTS]
        batch = [r.token_ids for r in llm.generate(PROMPTS, max_new_tokens=64, temperature=0, ignore_eos=True)]
        def first_difference(got):
            return [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(got, expected)]

        results[arch] = {"provider": llm.executable.session.get_providers()[0],
                         "logit_gap": logit_gap(directory / f"{arch}.kiln", expected[0]),
                         "dtype": dtype, "batch1_equal": single == expected, "batch2_equal": batch == expected,
                         "first_difference": [first_difference(single), first_difference(batch)]}
        print(f"{arch}: {results[arch]}", flush=True)
    return results


def rates(n: int, seconds: list[float]) -> str:
    values = [n / s for s in seconds]
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.1f}"


def speed(model_dir: Path, reps: int, tg: int) -> list[tuple[str, str]]:
    """pp64/pp512/tg of the ONNX model in `model_dir` (model.onnx + model.onnx.data + manifest.json
    of an artifact: the safetensors copy of the weights need not travel) on CUDA, through the
    executable itself (greedy decode loop feeding back each argmax)."""
    from kiln.backends.executable import BackendOptions
    from kiln.backends.onnxruntime.executable import OrtExecutable

    manifest = json.loads((model_dir / "manifest.json").read_text())["options"]
    executable = OrtExecutable(model_dir / "model.onnx", BackendOptions(
        max_seq_len=manifest["max_seq_len"], max_batch=manifest["max_batch"], device="cuda"))
    rows = []
    for n in (64, 512):
        tokens, positions = torch.randint(100, 1000, (1, n)), torch.arange(n)[None]
        executable.run(tokens, positions)
        seconds = []
        for _ in range(reps):
            start = time.perf_counter()
            executable.run(tokens, positions)
            seconds.append(time.perf_counter() - start)
        rows.append((f"pp{n}", rates(n, seconds)))

    def decode(steps: int) -> float:
        executable.reset()
        token = int(executable.run(torch.tensor([[1]]), torch.tensor([[0]]))[0, -1].argmax())
        start = time.perf_counter()
        for position in range(1, steps + 1):
            logits = executable.run(torch.tensor([[token]]), torch.tensor([[position]]))
            token = int(logits.numpy()[0, -1].argmax())
        return time.perf_counter() - start

    decode(8)
    rows.append((f"tg{tg}", rates(tg, [decode(tg) for _ in range(reps)])))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["prepare", "check"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--speed", nargs="*", default=[], type=Path,
                        help="artifact directories (model.onnx, model.onnx.data, manifest.json) to time on CUDA")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--dtype", default="f32", help="prepare: the artifacts' dtype (f16 for CUDA's attention kernels)")
    args = parser.parse_args(argv)
    if args.action == "prepare":
        prepare(args.directory, args.dtype)
        return 0
    import onnxruntime

    print(f"# onnxruntime {onnxruntime.__version__} {onnxruntime.get_available_providers()}; torch {torch.__version__}; "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no torch CUDA'}", flush=True)
    report = {"greedy": greedy_check(args.directory), "speed": {}}
    print("| artifact | test | t/s |\n| --- | --- | ---: |")
    for artifact in args.speed:
        report["speed"][artifact.name] = speed(artifact, args.reps, args.tg)
        for test, value in report["speed"][artifact.name]:
            print(f"| {artifact.name} | {test} | {value} |", flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
