"""How far a model's next-token distributions are from a reference model's, token by token.

    result = kiln.quality("int4.kiln", reference="f32.kiln", text=Path("book.txt"))
    print(result.summary())        # mean/median/p99 KLD, delta-p, same top token, perplexity ratio

Perplexity hides errors that cancel out; these measures do not (llama.cpp's
`llama-perplexity --kl-divergence` reports the same ones, defined the same way):

- KLD: KL(reference || model) of the next-token distribution at each scored position (nats).
- delta-p: the model's probability of the token that actually follows minus the reference's.
- same top token: how often the model's most likely token is the reference's.
- perplexity of each over the scored tokens, and their ratio.

`compare(executable, reference_logits)` scores against a stored reference (top-k + the rest's
mass, see reference_logits.py); `compare_executables(a, b, windows)` runs both and, by default,
compares full distributions (exact): it is the check of a backend or a pass against the
interpreter. `quality()` works on artifacts and caches the reference's run under
$KILN_CACHE/quality, so a reference is run once per text.
"""

from __future__ import annotations

import gc
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.runtime.reference_logits import (
    DEFAULT_TOP_K,
    QualityError,
    ReferenceLogits,
    cache_key,
    check_windows,
    default_first,
    log_rest,
    reference_logits,
    scored_log_probs,
)


@dataclass(frozen=True)
class QualityResult:
    kld: torch.Tensor  # [tokens] f64, per scored token
    delta_p: torch.Tensor  # [tokens] f64: p_model(next) - p_reference(next)
    same_top: torch.Tensor  # [tokens] bool
    nll: torch.Tensor  # [tokens] f64: the model's negative log-likelihood of the next token
    reference_nll: torch.Tensor  # [tokens] f64
    windows: int
    length: int
    first: int
    top_k: int | None  # None: full distributions (exact KLD)

    @property
    def tokens(self) -> int:
        return len(self.kld)

    @property
    def mean_kld(self) -> float:
        return self.kld.mean().item()

    @property
    def kld_stderr(self) -> float:
        return (self.kld.std() / math.sqrt(self.tokens)).item() if self.tokens > 1 else 0.0

    @property
    def median_kld(self) -> float:
        return torch.quantile(self.kld, 0.5).item()

    @property
    def p99_kld(self) -> float:
        return torch.quantile(self.kld, 0.99).item()

    @property
    def max_kld(self) -> float:
        return self.kld.max().item()

    @property
    def delta_p_mean(self) -> float:
        return self.delta_p.mean().item()

    @property
    def delta_p_rms(self) -> float:
        return self.delta_p.square().mean().sqrt().item()

    @property
    def same_top_rate(self) -> float:
        return self.same_top.double().mean().item()

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.mean().item())

    @property
    def reference_perplexity(self) -> float:
        return math.exp(self.reference_nll.mean().item())

    @property
    def perplexity_ratio(self) -> float:
        return math.exp((self.nll - self.reference_nll).mean().item())

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "windows": self.windows,
            "length": self.length,
            "first": self.first,
            "top_k": self.top_k,
            "mean_kld": self.mean_kld,
            "kld_stderr": self.kld_stderr,
            "median_kld": self.median_kld,
            "p99_kld": self.p99_kld,
            "max_kld": self.max_kld,
            "delta_p_mean": self.delta_p_mean,
            "delta_p_rms": self.delta_p_rms,
            "same_top_rate": self.same_top_rate,
            "perplexity": self.perplexity,
            "reference_perplexity": self.reference_perplexity,
            "perplexity_ratio": self.perplexity_ratio,
        }

    def summary(self) -> str:
        how = "full distributions" if self.top_k is None else f"reference top-{self.top_k} + rest"
        return "\n".join(
            [
                f"tokens scored     {self.tokens} ({self.windows} windows of {self.length}, "
                f"from position {self.first}; {how})",
                f"KLD               mean {self.mean_kld:.6f} ± {self.kld_stderr:.6f}, median {self.median_kld:.6f}, "
                f"p99 {self.p99_kld:.6f}, max {self.max_kld:.6f}",
                f"delta p           mean {100 * self.delta_p_mean:+.3f}%, RMS {100 * self.delta_p_rms:.3f}%",
                f"same top token    {100 * self.same_top_rate:.2f}%",
                f"perplexity        {self.perplexity:.4f} (reference {self.reference_perplexity:.4f}, "
                f"ratio {self.perplexity_ratio:.4f})",
            ]
        )


