"""Log-probabilities in OpenAI's shapes, with each token's true bytes and its place in the text.

Decoding a token alone is wrong wherever a token holds part of a character: byte-level BPE
splits CJK and emoji into pieces of their UTF-8 bytes, and byte-fallback vocabularies spell
them as `<0xE6>`-style tokens; either way a lone decode gives U+FFFD (bytes EF BF BD). So a
token's bytes come from the tokenizer's own byte mapping, as llguidance reads it for
constrained decoding (one view per tokenizer, shared with it), and:

- `bytes` is what the token adds to the text: its raw bytes, less a leading space that the
  tokenizer's decoder drops at the start of a text (sentencepiece's `Strip`). Special tokens
  (an EOS) are not in the text: their bytes are their own text. The bytes of the tokens in the
  text, joined, are the text's UTF-8 (where the text is valid UTF-8 and was not cut short).
- A token's string is its text, or where its bytes are not whole UTF-8 characters, OpenAI's
  `bytes:` form of them: `"bytes:\\xe6\\x97"` (valid characters kept, the other bytes escaped).
- `text_offset` is the index in the text (in characters, as Python and vLLM count them) of the
  character that holds the token's first byte: the three byte tokens of one CJK character share
  its index, as llama-cpp-python reports them; tokens past the end of the text (an EOS, the tail
  cut off by a stop string) get the text's length. Bytes that are no valid UTF-8 became U+FFFD in
  the text; the tokens after them still get their own characters' indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.runtime import openai_protocol as api


@dataclass(frozen=True)
class TokenSpan:
    """A generated token as the text holds it."""

    token: int
    bytes: bytes  # what it adds to the text (a special token: its own text)
    text_offset: int  # index of the character holding its first byte (len(text) past the end)


class TokenBytes:
    """Raw bytes of token ids, from one tokenizer's byte mapping."""

    def __init__(self, tokenizer):
        from kiln.runtime.constraint_compiler import compiler_for

        self.decode = tokenizer.decode
        self._view = compiler_for(tokenizer).lltokenizer  # built once per tokenizer (~0.5 s for 50k tokens)
        self._special = tokenizer.special_ids

    def of(self, token: int) -> bytes:
        """The token's bytes (b"" for an id beyond the tokenizer's vocabulary)."""
        return self._view.decode_bytes([token]) if 0 <= token < self._view.vocab_size else b""

    def is_special(self, token: int) -> bool:
        """Whether decoding leaves the token out of the text (an EOS, a chat marker)."""
        return token in self._special


class TokenIds:
    """Without a tokenizer a token is named by its id (and there is no text)."""

    def of(self, token: int) -> bytes:
        return str(token).encode()

    def is_special(self, token: int) -> bool:
        return False

    def decode(self, tokens) -> str:
        return ""


def token_spans(names: TokenBytes | TokenIds, tokens: Sequence[int], text: str) -> list[TokenSpan]:
    """Where each of `tokens` (a generation) sits in `text` (its decoded text).

    A cursor walks the text's UTF-8 as the tokens' bytes spell it. Where they do not (bytes that
    are no valid UTF-8 came out as U+FFFD, or the text was cut), the decoder itself says where
    the token starts: the characters that the text shares with the decoded tokens before it."""
    encoded = text.encode("utf-8")
    char_of, byte_of = _character_of_each_byte(text), _byte_of_each_character(text)
    spans, cursor = [], 0
    for index, token in enumerate(tokens):
        raw = names.of(token)
        if names.is_special(token):  # decoding skips it: it adds nothing to the text
            spans.append(TokenSpan(token, raw, char_of[cursor]))
            continue
        if cursor == 0 and raw[:1] == b" " and not encoded.startswith(raw) and encoded.startswith(raw[1:]):
            raw = raw[1:]  # the decoder drops the text's leading space (sentencepiece's Strip)
        if not encoded.startswith(raw, cursor):
            cursor = byte_of[_shared_characters(names.decode(tokens[:index]), text)]
        spans.append(TokenSpan(token, raw, char_of[cursor]))
        if encoded.startswith(raw, cursor):
            cursor += len(raw)
    return spans


def token_string(raw: bytes) -> str:
    """A token's text; OpenAI's `bytes:\\xe6\\x97` form when its bytes are not whole characters."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + raw.decode("utf-8", errors="backslashreplace")


def _character_of_each_byte(text: str) -> list[int]:
    """For each byte offset of the text's UTF-8 (and its end), the index of its character."""
    index = []
    for position, character in enumerate(text):
        index += [position] * len(character.encode("utf-8"))
    return index + [len(text)]


def _byte_of_each_character(text: str) -> list[int]:
    """For each character of the text (and its end), the offset of its first UTF-8 byte."""
    offsets, position = [], 0
    for character in text:
        offsets.append(position)
        position += len(character.encode("utf-8"))
    return offsets + [position]


def _shared_characters(decoded: str, text: str) -> int:
    """How many leading characters `decoded` and `text` share."""
    shared = 0
    for one, other in zip(decoded, text):
        if one != other:
            break
        shared += 1
    return shared


# -- the OpenAI shapes ---------------------------------------------------------------------------
def completion_logprobs(llm, result, echo=None) -> api.CompletionLogprobs:
    """`choices[i].logprobs` of a completion: tokens, their log-probabilities, top alternatives
    and text offsets; with `echo` (an openai_echo.EchoedPrompt) the prompt's tokens first, the
    first with null log-probability and alternatives, the offsets running on through the text."""
    entries = result.logprobs or []
    names = _names(llm)
    spans = token_spans(names, [entry.token for entry in entries], result.text)
    tokens = [token_string(span.bytes) for span in spans]
    logprobs = [entry.logprob for entry in entries]
    tops = [{token_string(names.of(token)): logprob for token, logprob in entry.top} for entry in entries]
    offsets = [span.text_offset for span in spans]
    if echo is not None:
        prompt_spans = token_spans(names, echo.token_ids, echo.text)
        scored = echo.scores.token_logprobs if echo.scores is not None else []
        alternatives = (echo.scores.top_logprobs if echo.scores is not None else None) or [{} for _ in scored]
        tokens = [token_string(span.bytes) for span in prompt_spans] + tokens
        logprobs = [None] + scored + logprobs
        tops = (
            [None]
            + [{token_string(names.of(token)): logprob for token, logprob in top.items()} for top in alternatives]
            + tops
        )
        offsets = [span.text_offset for span in prompt_spans] + [len(echo.text) + offset for offset in offsets]
    return api.CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(llm, result) -> api.ChatLogprobs:
    """`choices[0].logprobs` of a chat completion: per token its string, bytes, log-probability
    and top alternatives."""
    entries = result.logprobs or []
    names = _names(llm)
    spans = token_spans(names, [entry.token for entry in entries], result.text)

    def alternative(token: int, logprob: float) -> api.TopLogprob:
        raw = names.of(token)
        return api.TopLogprob(token=token_string(raw), logprob=logprob, bytes=list(raw))

    return api.ChatLogprobs(
        content=[
            api.TokenLogprobEntry(
                token=token_string(span.bytes),
                logprob=entry.logprob,
                bytes=list(span.bytes),
                top_logprobs=[alternative(token, logprob) for token, logprob in entry.top],
            )
            for entry, span in zip(entries, spans)
        ]
    )


def _names(llm) -> TokenBytes | TokenIds:
    return TokenBytes(llm.tokenizer) if llm.tokenizer is not None else TokenIds()
