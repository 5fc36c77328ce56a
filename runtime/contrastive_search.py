"""Contrastive search (Su et al. 2022, "A Contrastive Framework for Neural Text Generation").

    llm.generate(prompt, penalty_alpha=0.6, top_k=4)

Each step takes the top_k most likely next tokens as candidates (after logit bias, penalties and
bans, as greedy decoding sees them) and picks

    argmax over candidates v of  (1 - alpha) * p(v) - alpha * max_j cos(h_v, h_j)

where h_v is the model's last hidden state (what its lm_head reads) at the candidate and h_j
that of each earlier token of the context, prompt and output: the degeneration penalty, which
keeps the output from repeating itself. alpha = 0 is greedy decoding.

The top_k candidates run as one decode call over KV rows 0 .. top_k-1, each row holding the
context (the prompt, prefilled once into row 0, is copied to the others); that call gives every
candidate's hidden state and, for the one chosen, the logits of the next step. The chosen
candidate's keys and values are then copied into the other rows' slot (one slot per row per
step). Every chosen token is fed, so a prompt of L tokens gets at most max_seq_len - L new ones.

Hidden states: the executables return logits only; when the graph ends in the lm_head's
linear, the logits are an exact linear image of the hidden state and last_hidden.py solves
for it (over every vocabulary row). Soft-capped logits (Gemma 2 and 3: cap * tanh(z / cap))
are first mapped back to z = cap * atanh(logits / cap). A quantized lm_head is refused.
"""

from __future__ import annotations

import time
import weakref
from types import SimpleNamespace

import torch

from kiln.backends.cache_rows import copy_prefix, copy_slots
from kiln.runtime.errors import GenerationError
from kiln.runtime.last_hidden import HiddenFromLogits, SpeculatorError, output_head
from kiln.runtime.request import GenerationSettings, Request
from kiln.runtime.results import GenerationResult
from kiln.runtime.row_prefill import prefill_row0
from kiln.runtime.token_ids import check_request_ids, model_vocab_size

_SOLVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> HiddenStates


class HiddenStates:
    """Logits [..., vocab] -> the last hidden states [..., hidden] they were computed from."""

    def __init__(self, solve: HiddenFromLogits, cap: float | None):
        self.solve, self.cap = solve, cap

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.cap is not None:  # logits = cap * tanh(z / cap); clamped off +-cap, where atanh is infinite
            bound = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
            logits = self.cap * torch.atanh((logits / self.cap).clamp(-bound, bound))
        return self.solve(logits)


def hidden_solver(graph) -> HiddenStates:
    """The map from logits to the last hidden state, for this graph (made once)."""
    if graph is None:
        raise GenerationError(
            "Contrastive search reads hidden states through the artifact's graph. Fix: load the "
            "model with kiln.load (an LLM built from an executable alone has no graph)."
        )
    if graph not in _SOLVERS:
        linear_out, cap = _soft_cap(graph)
        try:
            head = output_head(SimpleNamespace(outputs=[linear_out], nodes=graph.nodes, weights=graph.weights))
        except SpeculatorError as error:
            raise GenerationError(
                f"Contrastive search cannot read this model's hidden states: {error} "
                "(For contrastive search: use greedy decoding or beam search instead.)"
            ) from None
        _SOLVERS[graph] = HiddenStates(HiddenFromLogits(head, torch.arange(head.weight.shape[0])), cap)
    return _SOLVERS[graph]


def _soft_cap(graph):
    """(the value the lm_head's linear produces, the soft cap) when the logits are
    mul(tanh(div(z, cap)), cap) with a constant cap; else (the logits, None)."""
    producers = {out.name: node for node in graph.nodes for out in node.outputs}
    logits = graph.outputs[0]

    def made_by(value, op):
        node = producers.get(getattr(value, "name", None))
        return node if node is not None and node.op == op else None

    scale = made_by(logits, "mul")
    tanh = scale and made_by(scale.inputs[0], "tanh")
    divide = tanh and made_by(tanh.inputs[0], "div")
    cap = divide and made_by(divide.inputs[1], "full")
    if cap is None or scale.inputs[1].name != divide.inputs[1].name or cap.attrs.get("shape") != ():
        return logits, None
    return divide.inputs[0], float(cap.attrs["value"])


def degeneration_penalty(context: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """For each candidate hidden state [k, hidden], its largest cosine similarity to the context's [n, hidden]."""
    context = context / context.norm(dim=-1, keepdim=True)
    candidates = candidates / candidates.norm(dim=-1, keepdim=True)
    return (candidates @ context.T).max(dim=-1).values


class ContrastiveSearch:
    """One prompt's contrastive search. Iterate for (0, text piece) pairs, then read
    `results()`; the interface of EngineBatch, for one prompt."""

    prompt_count = 1

    def __init__(
        self,
        executable,
        prompt: list[int],
        settings: GenerationSettings,
        seed: int,
        alpha: float,
        to_hidden: HiddenFromLogits,
        decoder_factory=None,
        vocab_size: int | None = None,
    ):
        check_request_ids(prompt, settings, vocab_size or model_vocab_size(executable))
        self.executable, self.alpha, self.to_hidden = executable, alpha, to_hidden
        self.top_k = settings.sampling.top_k
        # every chosen token is fed (its hidden state joins the context): one slot fewer than plain decoding
        self.request = Request(
            list(prompt),
            settings,
            seed,
            executable.options.max_seq_len - 1,
            decoder_factory() if decoder_factory else None,
        )

    def __iter__(self):
        request = self.request
        if not request.generating:
            return
        start = time.perf_counter()
        prompt = request.prompt
        states: list[torch.Tensor] = []  # the prompt's hidden states, a chunk at a time
        next_logits = prefill_row0(self.executable, prompt, lambda logits: states.append(self.to_hidden(logits)))
        context = torch.cat(states)  # [prompt, hidden]
        views = self.executable.cache_views()
        for row in range(1, self.top_k):
            copy_prefix(views, 0, row, len(prompt))
        request.prefill_s = time.perf_counter() - start
        request.model_steps += 1
        while request.generating:
            start = time.perf_counter()
            next_logits, chosen_hidden, piece = self._step(next_logits, context, views)
            context = torch.cat((context, chosen_hidden[None]))
            request.decode_s += time.perf_counter() - start
            request.ttft_s = request.ttft_s or request.prefill_s + request.decode_s
            if piece:
                yield 0, piece

    def _step(self, logits: torch.Tensor, context: torch.Tensor, views) -> tuple[torch.Tensor, torch.Tensor, str]:
        """Run the candidates after `logits`, push the chosen one; (its logits, its hidden state, its text)."""
        request = self.request
        sampler = request.sampler
        probs = torch.softmax(sampler.process(logits, request.prompt, request.tokens), dim=-1)
        top_probs, top_ids = torch.topk(probs, self.top_k)
        position = len(request.prompt) + len(request.tokens)
        out = self.executable.run(top_ids[:, None], torch.full((self.top_k, 1), position))[:, 0].float().cpu()
        hidden = self.to_hidden(out)  # [top_k, hidden]
        scores = (1.0 - self.alpha) * top_probs - self.alpha * degeneration_penalty(context, hidden)
        choice = int(torch.argmax(scores))
        request.model_steps += 1
        piece = request.push(sampler._with_logprobs(logits, int(top_ids[choice])))
        for row in range(self.top_k):  # every row's slot at `position` takes the chosen token's keys and values
            copy_slots(views, choice, row, position, position + 1)
        return out[choice], hidden[choice], piece

    def results(self) -> list[GenerationResult]:
        return [self.request.result()]
