"""The steps between a row of logits and the distribution a token is drawn from.

Each function takes logits [vocab] and returns new logits (never editing its input); filters
set the tokens they drop to -inf. The sampler applies them in this order, the order Hugging Face
uses: logit bias, penalties, the bans of min_tokens and bad_words, temperature, then the
truncation filters top-k, top-p, min-p, typical, eta. Every filter keeps at least the most
likely token (bans are the caller's word and drop what they name).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import torch

NEG_INF = float("-inf")


def add_logit_bias(logits: torch.Tensor, bias: Mapping[int, float]) -> torch.Tensor:
    """logits[t] += bias[t] (OpenAI's logit_bias: -100 all but bans a token, +100 all but forces it)."""
    if not bias:
        return logits
    logits = logits.clone()
    ids = torch.tensor(list(bias), dtype=torch.long)
    logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)
    return logits


def repetition_penalty(logits: torch.Tensor, seen: Iterable[int], penalty: float) -> torch.Tensor:
    """CTRL's penalty on every token already in the context (prompt and output): a positive
    logit is divided by `penalty`, a negative one multiplied, so the token always gets less likely."""
    if penalty == 1.0:
        return logits
    ids = sorted(set(seen))
    if not ids:
        return logits
    logits = logits.clone()
    index = torch.tensor(ids, dtype=torch.long)
    picked = logits[index]
    logits[index] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def presence_frequency_penalty(
    logits: torch.Tensor, generated: Iterable[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's penalties over the tokens generated so far: logits[t] -= presence * [count > 0]
    + frequency * count."""
    if presence == 0.0 and frequency == 0.0:
        return logits
    counts = Counter(generated)
    if not counts:
        return logits
    logits = logits.clone()
    index = torch.tensor(list(counts), dtype=torch.long)
    amount = torch.tensor(list(counts.values()), dtype=logits.dtype)
    logits[index] -= presence + frequency * amount
    return logits


def ban_tokens(scores: torch.Tensor, tokens: Iterable[int]) -> torch.Tensor:
    """scores[t] = -inf for each token t (ids beyond the vocabulary can never come anyway)."""
    ids = sorted(t for t in tokens if t < scores.numel())
    if not ids:
        return scores
    scores = scores.clone()
    scores[torch.tensor(ids, dtype=torch.long)] = NEG_INF
    return scores


def bad_word_bans(sequences: Sequence[tuple[int, ...]], prompt: Sequence[int], generated: Sequence[int]) -> set[int]:
    """The last token of each banned sequence whose other tokens end the context (prompt, then
    generated): what would complete it next. Only the context's tail is read."""
    longest = max(len(s) for s in sequences) - 1
    tail = list(generated[-longest:]) if longest else []
    if len(tail) < longest:
        tail = list(prompt[max(0, len(prompt) - (longest - len(tail))) :]) + tail
    banned = set()
    for sequence in sequences:
        before = len(sequence) - 1
        if before == 0 or (before <= len(tail) and tuple(tail[len(tail) - before :]) == sequence[:-1]):
            banned.add(sequence[-1])
    return banned


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k most likely tokens (0 keeps all)."""
    if not 0 < k < logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: the smallest set of most likely tokens whose probability mass reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
    drop = torch.zeros_like(logits, dtype=torch.bool)
    drop[order] = mass_before >= p
    drop[order[0]] = False  # p is compared in float32, where e.g. 1e-300 is 0 and would drop every token
    return logits.masked_fill(drop, NEG_INF)


def min_p(logits: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep tokens at least `fraction` times as likely as the most likely one."""
    if fraction <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < fraction * probs.max(), NEG_INF)


def typical(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al.): rank tokens by how far their surprisal -log p
    is from the entropy, and keep the closest ones until their mass reaches `mass`."""
    if mass >= 1.0:
        return logits
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs.nan_to_num(0.0)).sum()
    distance = (-log_probs - entropy).abs()
    order = torch.argsort(distance)
    mass_before = torch.cumsum(probs[order], dim=-1) - probs[order]
    drop = torch.zeros_like(logits, dtype=torch.bool)
    drop[order] = mass_before >= mass
    drop[order[0]] = False  # as in top_p: a tiny mass must not drop every token
    return logits.masked_fill(drop, NEG_INF)


def eta(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Eta sampling (Hewitt et al.): drop tokens below eta = min(epsilon, sqrt(epsilon) * exp(-H)),
    a cut-off that loosens as the distribution gets flatter (higher entropy H)."""
    if epsilon <= 0.0:
        return logits
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs.nan_to_num(0.0)).sum()
    cutoff = min(epsilon, (epsilon**0.5) * float(torch.exp(-entropy)))
    drop = probs < cutoff
    drop[torch.argmax(logits)] = False
    return logits.masked_fill(drop, NEG_INF)
