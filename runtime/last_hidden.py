"""The target model's last hidden state, recovered from its logits.

Draft heads (speculator_heads.py) read the hidden state the lm_head turned into the newest
token's logits. The compiled executables return logits only, and every backend lowers that
signature, so instead of a second output the state is solved for: when the graph ends in
`logits = linear(h, W, b)`, the logits are an exact linear image of h (W is [vocab, hidden],
vocab >> hidden, full column rank), so any `rows` of them with a well-conditioned W[rows] give
h = pinv(W[rows]) @ (logits[rows] - b[rows]). With 2 x hidden rows this costs one
[hidden, 2 x hidden] matrix-vector product per target step (SmolLM2-135M: 2.7 MB of weights,
against the lm_head's 113 MB); training collects its states the same way, so the heads see the
same numbers at training and at drafting time.

Graphs whose logits are not a linear function of h (soft-capped logits, a quantized lm_head)
are refused with a SpeculatorError naming why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir.errors import KilnError


class SpeculatorError(KilnError):
    """Draft heads cannot be trained for, or used with, this artifact as asked."""


@dataclass
class OutputHead:
    """The graph's lm_head (`logits = h @ weight.T + bias`) and its token embedding table."""

    weight: torch.Tensor  # [vocab, hidden]
    bias: torch.Tensor | None
    embedding: torch.Tensor  # [vocab, hidden]
    graph: object = None  # the graph they come from (eagle heads copy its decoder layer)


def output_head(graph) -> OutputHead:
    """Find the lm_head linear that produces the graph's logits, and the embedding table."""
    logits = graph.outputs[0]
    producer = next((node for node in graph.nodes if logits in node.outputs), None)
    if producer is None or producer.op != "linear":
        found = producer.op if producer is not None else "no node"
        raise SpeculatorError(
            f"The graph's logits come from {found!r}, not from the lm_head's linear (e.g. "
            "soft-capped logits), so the last hidden state cannot be read from them. "
            "Fix: use prompt lookup or a draft model for this model."
        )
    weight = _float_param(graph, producer.inputs[1], "lm_head")
    bias = (
        _float_param(graph, producer.inputs[2], "lm_head bias")
        if len(producer.inputs) > 2 and producer.inputs[2] is not None
        else None
    )
    lookup = next((node for node in graph.nodes if node.op == "embedding"), None)
    if lookup is None:
        raise SpeculatorError(
            "The graph has no embedding op to read token embeddings from. "
            "Fix: use prompt lookup or a draft model for this model."
        )
    embedding = _float_param(graph, lookup.inputs[0], "token embedding")
    return OutputHead(weight, bias, embedding, graph)


def _float_param(graph, value, what: str) -> torch.Tensor:
    tensor = graph.weights.get(value.name) if value is not None else None
    if tensor is None or not tensor.is_floating_point():
        raise SpeculatorError(
            f"The {what} of this artifact is not a plain float parameter (quantized?). "
            "Fix: train heads on an artifact compiled without --quantize-embeddings."
        )
    return tensor.float()


class HiddenFromLogits:
    """Solves logits = W h + b for h, from the logits at `rows`."""

    def __init__(self, head: OutputHead, rows: torch.Tensor):
        self.rows = rows.long()
        sub = head.weight[self.rows].double()
        self.solve = torch.linalg.pinv(sub).float().contiguous()  # [hidden, rows]
        self.offset = head.bias[self.rows] if head.bias is not None else None

    @classmethod
    def for_head(cls, head: OutputHead, candidates: torch.Tensor) -> HiddenFromLogits:
        """Rows among `candidates` (token ids, most useful first: e.g. the most frequent tokens,
        whose rows are well trained): the first 2 x hidden of them."""
        hidden = head.weight.shape[1]
        rows = candidates[: 2 * hidden]
        if len(rows) < hidden:
            raise SpeculatorError(
                f"{len(rows)} rows cannot determine a {hidden}-wide hidden state. "
                f"Fix: keep at least {hidden} tokens in the draft vocabulary."
            )
        return cls(head, rows)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., hidden] for logits [..., vocab]."""
        picked = logits[..., self.rows].float()
        if self.offset is not None:
            picked = picked - self.offset
        return picked @ self.solve.T

    def relative_error(self, head: OutputHead, logits: torch.Tensor) -> float:
        """How far W h + b is from the given logits (all rows): ~1e-6 when the graph ends in its lm_head."""
        hidden = self(logits)
        rebuilt = hidden @ head.weight.T + (head.bias if head.bias is not None else 0)
        return float((rebuilt - logits.float()).norm() / logits.float().norm().clamp_min(1e-12))
