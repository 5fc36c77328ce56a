"""Kiln-ORT on CUDA (onnxruntime-gpu): greedy equality with Hugging Face, and decode/prefill speed.

    python bench/cuda_onnxruntime.py prepare DIR --dtype f16          # here: artifacts + checkpoints
    python bench/cuda_onnxruntime.py check DIR [--speed ART ...] [--real ART ... --checkpoint HF_DIR]
    python bench/cuda_onnxruntime.py fill ART                         # there: weights for a skeleton

Artifacts are compiled where Kiln's pinned torch runs (`prepare`; f16 artifacts compile for
device="cuda" on a machine without one), and the GPU machine only loads them (`kiln.load` never
imports the frontend) with `device="cuda"` and runs them with onnxruntime-gpu's
CUDAExecutionProvider.

The real SmolLM2 travels without its weights: `bench/rebuild_weights.py strip` here, the 98 MB
GGUF converted there (Kiln's own conversion) and `rebuild_weights.py rebuild` (byte-identical,
checked against the manifest's sha256).

Speed depends on shapes, not weight values: `fill` writes random weights of the recorded
dtypes, shapes and offsets into an artifact's model.onnx.data, so SmolLM2's exact ONNX graph
can be timed on a machine its 270 MB of f16 weights cannot be copied to.

`check`:
1. Greedy: for each tiny random-weight model in DIR (tests/tiny_models.py), 64 new tokens at
   batch 1 and batch 2 (prompts of different lengths) from Kiln-ORT on CUDA against Hugging
   Face eager on the GPU in the artifact's dtype on the same checkpoint, token for
   token; and the largest logit difference from Hugging Face's, teacher-forced, for the prompt
   and 4 decode steps (f16 rounding is ~1e-2; a wrong cache is O(1)).
   f32 artifacts for CUDA keep attention in plain ONNX ops (CUDA's GroupQueryAttention is f16/bf16
   only), their caches written in place by ScatterND; the oracle then runs in f32 on the GPU with
   TF32 off, so the tokens must agree exactly.
2. Real SmolLM2 (`--real`, with the checkpoint it was compiled from): the same greedy check on two
   chat prompts of different lengths, batch 1 and 2, against Hugging Face on the GPU in the
   artifact's dtype, and decode speed through `llm.generate` beside Hugging Face eager's.
3. Speed, for each `--speed` artifact (e.g. SmolLM2 fp32 and int4): pp64 and pp512 (one
   prefill call) and tg128 (decode steps after a 1-token prompt), tokens/s mean ± sd.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ARCHES = ("gpt2", "llama", "qwen2", "mistral", "gemma3")
DEVICE = os.environ.get("KILN_CHECK_DEVICE", "cuda")  # "cpu": a dry run of this script where no GPU is
PROMPTS = [[5, 17, 33, 8, 91, 2, 40], [7, 7, 12, 60, 3, 19, 25, 44, 11, 80, 4, 9, 31]]


def prepare(directory: Path, dtype: str) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import kiln
    from tiny_models import save_tiny_checkpoint

    for arch in ARCHES:
        checkpoint = save_tiny_checkpoint(arch, directory / arch, seed=0)
        kiln.compile(
            str(checkpoint),
            out=directory / f"{arch}.kiln",
            backend="onnxruntime",
            max_seq_len=128,
            max_batch=2,
            dtype=dtype,
            device="cuda",
        )
        print(f"prepared {arch}")


def on_cuda(artifact: Path):
    import kiln

    return kiln.load(artifact, device=DEVICE)


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
        gaps.append(float((got - expected[position - tokens.size(1) : position]).abs().max()))
    return gaps


def each(names, check) -> dict:
    """check(name) for each name; a failure is recorded (and printed) and the others still run."""
    results = {}
    for name in names:
        try:
            results[name] = check(name)
        except Exception as error:  # noqa: BLE001 - a report, not a program that goes on using it
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
        print(f"{name}: {results[name]}", flush=True)
    return results


def greedy_check(directory: Path) -> dict:
    return each([a for a in ARCHES if (directory / f"{a}.kiln").is_dir()], lambda arch: greedy_one(directory, arch))


def greedy_one(directory: Path, arch: str) -> dict:
    import transformers

    # the oracle runs on the GPU in the artifact's dtype
    dtype = json.loads((directory / f"{arch}.kiln" / "manifest.json").read_text())["options"]["dtype"]
    device = DEVICE
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(directory / arch, dtype=TORCH_DTYPES[dtype]).to(device).eval()
    )
    expected = hf_greedy(hf, PROMPTS, 64)
    llm = on_cuda(directory / f"{arch}.kiln")
    single = [llm.generate(p, max_new_tokens=64, temperature=0, ignore_eos=True).token_ids for p in PROMPTS]
    batch = [r.token_ids for r in llm.generate(PROMPTS, max_new_tokens=64, temperature=0, ignore_eos=True)]
    return {
        "provider": llm.executable.session.get_providers()[0],
        "logit_gap": logit_gap(llm, hf, device, expected[0]),
        "dtype": dtype,
        "batch1_equal": single == expected,
        "batch2_equal": batch == expected,
        "first_difference": [first_difference(single, expected), first_difference(batch, expected)],
    }


TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
CHATS = [
    "What is the capital of France?",
    "Write three sentences about why the sky is blue, for a child who asked at bedtime.",
]


def first_difference(got: list[list[int]], expected: list[list[int]]) -> list[int | None]:
    return [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(got, expected)]


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Exactly `new_tokens` greedy tokens per prompt through Hugging Face's KV cache, past any
    end-of-sequence (`generate` would stop there, or with min_new_tokens mask it)."""
    out = []
    for prompt in prompts:
        ids, past, tokens = torch.tensor([prompt], device=DEVICE), None, []
        with torch.no_grad():
            for _ in range(new_tokens):
                step = hf(ids, past_key_values=past, use_cache=True)
                past, token = step.past_key_values, int(step.logits[0, -1].argmax())
                tokens.append(token)
                ids = torch.tensor([[token]], device=DEVICE)
        out.append(tokens)
    return out


