"""`eagle` draft heads: one decoder layer of the model's own shape that predicts the next hidden state.

As EAGLE (Li et al. 2024) drafts: the input at each draft position is
fc(concat(hidden state h_t, embedding of token t+1)), one decoder layer (attention with the
model's heads, RoPE tables and attention scale, then its gated MLP and activation, RMSNorm
between) turns it into the next hidden state, and the model's own final norm and lm_head
(frozen, the draft vocabulary's rows) read it out. Drafting is autoregressive on the layer's own
predicted states: position i feeds (predicted h_{p+i}, the token drafted at i-1).

The hidden states are the ones the lm_head reads (last_hidden.py solves them from the logits,
after the final norm): the same states EAGLE-1 trains on (Hugging Face's last `hidden_states`
entry is normalized). The layer's output goes through the model's final norm, so its prediction
has the scale of the states it regresses to, and feeds back in as one.

What the layer attends over (`context`):
- "whole" (EAGLE's own design): every earlier position of the sequence. Position t's input is
  fc(h_t, emb(x_{t+1})) from the target's real state; a request's drafter keeps those keys and
  values (one layer's: tiny) in a draft cache extended after each verification with the accepted
  positions' states (eagle_context.py), and drafts on top of it with its own predicted states.
  Training (kiln/eagle_sequence_trainer.py) runs whole sequences through it at once, causally,
  teacher forced, and unrolls `stages - 1` steps on the layer's own states on top (the keys of
  the positions a draft made itself are the draft's, as at drafting time);
- "draft" (the first form): the draft's own positions only (the chain being drafted, at most
  `stages` long), seeded by the target's state h_p. Training (kiln/speculator_trainer.py) unrolls
  the same autoregression over `stages` positions from sampled positions.
Either way the loss is EAGLE's: smooth L1 from each predicted state to the target's plus a
weighted cross-entropy of its readout against the model's greedy token. The layer's keys and
values depend on one position's input alone (a single layer), so each position adds one row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from kiln.runtime.draft_tree import DraftTree
from kiln.runtime.last_hidden import OutputHead, SpeculatorError
from kiln.runtime.speculator_heads import DraftHeads, _pick

REGRESSION_WEIGHT, TOKEN_WEIGHT = 1.0, 0.1  # EAGLE's weights of the state and token losses
CONTEXTS = ("whole", "draft")
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


@dataclass(frozen=True)
class LayerShape:
    """What the draft layer copies from the model's graph."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    activation: str  # silu | gelu
    gelu_approximate: str
    eps: float  # the layers' RMSNorm
    norm_offset: float  # Gemma's norms scale by (1 + weight)
    scale: float  # attention's
    final_norm: torch.Tensor  # the model's, before its lm_head
    final_eps: float
    final_offset: float
    cos: torch.Tensor | None  # the model's RoPE tables' first rows ([rows, half]; None: no RoPE)
    sin: torch.Tensor | None


def layer_shape(graph, rows: int | None) -> LayerShape:
    """The model's decoder layer as `graph` computes it (RoPE tables: the first `rows`, None:
    all); SpeculatorError when it is not a
    pre-norm RMSNorm transformer whose lm_head reads an RMSNorm."""
    model = graph.meta.get("model", {})
    nodes = list(graph.nodes)
    norm = _final_norm(graph)
    first = {op: next((n for n in nodes if n.op == op), None) for op in ("rms_norm", "add_rms_norm", "attention")}
    activation = next((n for n in nodes if n.op in ACTIVATIONS), None)
    layer_norm = first["rms_norm"] or first["add_rms_norm"]
    sizes = ("num_heads", "num_kv_heads", "head_dim")
    if (
        norm is None
        or activation is None
        or first["attention"] is None
        or layer_norm is None
        or not all(isinstance(model.get(size), int) for size in sizes)
    ):
        raise SpeculatorError(
            "eagle heads copy a pre-norm decoder layer (RMSNorm, attention, a SiLU or GELU MLP) "
            "and read out through the model's final RMSNorm, with the attention's sizes in the "
            "graph's metadata; this graph lacks one of them. "
            "Fix: train --kind mlp or --kind medusa heads for this model."
        )
    rope = next((n for n in nodes if n.op == "rope"), None)
    cos = sin = None
    if rope is not None:
        cos, sin = (graph.weights[v.name][:rows].float() for v in rope.inputs[2:4])
    head_dim = int(model["head_dim"])
    scale = first["attention"].attrs.get("scale")
    final_weight = graph.weights[norm.inputs[-1].name].float()
    return LayerShape(
        heads=int(model["num_heads"]),
        kv_heads=int(model["num_kv_heads"]),
        head_dim=head_dim,
        intermediate=int(activation.outputs[0].type.shape[-1]),
        activation=activation.op,
        gelu_approximate=activation.attrs.get("approximate", "none"),
        eps=float(layer_norm.attrs["eps"]),
        norm_offset=float(layer_norm.attrs.get("offset", 0.0)),
        scale=float(scale) if scale is not None else head_dim**-0.5,
        final_norm=final_weight,
        final_eps=float(norm.attrs["eps"]),
        final_offset=float(norm.attrs.get("offset", 0.0)),
        cos=cos,
        sin=sin,
    )


