"""Search decoding in `generate`: beam search (`num_beams`, beam_search.py) and contrastive
search (`penalty_alpha` with `top_k`, contrastive_search.py).

`pop_search` takes their keywords out of generate's (None: plain decoding); `search_generations`
checks the rest of the request against them and makes one generation per prompt, each run while
the engine is held alone (engine_batch.Exclusive): they use KV rows 0 .. width-1 (num_beams, or
top_k candidates) and need `max_batch` at least that wide.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from kiln.backends.executable import capabilities
from kiln.runtime.beam_search import BeamOptions, BeamSearch
from kiln.runtime.engine_batch import Exclusive
from kiln.runtime.errors import GenerationError
from kiln.runtime.request import GenerationSettings

BEAM_KEYWORDS = ("num_beams", "length_penalty", "early_stopping", "num_return_sequences")


@dataclass(frozen=True)
class ContrastiveOptions:
    penalty_alpha: float


def pop_search(sampling: dict) -> BeamOptions | ContrastiveOptions | None:
    """The search `sampling` asks for, its keywords removed; None for plain decoding (also
    num_beams=1, which is greedy, as in Hugging Face)."""
    given = {key: sampling.pop(key) for key in (*BEAM_KEYWORDS, "penalty_alpha") if key in sampling}
    alpha = given.pop("penalty_alpha", None)
    if alpha is not None:
        if given:
            raise GenerationError(
                f"penalty_alpha (contrastive search) does not combine with {sorted(given)} "
                "(beam search). Fix: use one of the two."
            )
        if not _is_real(alpha) or not 0.0 <= alpha <= 1.0:
            raise GenerationError(
                f"penalty_alpha must be a number in [0, 1], got {alpha!r:.40}. "
                "Fix: pass e.g. penalty_alpha=0.6 with top_k=4."
            )
        return ContrastiveOptions(float(alpha))
    if not given:
        return None
    options = _beam_options(**given)
    return options if options.num_beams > 1 else None


def _beam_options(num_beams=1, length_penalty=1.0, early_stopping=False, num_return_sequences=1) -> BeamOptions:
    if not _is_int(num_beams) or num_beams < 1:
        raise GenerationError(f"num_beams must be an integer >= 1, got {num_beams!r:.40}. Fix: pass e.g. num_beams=4.")
    if not _is_real(length_penalty):
        raise GenerationError(
            f"length_penalty must be a finite number, got {length_penalty!r:.40}. Fix: 1.0 "
            "divides a beam's score by its length; above 1 favours longer beams, below shorter."
        )
    if early_stopping not in (True, False, "never") or not isinstance(early_stopping, (bool, str)):
        raise GenerationError(
            f"early_stopping must be True, False or 'never', got {early_stopping!r:.40}. "
            "Fix: pass one of those (Hugging Face's meaning)."
        )
    if not _is_int(num_return_sequences) or not 1 <= num_return_sequences <= num_beams:
        raise GenerationError(
            f"num_return_sequences must be an integer from 1 to num_beams ({num_beams}), got "
            f"{num_return_sequences!r:.40}. Fix: return at most as many beams as are searched "
            "(n= draws several samples)."
        )
    return BeamOptions(int(num_beams), float(length_penalty), early_stopping, int(num_return_sequences))


def search_generations(
    llm,
    token_lists: list[list[int]],
    settings: GenerationSettings,
    seeds: list[int],
    options: BeamOptions | ContrastiveOptions,
    speculative=None,
    constraint=None,
) -> list[Exclusive]:
    """One Exclusive generation per prompt for `options`; a GenerationError when the request does not fit it."""
    name = "beam search" if isinstance(options, BeamOptions) else "contrastive search"
    if speculative is not None or constraint is not None:
        raise GenerationError(
            f"{name} does not take speculative, json_schema, regex or choices. Fix: drop them, "
            "or decode without the search."
        )
    if not settings.sampling.greedy:
        raise GenerationError(
            f"{name} is deterministic and takes temperature 0, got "
            f"{settings.sampling.temperature}. Fix: drop temperature, or sample without the search."
        )
    width = options.num_beams if isinstance(options, BeamOptions) else settings.sampling.top_k
    if isinstance(options, ContrastiveOptions) and width < 1:
        raise GenerationError(
            "contrastive search needs top_k, how many candidates each step weighs. "
            "Fix: pass e.g. penalty_alpha=0.6, top_k=4."
        )
    executable = llm.executable
    if width > llm.max_batch:
        what = f"num_beams={width}" if isinstance(options, BeamOptions) else f"top_k={width} candidates"
        raise GenerationError(
            f"{name} with {what} needs {width} KV rows, but the artifact was compiled with "
            f"max_batch={llm.max_batch}. Fix: recompile with --max-batch {width} or more, or "
            f"search with at most {llm.max_batch}."
        )
    if width > 1 and not capabilities(executable).copies_rows:
        raise GenerationError(
            f"{name} copies keys and values between KV rows, which this executable's buffers "
            "do not allow (they live where torch cannot address them). Fix: use greedy decoding."
        )
    decoder = llm.tokenizer.incremental_decoder if llm.tokenizer else None
    if isinstance(options, BeamOptions):
        _check_beam_settings(settings)
        return [
            Exclusive(
                llm.engine, BeamSearch(executable, prompt, settings, seed, options, decoder, vocab_size=llm.vocab_size)
            )
            for prompt, seed in zip(token_lists, seeds)
        ]
    from kiln.runtime.contrastive_search import ContrastiveSearch, hidden_solver

    to_hidden = hidden_solver(llm.graph)
    return [
        Exclusive(
            llm.engine,
            ContrastiveSearch(
                executable, prompt, settings, seed, options.penalty_alpha, to_hidden, decoder, vocab_size=llm.vocab_size
            ),
        )
        for prompt, seed in zip(token_lists, seeds)
    ]


def _check_beam_settings(settings: GenerationSettings) -> None:
    """What beam search leaves out: stop strings (its beams end on tokens) and the logit
    adjustments whose meaning on log-probabilities differs (Hugging Face applies them there)."""
    params = settings.sampling
    unsupported = [
        name
        for name, used in (
            ("stop", bool(settings.stop)),
            ("logit_bias", bool(params.logit_bias)),
            ("repetition_penalty", params.repetition_penalty != 1.0),
            ("presence_penalty", params.presence_penalty != 0.0),
            ("frequency_penalty", params.frequency_penalty != 0.0),
        )
        if used
    ]
    if unsupported:
        raise GenerationError(
            f"beam search does not take {unsupported}. Fix: drop them (stop_token_ids, "
            "min_tokens and bad_words work with beams)."
        )


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
