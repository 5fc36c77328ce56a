"""The real SmolLM2 on a GPU (bench/gpu.py prepare-real / real): f16 and bf16 artifacts for CUDA
compiled here without their weights, rebuilt there from the GGUF converted there
(bench/rebuild_weights.py: byte-identical, the manifest's sha256 checks), then greedy against
Hugging Face in the same dtype on the GPU, the logit gap over a prompt, and decode speed.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch

from cuda_onnxruntime import CHATS, TORCH_DTYPES, first_difference, hf_greedy
from gpu import in_parallel
from gpu_skeletons import compile_for_cuda, restore_tokenizers, share_tokenizers


def prepare_real(directory: Path) -> None:
    """The real SmolLM2 in f16 and bf16 for CUDA, without weights: `real` rebuilds them there
    from the GGUF (bench/rebuild_weights.py; byte-identical, the manifest's sha256 checks)."""
    import kiln
    from kiln.frontend.default_model import default_model_dir
    from rebuild_weights import strip

    for dtype in ("f16", "bf16"):
        full = directory / "full" / f"smollm2-real-{dtype}.kiln"
        compile_for_cuda(kiln, default_model_dir(), full, dtype, None, max_batch=2, max_seq_len=512)
        strip(full, directory / full.name, default_model_dir())
    share_tokenizers(directory)


def real(directory: Path, gguf: Path, out: Path | None) -> None:
    """The real SmolLM2 on the GPU in f16 and bf16, side by side (one process each): greedy
    against Hugging Face in the same dtype on the GPU (64 new tokens, two chat prompts, batch 1
    and 2), logit gaps, decode speed. Decode compiles without coordinate-descent tuning unless
    KILN_CUDA_DECODE_TUNING says otherwise: equality is the point, and the tuning's compiles had
    outlasted a session's device time."""
    from kiln.frontend.default_model import convert_gguf

    restore_tokenizers(directory)
    checkpoint = directory / "smollm2-checkpoint"
    if not (checkpoint / "config.json").is_file():
        convert_gguf(gguf, checkpoint)
    os.environ.setdefault("KILN_CUDA_DECODE_TUNING", "0")
    results = in_parallel(directory, [(dtype, ["real", dtype]) for dtype in ("f16", "bf16")])
    if out is not None:
        out.write_text(json.dumps(results, indent=1))


def real_dtype(directory: Path, dtype: str) -> dict:
    """One dtype's part of `real` (`gpu.py job DIR real DTYPE`): the weights rebuilt (or loaded
    unhashed where this machine's GGUF conversion rounds otherwise), then `real_one`."""
    from rebuild_weights import rebuild

    artifact, checkpoint = directory / f"smollm2-real-{dtype}.kiln", directory / "smollm2-checkpoint"
    try:
        try:
            rebuild(artifact, checkpoint)
            as_compiled = True
        except SystemExit as mismatch:
            print(mismatch, flush=True)
            as_compiled = False
        result = {"weights_as_compiled": as_compiled, **real_one(artifact, checkpoint, dtype, as_compiled)}
    except Exception as error:  # noqa: BLE001 - a report: the other dtype still runs
        result = {"error": f"{type(error).__name__}: {str(error)[:800]}"}
    return {**result, "decode_tuning": os.environ.get("KILN_CUDA_DECODE_TUNING", "1")}


def real_one(artifact: Path, checkpoint: Path, dtype: str, check_hashes: bool) -> dict:
    import transformers

    import kiln

    llm = kiln.load(artifact, device="cuda", check_hashes=check_hashes)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=TORCH_DTYPES[dtype]).cuda().eval()
    prompts = [llm.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    expected = hf_greedy(hf, prompts, 64)
    single = [llm.generate(p, max_new_tokens=64, temperature=0, ignore_eos=True).token_ids for p in prompts]
    batch = [r.token_ids for r in llm.generate(prompts, max_new_tokens=64, temperature=0, ignore_eos=True)]
    with torch.no_grad():
        reference = hf(torch.tensor([prompts[0]], device="cuda")).logits[0, -1].float().cpu()
        exact = f32_logits(checkpoint, prompts[0])
    llm.executable.reset()
    mine = llm.executable.run(torch.tensor([prompts[0]]), torch.arange(len(prompts[0]))[None])[0, -1]
    stats = [llm.generate(prompts[0], max_new_tokens=128, temperature=0, ignore_eos=True).stats for _ in range(4)]
    return {
        "batch1_equal": single == expected,
        "batch2_equal": batch == expected,
        "first_difference": [first_difference(single, expected), first_difference(batch, expected)],
        "prompt_logit_gap": float((mine - reference).abs().max()),
        "prompt_logit_scale": float(reference.abs().max()),
        # within rounding: Kiln's half-precision logits no further from f32 than Hugging Face's
        "kiln_gap_to_f32": float((mine - exact).abs().max()),
        "hf_gap_to_f32": float((reference - exact).abs().max()),
        "text": llm.tokenizer.decode(single[0]),
        "hf_text": llm.tokenizer.decode(expected[0]),
        "kiln_decode_tok_s": statistics.median(s.decode_tokens_per_s for s in stats[1:]),
    }


def f32_logits(checkpoint: Path, prompt: list[int]) -> torch.Tensor:
    """The last position's logits of Hugging Face in f32 on the GPU (TF32 off): the yardstick
    both half-precision runs are measured against."""
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).cuda().eval()
    logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float().cpu()
    del model
    return logits
