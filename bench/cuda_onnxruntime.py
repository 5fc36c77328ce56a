"""Kiln-ORT on CUDA (onnxruntime-gpu): greedy equality with Hugging Face, and decode/prefill speed.

    python bench/cuda_onnxruntime.py prepare DIR --dtype f16          # here: artifacts + checkpoints
    python bench/cuda_onnxruntime.py check DIR [--speed ART ...]      # on the GPU machine
    python bench/cuda_onnxruntime.py fill ART                         # there: weights for a skeleton

Artifacts are compiled where Kiln's pinned torch runs (`prepare`; f16 artifacts compile for
device="cuda" on a machine without one), and the GPU machine only loads them (`kiln.load` never
imports the frontend) with `device="cuda"` and runs them with onnxruntime-gpu's
CUDAExecutionProvider.

Speed depends on shapes, not weight values: `fill` writes random weights of the recorded
dtypes, shapes and offsets into an artifact's model.onnx.data, so SmolLM2's exact ONNX graph
can be timed on a machine its 270 MB of f16 weights cannot be copied to.

`check`:
1. Greedy: for each tiny random-weight model in DIR (tests/tiny_models.py), 64 new tokens at
   batch 1 and batch 2 (prompts of different lengths) from Kiln-ORT on CUDA against Hugging
   Face eager in the artifact's dtype (on the GPU for f16) on the same checkpoint, token for
   token; and the largest logit difference from Hugging Face's, teacher-forced, for the prompt
   and 4 decode steps (f16 rounding is ~1e-2; a wrong cache is O(1)).
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
                     max_batch=2, dtype=dtype, device="cpu" if dtype == "f32" else "cuda")
        print(f"prepared {arch}")


def on_cuda(artifact: Path):
    import kiln

    return kiln.load(artifact, device=os.environ.get("KILN_CHECK_DEVICE", "cuda"))


def logit_gap(llm, hf, device: str, continuation: list[int]) -> list[float]:
    """max |logits(Kiln) - logits(Hugging Face)| for the prompt, then for each of the first 4
    tokens of `continuation` fed one by one (teacher-forced, through the KV cache)."""
    prompt = PROMPTS[0]
    sequence = prompt + continuation[:4]
    with torch.no_grad():
        expected = hf(torch.tensor([sequence], device=device)).logits[0].float().cpu()
    llm.executable.reset()
    feeds = [(torch.tensor([prompt]), torch.arange(len(prompt))[None])]
    feeds += [(torch.tensor([[t]]), torch.tensor([[len(prompt) + i]])) for i, t in enumerate(continuation[:4])]
    gaps, position = [], 0
    for tokens, positions in feeds:
        got = llm.executable.run(tokens, positions)[0].float()
        position += tokens.size(1)
        gaps.append(float((got - expected[position - tokens.size(1):position]).abs().max()))
    return gaps


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
                         "logit_gap": logit_gap(llm, hf, device, expected[0]),
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


def fill(artifact: Path, seed: int = 0) -> None:
    """Write random weights into `artifact`/model.onnx.data at the offsets model.onnx records:
    floats small and finite (N(0, 0.02)), integer packs random bytes."""
    import numpy as np
    import onnx

    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    rng = np.random.default_rng(seed)
    with open(artifact / "model.onnx.data", "wb") as data:
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            where = {e.key: e.value for e in tensor.external_data}
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            count = int(where["length"]) // np.dtype(dtype).itemsize
            values = (rng.normal(0, 0.02, count).astype(dtype) if np.issubdtype(dtype, np.floating)
                      else rng.integers(0, 256, int(where["length"]), dtype=np.uint8))
            data.seek(int(where["offset"]))
            data.write(values.tobytes())
    print(f"filled {artifact / 'model.onnx.data'} ({(artifact / 'model.onnx.data').stat().st_size / 1e6:.0f} MB)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["prepare", "check", "fill"])
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
    if args.action == "fill":
        fill(args.directory)
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