def synchronize() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def hf_decode_speed(hf, prompt: list[int], new_tokens: int, reps: int) -> str:
    """Hugging Face eager on the GPU: tokens/s of `generate` after the prompt's step (greedy)."""
    ids = torch.tensor([prompt], device=DEVICE)
    seconds = []
    for _ in range(reps + 1):
        with torch.no_grad():
            synchronize()
            start = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1, do_sample=False)
            synchronize()
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens + 1,
                min_new_tokens=new_tokens + 1,
                do_sample=False,
            )
            synchronize()
            seconds.append(time.perf_counter() - start - prefill)
    return rates(new_tokens, seconds[1:])


def real_model_check(artifacts: list[Path], checkpoint: Path, reps: int) -> dict:
    """Greedy equality with Hugging Face on the GPU (64 new tokens, batch 1 and 2, two chat prompts
    of different lengths), then decode tokens/s of Kiln's `generate` and of Hugging Face eager."""
    return {a.name: r for a, r in each(artifacts, lambda a: real_one(a, checkpoint, reps)).items()}


def real_one(artifact: Path, checkpoint: Path, reps: int) -> dict:
    import transformers

    llm = on_cuda(artifact)
    dtype = json.loads((artifact / "manifest.json").read_text())["options"]["dtype"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=TORCH_DTYPES[dtype]).to(DEVICE).eval()
    prompts = [llm.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    expected = hf_greedy(hf, prompts, 64)
    single = [llm.generate(p, max_new_tokens=64, temperature=0, ignore_eos=True).token_ids for p in prompts]
    batch = [r.token_ids for r in llm.generate(prompts, max_new_tokens=64, temperature=0, ignore_eos=True)]
    stats = [
        llm.generate(prompts[0], max_new_tokens=128, temperature=0, ignore_eos=True).stats for _ in range(reps + 1)
    ][1:]
    return {
        "provider": llm.executable.session.get_providers()[0],
        "dtype": dtype,
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": [len(e) for e in expected],
        "batch1_equal": single == expected,
        "batch2_equal": batch == expected,
        "first_difference": [first_difference(single, expected), first_difference(batch, expected)],
        "text": llm.tokenizer.decode(single[0]),
        "kiln_decode_tok_s": f"{statistics.mean(s.decode_tokens_per_s for s in stats):.1f}",
        "kiln_ttft_ms": f"{statistics.mean(s.ttft_s for s in stats) * 1000:.1f}",
        "hf_eager_decode_tok_s": hf_decode_speed(hf, prompts[0], 128, reps),
    }


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
    executable = OrtExecutable(
        model_dir / "model.onnx",
        BackendOptions(max_seq_len=manifest["max_seq_len"], max_batch=manifest["max_batch"], device=DEVICE),
    )
    rows = []
    for n in (64, 512):  # a prompt as the engine feeds it: its last position's logits
        tokens, positions = torch.randint(100, 1000, (1, n)), torch.arange(n)[None]
        executable.run(tokens, positions, last_only=True)
        seconds = []
        for _ in range(reps):
            start = time.perf_counter()
            executable.run(tokens, positions, last_only=True)
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
            values = (
                rng.normal(0, 0.02, count).astype(dtype)
                if np.issubdtype(dtype, np.floating)
                else rng.integers(0, 256, int(where["length"]), dtype=np.uint8)
            )
            data.seek(int(where["offset"]))
            data.write(values.tobytes())
    print(f"filled {artifact / 'model.onnx.data'} ({(artifact / 'model.onnx.data').stat().st_size / 1e6:.0f} MB)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["prepare", "check", "fill"])
    parser.add_argument("directory", type=Path)
    parser.add_argument(
        "--speed",
        nargs="*",
        default=[],
        type=Path,
        help="artifact directories (model.onnx, model.onnx.data, manifest.json) to time on CUDA",
    )
    parser.add_argument(
        "--real",
        nargs="*",
        default=[],
        type=Path,
        help="artifacts of a real model to check greedy against Hugging Face and time",
    )
    parser.add_argument("--checkpoint", type=Path, help="the Hugging Face directory the --real artifacts come from")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument(
        "--dtype", default="f32", help="prepare: the artifacts' dtype (f16 for CUDA's attention kernels)"
    )
    args = parser.parse_args(argv)
    if args.action == "prepare":
        prepare(args.directory, args.dtype)
        return 0
    if args.action == "fill":
        fill(args.directory)
        return 0
    import onnxruntime

    print(
        f"# onnxruntime {onnxruntime.__version__} {onnxruntime.get_available_providers()}; torch {torch.__version__}; "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no torch CUDA'}",
        flush=True,
    )
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # f32 means f32
    report = {"greedy": greedy_check(args.directory), "speed": {}}
    report["real"] = real_model_check(args.real, args.checkpoint, args.reps) if args.real else {}
    print("| artifact | test | t/s |\n| --- | --- | ---: |")
    for artifact in args.speed:
        try:
            report["speed"][artifact.name] = speed(artifact, args.reps, args.tg)
        except Exception as error:  # noqa: BLE001
            print(f"| {artifact.name} | failed: {type(error).__name__}: {str(error)[:300]} | |", flush=True)
            continue
        for test, value in report["speed"][artifact.name]:
            print(f"| {artifact.name} | {test} | {value} |", flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
