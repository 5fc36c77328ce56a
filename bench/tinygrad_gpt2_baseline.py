"""The baseline for Kiln's tinygrad backend: GPT-2 small written by hand in tinygrad, as its
Hugging Face module reads, decoding under TinyJit on tinygrad's CPU device, stock settings.

    .venv/bin/python bench/tinygrad_gpt2_baseline.py [--model DIR] [--tokens 32] [--transpose]

Weights come from the same checkpoint Kiln compiles (bench/gpt2_small.py): Conv1D weights are
used as stored, [in, out] (`x @ w + b`), unless --transpose stores them as nn.Linear's
[out, in] (what tinygrad's own GPT-2 example does) to measure what the layout alone changes.
The KV cache is a realized tensor written with `assign` at a bound `start_pos` Variable, as in
tinygrad's examples. Prints one JSON line: per rep, decode tokens/s by wall clock and by this
process's CPU time, and the cores other processes used meanwhile; with --serve it times one rep per
"rep" line on stdin, so that bench/tinygrad_gpt2.py can alternate it with the other runners.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DEV", "CPU")
from tinygrad import Tensor, TinyJit, UOp, dtypes
from tinygrad.nn.state import safe_load

sys.path.insert(0, str(Path(__file__).parent))
from gpt2_small import gpt2_small_dir
from tinygrad_gpt2 import serve_reps, timed_reps

LAYERS, DIM, HEADS, MAX_CONTEXT = 12, 768, 12, 256


class Conv1D:
    def __init__(self, weights: dict, name: str, transpose: bool):
        w = weights[f"{name}.weight"]
        self.transpose = transpose
        self.weight = (w.T if transpose else w).contiguous().realize()
        self.bias = weights[f"{name}.bias"]

    def __call__(self, x: Tensor) -> Tensor:
        return (x @ self.weight.T if self.transpose else x @ self.weight) + self.bias


class LayerNorm:
    def __init__(self, weights: dict, name: str):
        self.weight, self.bias = weights[f"{name}.weight"], weights[f"{name}.bias"]

    def __call__(self, x: Tensor) -> Tensor:
        return x.layernorm(eps=1e-5) * self.weight + self.bias


class Block:
    def __init__(self, weights: dict, i: int, transpose: bool):
        p = f"transformer.h.{i}"
        self.ln_1, self.ln_2 = LayerNorm(weights, f"{p}.ln_1"), LayerNorm(weights, f"{p}.ln_2")
        self.c_attn, self.attn_proj = (
            Conv1D(weights, f"{p}.attn.c_attn", transpose),
            Conv1D(weights, f"{p}.attn.c_proj", transpose),
        )
        self.c_fc, self.mlp_proj = (
            Conv1D(weights, f"{p}.mlp.c_fc", transpose),
            Conv1D(weights, f"{p}.mlp.c_proj", transpose),
        )
        self.cache_kv = Tensor.zeros(2, 1, HEADS, MAX_CONTEXT, DIM // HEADS).contiguous().realize()

    def attention(self, x: Tensor, start_pos) -> Tensor:
        batch, seq, _ = x.shape
        q, k, v = [t.reshape(batch, seq, HEADS, DIM // HEADS).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=2)]
        self.cache_kv[:, :, :, start_pos : start_pos + seq, :].assign(Tensor.stack(k, v))
        keys, values = self.cache_kv[0, :, :, : start_pos + seq], self.cache_kv[1, :, :, : start_pos + seq]
        out = q.scaled_dot_product_attention(keys, values, is_causal=seq > 1)
        return self.attn_proj(out.transpose(1, 2).reshape(batch, seq, DIM))

    def __call__(self, x: Tensor, start_pos) -> Tensor:
        h = x + self.attention(self.ln_1(x), start_pos)
        return h + self.mlp_proj(self.c_fc(self.ln_2(h)).gelu())


class GPT2:
    def __init__(self, model_dir: Path, transpose: bool):
        weights = {k: v.to("CPU").realize() for k, v in safe_load(str(model_dir / "model.safetensors")).items()}
        self.wte, self.wpe = weights["transformer.wte.weight"], weights["transformer.wpe.weight"]
        self.blocks = [Block(weights, i, transpose) for i in range(LAYERS)]
        self.ln_f = LayerNorm(weights, "transformer.ln_f")
        self.decode = TinyJit(self.forward)

    def forward(self, tokens: Tensor, start_pos) -> Tensor:
        seq = tokens.shape[1]
        x = self.wte[tokens] + self.wpe[start_pos : start_pos + seq].unsqueeze(0)
        for block in self.blocks:
            x = block(x, start_pos)
        return (self.ln_f(x[:, -1:]) @ self.wte.T).argmax(-1).realize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GPT-2 small HF directory (default: bench/gpt2_small.py's)")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per timed rep")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--transpose", action="store_true", help="store Conv1D weights as [out, in]")
    parser.add_argument("--serve", action="store_true", help="time one rep per 'rep' line on stdin (tinygrad_gpt2.py)")
    args = parser.parse_args(argv)
    model = GPT2(Path(args.model) if args.model else gpt2_small_dir(), args.transpose)
    start = UOp.variable("start_pos", 1, MAX_CONTEXT - 1)
    prompt = [464, 2068, 7586]
    state = {"token": model.forward(Tensor([prompt], dtype=dtypes.int32), 0).item(), "position": len(prompt)}

    def step():
        token = Tensor([[state["token"]]], dtype=dtypes.int32)
        state["token"] = model.decode(token, start.bind(state["position"])).item()
        state["position"] = state["position"] + 1 if state["position"] < MAX_CONTEXT - 2 else len(prompt)

    for _ in range(3):  # eager run, JIT capture, first replay
        step()
    if args.serve:
        serve_reps(step, args.tokens)
    else:
        print(json.dumps(timed_reps(step, args.tokens, args.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