def window_metrics(
    log_probs: torch.Tensor,
    top_ids: torch.Tensor,
    top_logprobs: torch.Tensor,
    rest_logprob: torch.Tensor,
    target_logprob: torch.Tensor,
    targets: torch.Tensor,
) -> dict:
    """Per-token measures of one window: the model's `log_probs` [scored, vocab] against the
    reference's top-k (ids, log-probs), the log of its remaining mass, and its log p of `targets`.
    KLD = sum over the top k of p (log p - log q), plus the same term for the rest as one bucket."""
    top_ids = top_ids.long()
    top_ref = top_logprobs.double()
    top_model = log_probs.gather(-1, top_ids)
    kld = (top_ref.exp() * (top_ref - top_model)).sum(-1)
    rest_ref = rest_logprob.double()
    rest_term = rest_ref.exp() * (rest_ref - log_rest(log_probs, top_ids))
    kld = kld + torch.where(torch.isfinite(rest_ref), rest_term, torch.zeros_like(rest_term))
    model_target = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    return {
        "kld": kld,
        "delta_p": model_target.exp() - target_logprob.double().exp(),
        "same_top": top_model[:, 0] >= log_probs.max(-1).values,
        "nll": -model_target,
        "reference_nll": -target_logprob.double(),
    }


def _result(parts: list[dict], windows: torch.Tensor, first: int, top_k: int | None) -> QualityResult:
    joined = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    return QualityResult(**joined, windows=windows.shape[0], length=windows.shape[1], first=first, top_k=top_k)


def _check_vocab(log_probs: torch.Tensor, vocab_size: int, source: str) -> None:
    if log_probs.shape[-1] != vocab_size:
        raise QualityError(
            f"the model has {log_probs.shape[-1]} logits per token, the reference {source or ''} "
            f"{vocab_size}: they are different models. Fix: compare models of the same vocabulary."
        )


def compare(executable, reference: ReferenceLogits) -> QualityResult:
    """Run `executable` over the reference's windows and measure it against the stored reference."""
    return compare_many(executable, [reference])[0]


def compare_many(executable, references: list[ReferenceLogits]) -> list[QualityResult]:
    """`compare` against several references made on the same windows (e.g. the full distributions
    and their top-k), running `executable` once."""
    tokens, first = references[0].tokens, references[0].first
    if any(not torch.equal(r.tokens, tokens) or r.first != first for r in references):
        raise QualityError("compare_many needs references made on the same windows. Fix: compare them one by one.")
    check_windows(tokens, first, executable.options.max_seq_len)
    parts: list[list[dict]] = [[] for _ in references]
    for w, window in enumerate(tokens):
        log_probs = scored_log_probs(executable, window, first)
        for reference, found in zip(references, parts):
            _check_vocab(log_probs, reference.vocab_size, reference.source)
            found.append(
                window_metrics(
                    log_probs,
                    reference.top_ids[w],
                    reference.top_logprobs[w],
                    reference.rest_logprob[w],
                    reference.target_logprob[w],
                    reference.targets[w],
                )
            )
    executable.reset()
    return [
        _result(found, tokens, first, r.top_k if r.top_k < r.vocab_size else None)
        for r, found in zip(references, parts)
    ]


def compare_executables(
    executable, reference, windows: torch.Tensor, first: int | None = None, top_k: int | None = None
) -> QualityResult:
    """`executable` against `reference` (both Kiln executables) on token `windows` [count, length],
    window by window; `top_k=None` compares the full distributions (exact KLD)."""
    first = default_first(windows.shape[1]) if first is None else first
    for each in (executable, reference):
        check_windows(windows, first, each.options.max_seq_len)
    parts = []
    for window in windows:
        ref = scored_log_probs(reference, window, first)
        top = torch.topk(ref, ref.shape[-1] if top_k is None else min(top_k, ref.shape[-1]), dim=-1)
        log_probs = scored_log_probs(executable, window, first)
        _check_vocab(log_probs, ref.shape[-1], "")
        targets = window[first + 1 :]
        parts.append(
            window_metrics(
                log_probs,
                top.indices,
                top.values,
                log_rest(ref, top.indices),
                ref.gather(-1, targets[:, None]).squeeze(-1),
                targets,
            )
        )
    executable.reset()
    reference.reset()
    return _result(parts, windows, first, top_k)


