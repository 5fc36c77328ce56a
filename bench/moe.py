"""Mixture-of-experts decode: a Mixtral-shaped random model beside a dense model of the same
active parameters, on Kiln-Inductor and Hugging Face eager.

    .venv/bin/python bench/moe.py [--layers 6] [--hidden 384] [--expert-width 1024] [--experts 8]
        [--tokens 64] [--threads 2] [--quantize int4-g32]

The MoE model routes each token to 2 of `--experts` SwiGLU experts of width `--expert-width`; the
dense model is the same Llama-style decoder whose one SwiGLU MLP is twice that wide, so a token
multiplies the same number of weights in both. Both are built from configs with seeded random
weights (the tiny test tokenizer, 512 tokens), compiled fp32 for Inductor, and decode `--tokens`
greedy tokens after a 16-token prompt; Hugging Face eager decodes the same with its KV cache.
Reported per model: all weights, the weights one decode step reads (the routed experts' share of
the expert weights; attention, norms, router, embedding row and lm_head in full), tokens/s and
what that makes in GB/s. With `--quantize SCHEME` (default int4-g32; "none" for no such rows)
each model is compiled a second time with its weights (the experts' included) quantized by that
scheme: its rows read the routed experts' codes and scales only. Writes bench/results/moe.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from cpu_contention import CONTENDED_CORES, CpuMeter
from provenance import write_result
from tiny_models import VOCAB_SIZE, tokenizer_config, tokenizer_json

RESULTS = Path(__file__).parent / "results"
TOP_K = 2


def configs(args) -> dict:
    from transformers import LlamaConfig, MixtralConfig

    shared = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return {
        "mixtral (MoE)": MixtralConfig(
            **shared, intermediate_size=args.expert_width, num_local_experts=args.experts, num_experts_per_tok=TOP_K
        ),
        "llama (dense)": LlamaConfig(**shared, intermediate_size=TOP_K * args.expert_width),
    }


def build(config, directory: Path):
    import json

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_text(tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()) + "\n")
    return model


def step_bytes(weights: dict, experts: int) -> tuple[int, int]:
    """(all weight bytes, the bytes one decode step reads) of named weights (a model's parameters or
    a compiled graph's, quantized ones included): experts count top_k / experts of theirs; of the
    embedding only one row is read."""
    total = read = 0
    for name, tensor in weights.items():
        size = tensor.numel() * tensor.element_size()
        total += size
        if ".experts." in name:
            read += size * TOP_K // experts
        elif "embed_tokens" in name:
            read += size // tensor.shape[0]
        else:
            read += size
    return total, read


@torch.no_grad()
def hf_greedy(model, prompt: list[int], tokens: int) -> list[int]:
    """Hugging Face eager's `tokens` greedy tokens after `prompt` (its KV cache, no early end)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        min_new_tokens=tokens,
        max_new_tokens=tokens,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def timed(generate, repeats: int) -> tuple[float, float]:
    """(median seconds, others' cores of the slowest run) over `repeats` runs after a warm-up."""
    generate()
    seconds, others = [], 0.0
    for _ in range(repeats):
        with CpuMeter() as meter:
            generate()
        seconds.append(meter.result.wall_s)
        others = max(others, meter.result.other_cores)
    return statistics.median(seconds), others


def quantized_row(args, name: str, directory: Path, prompt: list[int], experts: int) -> tuple:
    """The model compiled for Inductor with its weights quantized by `args.quantize`, timed."""
    import kiln
    from kiln.runtime.artifact import read_artifact

    path = kiln.compile(
        directory, out=directory / "quantized.kiln", backend="inductor", max_seq_len=256, quantize=args.quantize
    )
    total, read = step_bytes(read_artifact(path).graph.weights, experts)
    llm = kiln.load(path)
    seconds, others = timed(lambda: llm.generate(prompt, max_new_tokens=args.tokens, ignore_eos=True), args.repeats)
    rate = args.tokens / seconds
    return name, total, read, f"kiln-inductor {args.quantize}", rate, rate * read / 1e9, "n/a", others


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--expert-width", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize", default="int4-g32", help="a weight scheme for extra rows, or none")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import kiln

    prompt = list(range(3, 19))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln_moe_") as root:
        for name, config in configs(args).items():
            directory = Path(root) / name.split()[0]
            model = build(config, directory)
            experts = getattr(model.config, "num_local_experts", 0)
            total, read = step_bytes(dict(model.named_parameters()), experts)
            llm = kiln.load(kiln.compile(directory, out=directory / "model.kiln", backend="inductor", max_seq_len=256))

            def hf(model=model):
                return hf_greedy(model, prompt, args.tokens)

            def kiln_decode(llm=llm):
                return llm.generate(prompt, max_new_tokens=args.tokens, ignore_eos=True).token_ids

            same = "yes" if kiln_decode() == hf() else "NO"
            for runner, run in (("kiln-inductor", kiln_decode), ("hf-eager", hf)):
                seconds, others = timed(run, args.repeats)
                rate = args.tokens / seconds  # prefill of 16 tokens included, alike for every row
                rows.append((name, total, read, runner, rate, rate * read / 1e9, same, others))
            if args.quantize != "none":
                rows.append(quantized_row(args, name, directory, prompt, experts))
    lines = [
        "| model | weights MB | read per step MB | runner | tokens/s | GB/s | Kiln = HF greedy | others' cores |",
        "| --- | ---: | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for name, total, read, runner, rate, gbs, same, others in rows:
        flag = " *" if others > CONTENDED_CORES else ""
        lines.append(
            f"| {name} | {total / 1e6:.0f} | {read / 1e6:.0f} | {runner} | {rate:.1f} | {gbs:.1f} | "
            f"{same} | {others:.2f}{flag} |"
        )
    report = "\n".join(lines) + (
        f"\n\n{args.layers} layers, hidden {args.hidden}, {args.experts} experts of width {args.expert_width} "
        f"(top-{TOP_K}) against one MLP of width {TOP_K * args.expert_width}; fp32, {args.threads} threads, "
        f"{args.tokens} greedy tokens after a 16-token prompt (its prefill included); quantized rows: "
        f"{args.quantize}, the experts' weights included (their greedy tokens are not HF's f32 ones). "
        f"`*`: other processes kept "
        f"more than {CONTENDED_CORES} of a core busy during the run.\n"
    )
    print(report)
    write_result(RESULTS / "moe.md", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
