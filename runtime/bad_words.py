"""`bad_words` given as text: each word becomes the token sequences that spell it.

`SamplingParams.bad_words` holds token id sequences (the sampler bans a sequence's last token
where the context ends with the rest). Users mostly have words, so `LLM.generate` accepts
strings too: a word is banned as the tokenizer spells it alone and after a space (a byte-level
BPE tokenizer spells " Paris" with other tokens than "Paris"), as vLLM does. Token id lists pass
through unchanged.
"""

from __future__ import annotations

from kiln.runtime.errors import GenerationError, TokenizerError


def resolve_bad_words(tokenizer, sampling: dict) -> None:
    """Replace the words in `sampling["bad_words"]` (if any) by their token id sequences, in place."""
    given = sampling.get("bad_words")
    if not isinstance(given, (list, tuple)) or not any(isinstance(item, str) for item in given):
        return  # absent, or ids only: SamplingParams checks them
    if tokenizer is None:
        raise TokenizerError(
            "bad_words given as text need the artifact's tokenizer. Fix: pass token id lists, "
            "or recompile from a model directory with tokenizer.json."
        )
    sequences: list = []
    for item in given:
        for sequence in word_spellings(tokenizer, item) if isinstance(item, str) else [item]:
            if sequence not in sequences:
                sequences.append(sequence)
    sampling["bad_words"] = sequences


def word_spellings(tokenizer, word: str) -> list[list[int]]:
    """The token sequences of `word` alone and after a space (one if they agree)."""
    if not word.strip():
        raise GenerationError(f"bad_words has an empty or blank word {word!r}. Fix: give words with visible text.")
    spellings = []
    for text in (word, " " + word.lstrip()):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids and ids not in spellings:
            spellings.append(ids)
    return spellings