# -- artifacts ---------------------------------------------------------------------------------
def _open(artifact):
    """(LLM, manifest bytes) of an artifact path or an already loaded kiln.LLM."""
    if hasattr(artifact, "executable"):
        return artifact, json.dumps(artifact.manifest or {}, sort_keys=True).encode()
    import kiln

    llm = kiln.load(artifact)
    return llm, (Path(artifact) / "manifest.json").read_bytes()


def _windows(llm, text, length: int, count: int | None) -> torch.Tensor:
    from kiln.runtime.perplexity import token_windows

    if llm.tokenizer is None:
        raise QualityError(
            "the artifact has no tokenizer to read the text with. Fix: compile it from a "
            "checkpoint that has one, or compare on a reference-logits file."
        )
    text = Path(text).read_text(encoding="utf-8") if isinstance(text, Path) else text
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < length:
        raise QualityError(
            f"the text has {len(ids)} tokens, fewer than one window of {length}. "
            "Fix: a longer text, or a smaller window."
        )
    return token_windows(ids, length, count or len(ids) // length)


def default_cache_dir() -> Path:
    from kiln.frontend.default_model import cache_root

    return cache_root() / "quality"


def quality(
    artifact,
    reference,
    text: str | Path | None = None,
    *,
    length: int = 512,
    windows: int | None = None,
    first: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    cache_dir: str | Path | None = None,
    save_reference: str | Path | None = None,
) -> QualityResult:
    """Compare `artifact` (a path or kiln.LLM) against `reference`: an artifact (path or LLM), a
    reference-logits file, or a ReferenceLogits. `text` (a string, or a Path to read) is cut into
    `windows` windows of `length` tokens (default: as many as it holds); positions from `first`
    on are scored (default length // 2). The reference's run is cached in `cache_dir` (default
    $KILN_CACHE/quality; False: no cache) and also written to `save_reference` if given."""
    stored = _stored_reference(reference)
    llm, _ = _open(artifact)
    if stored is None:
        if text is None:
            raise QualityError(
                "comparing against a reference artifact needs a text. Fix: pass text= "
                "(--text FILE), or a reference-logits file made earlier."
            )
        tokens = _windows(llm, text, length, windows)
        first = default_first(length) if first is None else first
        stored = _run_reference(reference, tokens, first, top_k, cache_dir, text)
    elif text is not None:
        _check_same_text(stored, _windows(llm, text, stored.tokens.shape[1], stored.tokens.shape[0]))
    if save_reference:
        stored.save(save_reference)
    return compare(llm.executable, stored)


def _stored_reference(reference) -> ReferenceLogits | None:
    if isinstance(reference, ReferenceLogits):
        return reference
    if isinstance(reference, (str, Path)) and Path(reference).is_file():
        return ReferenceLogits.load(reference)
    if isinstance(reference, (str, Path)) and not Path(reference).is_dir():
        raise QualityError(
            f"reference {reference} does not exist. Fix: give a reference artifact directory or a "
            "reference-logits file."
        )
    return None


def _check_same_text(stored: ReferenceLogits, tokens: torch.Tensor) -> None:
    if not torch.equal(tokens, stored.tokens):
        raise QualityError(
            f"the reference logits {stored.source} were made on another text (or tokenizer). "
            "Fix: pass the same text, or omit it to use the reference's own tokens."
        )


def _run_reference(reference, tokens: torch.Tensor, first: int, top_k: int, cache_dir, text) -> ReferenceLogits:
    manifest = (
        (Path(reference) / "manifest.json").read_bytes()
        if isinstance(reference, (str, Path))
        else json.dumps(reference.manifest or {}, sort_keys=True).encode()
    )
    cached = None
    if cache_dir is not False:
        cached = Path(cache_dir or default_cache_dir()) / f"{cache_key(manifest, tokens, first, top_k)}.logits"
        if cached.is_file():
            return ReferenceLogits.load(cached)
    ref_llm, _ = _open(reference)
    if ref_llm.tokenizer is not None and not torch.equal(_windows(ref_llm, text, tokens.shape[1], len(tokens)), tokens):
        raise QualityError(
            "the reference artifact's tokenizer reads the text differently: the two are not the same "
            "model family. Fix: compare artifacts compiled from the same checkpoint."
        )
    stored = reference_logits(ref_llm.executable, tokens, first, top_k, source=str(reference))
    del ref_llm
    gc.collect()
    if cached is not None:
        stored.save(cached)
    return stored
