"""The eagle layer's draft step compiled by Kiln: captured into IR, through the passes, lowered.

Drafting runs the draft-context eagle layer (eagle_heads.py) once per draft position; in torch
eager that is some 60 ops with Python between them, which costs several times what reading the
step's weights costs. Here one draft position, for a fixed number of rows (a tree level's, or
one chain), is a module with fixed shapes:

    (states [rows, hidden], embedded tokens [rows, hidden], the draft's earlier keys and values
     [rows, kv_heads, stages - 1, head_dim] each, RoPE's cos and sin rows [1, half], an additive
     mask [1, 1, 1, stages] over the keys: the earlier slots not yet filled are -inf)
      -> (next states [rows, hidden], logits over the draft vocabulary [rows, vocab],
          this position's key and value [rows, kv_heads, 1, head_dim])

captured by Kiln's frontend (`capture_module`), run through the fuse phase and, with int8
weights, the quantize phase's `int8` scheme (per output channel, symmetric: the scheme the
torch heads' Int8Linear uses), and lowered by a backend (`lower_step`: Inductor, whose int8
linears run Kiln's int8 x int8 kernel). The drafter holds the keys and values between positions
and gathers them by row as a tree grows (eagle_tree.py); the embedding gather stays in torch (one
index, and the model's 113 MB table stays out of the compiled module).

Whole-context heads attend over a draft cache that grows with the request, a shape that changes
every step: they keep the torch step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.ir.errors import KilnError
from kiln.runtime.eagle_heads import activate, grouped, rms_norm, rotate

# backends whose lowering runs the step; others draft with the torch heads
COMPILING_BACKENDS = ("inductor",)


class DraftStepError(KilnError, RuntimeError):
    """The eagle step could not be captured or lowered (the torch heads draft instead)."""


class EagleStepModule(nn.Module):
    """One draft position of draft-context EagleHeads (compacted, fp32 weights), as plain ops
    that Kiln's frontend captures."""

    def __init__(self, heads):
        super().__init__()
        shape = heads.shape
        self.hidden, self.shape = heads.hidden, shape
        linears = {
            "fc": heads.fc,
            "qkv": heads.qkv,
            "o_proj": heads.o_proj,
            "gate_up": heads.gate_up,
            "down": heads.down,
        }
        for name, linear in linears.items():
            if not isinstance(linear, nn.Linear):
                raise DraftStepError(f"the eagle step captures fp32 heads, not {type(linear).__name__} {name}")
            copy = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
            copy.load_state_dict(linear.state_dict())
            setattr(self, name, copy.requires_grad_(False))
        self.post_attention_norm = nn.Parameter(heads.post_attention_norm.detach().clone(), requires_grad=False)
        self.final_norm = nn.Parameter(heads.final_norm.detach().clone(), requires_grad=False)
        self.readout = nn.Linear(heads.hidden, len(heads.vocab_ids), bias=False).requires_grad_(False)
        self.readout.weight.copy_(heads.head_weight(0).detach())

    def forward(self, states, embedded, keys, values, cos, sin, mask):
        shape = self.shape
        rows = states.shape[0]
        embedded = rms_norm(embedded, None, torch.finfo(torch.float32).eps, 0.0)
        x = self.fc(torch.cat((states, embedded), dim=-1))
        width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        qkv = self.qkv(x)
        q = qkv[:, :width].reshape(rows, shape.heads, 1, shape.head_dim)
        k = qkv[:, width : width + kv_width].reshape(rows, shape.kv_heads, 1, shape.head_dim)
        v = qkv[:, width + kv_width :].reshape(rows, shape.kv_heads, 1, shape.head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        all_k, all_v = torch.cat((keys, k), dim=2), torch.cat((values, v), dim=2)
        group = shape.heads // shape.kv_heads
        all_k, all_v = grouped(all_k, group), grouped(all_v, group)
        scores = torch.matmul(q, all_k.transpose(-1, -2)) * shape.scale + mask
        attended = torch.matmul(torch.softmax(scores, dim=-1), all_v)
        x = x + self.o_proj(attended.reshape(rows, width))
        normed = rms_norm(x, self.post_attention_norm, shape.eps, shape.norm_offset)
        gate, up = self.gate_up(normed).chunk(2, dim=-1)
        x = x + self.down(activate(gate, shape) * up)
        state = rms_norm(x, self.final_norm, shape.final_eps, shape.final_offset)
        return state, self.readout(state), k, v


@dataclass(frozen=True)
class StepOptions:
    """What the quantize phase reads from compile options."""

    quantize: str | None = "int8"
    quantize_embeddings: bool = False  # also the output projection: here the readout


def example_inputs(heads, rows: int) -> tuple[torch.Tensor, ...]:
    shape, earlier = heads.shape, heads.stages - 1
    half = shape.cos.shape[-1] if shape.cos is not None else 0
    kv = torch.zeros(rows, shape.kv_heads, earlier, shape.head_dim)
    return (
        torch.zeros(rows, heads.hidden),
        torch.zeros(rows, heads.hidden),
        kv,
        kv.clone(),
        torch.ones(1, half),
        torch.zeros(1, half),
        torch.zeros(1, 1, 1, earlier + 1),
    )


INPUTS = ["states", "embedded", "keys", "values", "cos", "sin", "mask"]
OUTPUTS = ["next_states", "logits", "key", "value"]


def capture_step(heads, rows: int, int8: bool = True):
    """The IR of one draft position over `rows` rows, after the fuse phase and (`int8`) the
    int8 weight scheme."""
    from kiln.frontend.capture import capture_module
    from kiln.passes.dce import eliminate_dead_code
    from kiln.passes.manager import PassManager
    from kiln.passes.pipeline import Pass, canonicalize, fold_constants, fusion_passes
    from kiln.passes.quantize_phase import quantization_passes

    if heads.stages < 2 or heads.shape.cos is None:
        raise DraftStepError("the eagle step is captured for heads of 2 or more stages with RoPE")
    graph = capture_module(EagleStepModule(heads), example_inputs(heads, rows), INPUTS, OUTPUTS)
    # the readout is the graph's output projection: quantized too (`quantize_embeddings`)
    options = StepOptions(quantize="int8" if int8 else None, quantize_embeddings=int8)
    phases = [
        (
            "canonicalize",
            [
                Pass("canonicalize", canonicalize),
                Pass("constant_fold", fold_constants),
                Pass("dce", eliminate_dead_code),
            ],
        ),
        ("fuse", fusion_passes()),
        ("quantize", quantization_passes(options)),
        ("cleanup", [Pass("dce", eliminate_dead_code)]),
    ]
    return PassManager(phases).run(graph)


def lower_step(graph, backend: str):
    """The step's graph lowered by `backend` (COMPILING_BACKENDS), a callable over its inputs."""
    if backend not in COMPILING_BACKENDS:
        raise DraftStepError(f"the {backend} backend does not lower the eagle step yet")
    from kiln.backends.inductor.stateless import lower_stateless

    return lower_stateless(graph)


class CompiledEagleStep:
    """Draft positions of draft-context EagleHeads run by the lowered step, `rows` rows at a
    time (fewer rows are padded with copies of the first, then dropped)."""

    def __init__(self, heads, rows: int, backend: str, int8: bool = True):
        self.rows, self.earlier, self.embedding = rows, heads.stages - 1, heads.embedding
        self.run = lower_step(capture_step(heads, rows, int8), backend)
        shape = heads.shape
        self.rope = [
            (shape.cos[i : i + 1].contiguous(), shape.sin[i : i + 1].contiguous()) for i in range(heads.stages)
        ]
        slots = torch.arange(heads.stages)
        # at position i the keys of slots 0 .. i-1 and its own (the last) are attended to
        self.masks = [
            torch.where((slots < i) | (slots == self.earlier), 0.0, float("-inf")).view(1, 1, 1, -1)
            for i in range(heads.stages)
        ]
        self.empty = torch.zeros(rows, shape.kv_heads, self.earlier, shape.head_dim)

    def advance(self, states, tokens, cache: list, level: int):
        """(next states, their logits) for states [r, hidden] and tokens [r] at draft position
        `level`; `cache` ([keys, values] of the earlier positions, [rows, kv_heads, stages - 1,
        head_dim] each; empty at level 0) gets this position's."""
        count = states.shape[0]
        if not cache:
            cache[:] = [self.empty.clone(), self.empty.clone()]
        states, embedded = _padded(states, self.rows), _padded(self.embedding[tokens], self.rows)
        cache[:] = [_padded(part, self.rows) for part in cache]
        cos, sin = self.rope[level]
        states, logits, key, value = self.run(states, embedded, *cache, cos, sin, self.masks[level])
        if level < self.earlier:
            cache[0][:, :, level] = key[:, :, 0]
            cache[1][:, :, level] = value[:, :, 0]
        return states[:count], logits[:count]


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with `rows` rows (copies of its first appended), contiguous."""
    if x.shape[0] < rows:
        x = torch.cat((x, x[:1].expand(rows - x.shape[0], *x.shape[1:])))
    return x.contiguous()