def _final_norm(graph):
    """The rms_norm / add_rms_norm node whose (first) output the lm_head's linear reads."""
    logits = graph.outputs[0]
    head = next((n for n in graph.nodes if logits in n.outputs), None)
    state = head.inputs[0] if head is not None else None
    norm = state.producer if state is not None else None
    if norm is None or norm.op not in ("rms_norm", "add_rms_norm") or norm.outputs[0] is not state:
        return None
    return norm if norm.inputs[-1] is not None else None


class EagleHeads(DraftHeads):
    kind = "eagle"

    def __init__(
        self, model_head: OutputHead, stages: int, vocab_ids: torch.Tensor, head: str = "tied", context: str = "draft"
    ):
        if context not in CONTEXTS:
            raise SpeculatorError(
                f"eagle heads attend over one of {list(CONTEXTS)}, not {context!r}. Fix: --context whole."
            )
        if head != "tied":
            raise SpeculatorError(
                f"eagle heads read out through the model's own lm_head, not {head!r} heads. Fix: --head tied."
            )
        if model_head.graph is None:
            raise SpeculatorError("eagle heads need the model's graph to copy its layer. Fix: pass output_head(graph).")
        super().__init__(model_head, stages, vocab_ids, head)
        self.context = context
        shape = self.shape = layer_shape(model_head.graph, stages if context == "draft" else None)
        hidden, width, kv_width = self.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.register_buffer("embedding", model_head.embedding.detach(), persistent=False)
        self.register_buffer("final_norm", shape.final_norm, persistent=False)
        self.fc = nn.Linear(2 * hidden, hidden)
        self.qkv = nn.Linear(hidden, width + 2 * kv_width, bias=False)
        self.o_proj = nn.Linear(width, hidden, bias=False)
        self.post_attention_norm = nn.Parameter(torch.full((hidden,), 1.0 - shape.norm_offset))
        self.gate_up = nn.Linear(hidden, 2 * shape.intermediate, bias=False)
        self.down = nn.Linear(shape.intermediate, hidden, bias=False)
        self.compiled_step = None  # eagle_step.CompiledEagleStep: draft positions run by a backend

    def advance(self, states, tokens, cache: list, level: int, context=None, start: int = 0):
        """(the predicted states [r, hidden], their logits over the draft vocabulary) at draft
        position `level` from states [r, hidden] and the tokens [r] after them; `cache` (empty
        at level 0) holds the draft's earlier keys and values and gets this position's. The
        compiled step runs it where there is one and the draft's positions are all it attends
        over; else the torch layer (`_step`, over `context` and from `start` for "whole" heads)."""
        if self.compiled_step is not None and context is None:
            return self.compiled_step.advance(states, tokens, cache, level)
        states = self._step(self._input(states, tokens), cache, context, start)
        return states, self.logits(0, states)

    # -- one draft position ------------------------------------------------------------------
    def _input(self, state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        embedded = F.rms_norm(self.embedding[token], (self.hidden,))  # the model's scale differs from the state's
        return self.fc(torch.cat((state, embedded), dim=-1))

    def _rope(self, x: torch.Tensor, positions) -> torch.Tensor:
        """x [..., n, dim] rotated at `positions` (an int, or n of them)."""
        if self.shape.cos is None:
            return x
        return rotate(x, self.shape.cos[positions], self.shape.sin[positions])

    def _project(self, x: torch.Tensor, positions):
        """Queries [b, heads, n, dim], keys and values [b, kv_heads, n, dim] of inputs x [b, n, hidden]."""
        shape = self.shape
        q, k, v = self.qkv(x).split([shape.heads * shape.head_dim, *2 * [shape.kv_heads * shape.head_dim]], dim=-1)
        b, n = x.shape[:2]
        q = self._rope(q.view(b, n, shape.heads, shape.head_dim).transpose(1, 2), positions)
        k = self._rope(k.view(b, n, shape.kv_heads, shape.head_dim).transpose(1, 2), positions)
        return q, k, v.view(b, n, shape.kv_heads, shape.head_dim).transpose(1, 2)

    def _grouped(self, kv: torch.Tensor) -> torch.Tensor:
        return grouped(kv, self.shape.heads // self.shape.kv_heads)

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention (attended [b, heads, n, dim]) for inputs x
        [b, n, hidden]; returns the predicted states after the model's final norm."""
        shape = self.shape
        x = x + self.o_proj(attended.transpose(1, 2).reshape(*x.shape[:2], -1))
        normed = rms_norm(x, self.post_attention_norm, shape.eps, shape.norm_offset)
        gate, up = self.gate_up(normed).chunk(2, dim=-1)
        x = x + self.down(self._activate(gate) * up)
        return rms_norm(x, self.final_norm, shape.final_eps, shape.final_offset)

    def _step(self, x: torch.Tensor, cache: list[torch.Tensor], context=None, start: int = 0) -> torch.Tensor:
        """The layer at the next draft position for inputs x [b, hidden], attending over the
        earlier draft positions' keys and values in `cache` ([k, v], each [b, kv_heads, i,
        head_dim], grown here) and, for "whole" context heads, the context's (`context`: an
        eagle_context.DraftCache; `start`: the draft's first position); returns the predicted
        state after the model's final norm."""
        position = start + (cache[0].shape[2] if cache else 0)
        q, k, v = self._project(x[:, None], position)
        if cache:
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
        cache[:] = [k, v]
        if context is not None and context.length:
            rows = x.shape[0]
            k = torch.cat((context.keys.expand(rows, -1, -1, -1), k), dim=2)
            v = torch.cat((context.values.expand(rows, -1, -1, -1), v), dim=2)
        attended = F.scaled_dot_product_attention(q, self._grouped(k), self._grouped(v), scale=self.shape.scale)
        return self._finish(x[:, None], attended)[:, 0]

    def _activate(self, x: torch.Tensor) -> torch.Tensor:
        return activate(x, self.shape)

    # -- teacher-forced tokens, own states (training, evaluation) -----------------------------
    def states(self, hidden: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """The predicted states [batch, hidden] per stage: stage i reads t_{p+1+i} (teacher
        forced) and the state stage i-1 predicted (stage 0: h_p)."""
        state, cache, out = hidden, [], []
        for stage in range(self.stages):
            state = self._step(self._input(state, tokens[:, stage]), cache)
            out.append(state)
        return out

    def forward(self, hidden, tokens):
        return [self.logits(0, state) for state in self.states(hidden, tokens)]

    def training_outputs(self, hidden, tokens, next_hidden):
        states = self.states(hidden, tokens)
        regression = sum(F.smooth_l1_loss(state, next_hidden[:, i]) for i, state in enumerate(states))
        return [self.logits(0, state) for state in states], REGRESSION_WEIGHT * regression, TOKEN_WEIGHT

    # -- whole sequences: teacher-forced tokens, the target's states, then own states -------------
    def sequence_states(self, hidden: torch.Tensor, tokens: torch.Tensor, noise: float = 0.0) -> list[torch.Tensor]:
        """The predicted states [b, n, hidden] per stage over whole sequences: hidden [b, n,
        hidden] are the target's h_0 .. h_{n-1}, tokens [b, n] the tokens after them x_1 .. x_n.
        Stage j's row t is what a draft started at position t - j predicts at its stage j
        (h_{t+1}): its input carries the layer's own state from stage j-1 at t - 1, and it
        attends over the real positions up to t - j and the draft's own ones after them.
        `noise` (training): uniform noise of that size relative to each state's RMS on the real
        states fed in, as EAGLE trains (it makes the layer robust to its own states' errors)."""
        length = hidden.shape[1]
        positions = torch.arange(length)
        if noise > 0:
            scale = hidden.pow(2).mean(-1, keepdim=True).sqrt()
            hidden = hidden + noise * scale * (2 * torch.rand_like(hidden) - 1)
        embedded = F.rms_norm(self.embedding[tokens], (self.hidden,))
        x = self.fc(torch.cat((hidden, embedded), dim=-1))
        q, real_k, real_v = self._project(x, positions)
        causal = positions[None, :] <= positions[:, None]
        state = self._finish(x, self._masked_attention(q, real_k, real_v, causal, [], []))
        out, own_k, own_v = [state], [], []
        for stage in range(1, self.stages):
            previous = torch.cat((torch.zeros_like(state[:, :1]), state[:, :-1]), dim=1)
            x = self.fc(torch.cat((previous, embedded), dim=-1))
            q, k, v = self._project(x, positions)
            own_k.append(k)
            own_v.append(v)
            real = positions[None, :] <= positions[:, None] - stage
            # the draft's own position i (1..stage) of the draft ending at t sits at t - stage + i
            shifts = [stage - i for i in range(1, stage + 1)]
            state = self._finish(x, self._masked_attention(q, real_k, real_v, real, own_k, own_v, shifts))
            out.append(state)
        return out

    def _masked_attention(self, q, keys, values, mask, own_k, own_v, shifts=()) -> torch.Tensor:
        """Attention of queries q [b, heads, n, dim] over `keys`/`values` where `mask` [n, n]
        allows, and over one key of each own_k[i] each: row t's at t - shifts[i] (if >= 0)."""
        scores = (q @ self._grouped(keys).transpose(-1, -2)) * self.shape.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        own_values = []
        for k, v, shift in zip(own_k, own_v, shifts):
            k, v = _shifted(self._grouped(k), shift), _shifted(self._grouped(v), shift)
            score = (q * k).sum(-1, keepdim=True) * self.shape.scale
            valid = torch.arange(q.shape[2]) >= shift
            scores = torch.cat((scores, score.masked_fill(~valid[:, None], float("-inf"))), dim=-1)
            own_values.append(v)
        weights = torch.softmax(scores, dim=-1)
        length = keys.shape[2]
        attended = weights[..., :length] @ self._grouped(values)
        for i, v in enumerate(own_values):
            attended = attended + weights[..., length + i : length + i + 1] * v
        return attended

    # -- drafting -------------------------------------------------------------------------------
    def _chain(self, hidden, token, count, min_confidence=0.0, context=None):
        """(greedy draft ids, stage 0's logits) for one sequence (over `context`'s cache, if any)."""
        state, cache, current = hidden[None], [], torch.tensor([token])
        drafted, confidence, first = [], 1.0, None
        start = context.end if context is not None else 0
        for level in range(min(count, self.stages)):
            state, logits = self.advance(state, current, cache, level, context, start)
            logits = logits[0]
            first = logits if first is None else first
            pick, confidence = _pick(logits, confidence, min_confidence)
            if pick is None:
                break
            current = self.vocab_ids[pick : pick + 1]
            drafted.append(int(current))
        return drafted, first

    @torch.inference_mode()
    def draft(self, hidden, token, count, min_confidence=0.0, context=None):
        return self._chain(hidden, token, count, min_confidence, context)[0]

    @torch.inference_mode()
    def first_logits(self, hidden, token):
        return self.logits(0, self._step(self._input(hidden[None], torch.tensor([token])), [])[0])

    @torch.inference_mode()
    def draft_tree(self, hidden, token, count, alternatives=2, min_confidence=0.0, context=None) -> DraftTree:
        """The greedy chain and stage 0's runners-up as leaves (as DraftHeads.draft_tree), the
        chain's first step computed once."""
        chain, first = self._chain(hidden, token, count, min_confidence, context)
        if not chain or alternatives <= 0:
            return DraftTree.chain(chain)
        ranked = first.topk(min(alternatives + 1, len(self.vocab_ids))).indices
        others = [[int(self.vocab_ids[i])] for i in ranked if int(self.vocab_ids[i]) != chain[0]][:alternatives]
        return DraftTree.of_continuations([chain, *others], max_nodes=len(chain) + alternatives)

    @torch.inference_mode()
    def chains(self, hidden, tokens):
        state, cache, current, out = hidden, [], tokens, []
        for _ in range(self.stages):
            state = self._step(self._input(state, current), cache)
            current = self.vocab_ids[self.logits(0, state).argmax(-1)]
            out.append(current)
        return torch.stack(out, dim=1)


def _shifted(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [..., n, dim] moved `by` rows later along n (row t holds row t - by; zeros first)."""
    if by == 0:
        return x
    return torch.cat((torch.zeros_like(x[..., :by, :]), x[..., :-by, :]), dim=-2)


# The layer's pieces as plain ops, shared with its compiled step (eagle_step.py), which Kiln's
# frontend captures.
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed if weight is None else normed * (weight + offset)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [..., dim] with cos and sin rows [..., half] (dims past 2 * half unrotated)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def grouped(kv: torch.Tensor, group: int) -> torch.Tensor:
    """kv [b, kv_heads, n, dim] with each kv head repeated for its `group` query heads."""
    if group == 1:
        return kv
    rows, heads, length, dim = kv.shape
    return kv[:, :, None].expand(rows, heads, group, length, dim).reshape(rows, heads * group, length, dim)


def activate(x: torch.Tensor, shape: LayerShape) -> torch.Tensor:
    if shape.activation == "gelu":
        return F.gelu(x, approximate=shape.gelu_approximate)
    return F.silu(x)
