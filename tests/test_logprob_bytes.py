"""Logprobs carry each token's true bytes, and text offsets that index the text.

CJK and emoji come out of byte-level BPE (the tiny models' tokenizer, SmolLM2's) as tokens
holding parts of a character, and out of byte-fallback vocabularies (Llama, Mistral: a fixture
here) as `<0xE6>`-style byte tokens; decoding such a token alone gives U+FFFD. For every kind of
tokenizer: the bytes of the tokens in the text, joined, are the text's UTF-8, and each offset is
the index of the character holding the token's first byte.
"""

from __future__ import annotations

import codecs
import json

import pytest
from fastapi.testclient import TestClient

from kiln.backends.executable import BackendOptions
from kiln.backends.reference import ReferenceExecutable
from kiln.runtime.generate import LLM
from kiln.runtime.openai_logprobs import TokenBytes, token_spans, token_string
from kiln.runtime.server import create_app
from kiln.runtime.tokenizer import Tokenizer
from test_generate_loop import MAX_SEQ_LEN, tiny_stateful_graph
from tiny_models import (
    BYTE_FALLBACK_SPECIAL_TOKENS,
    EOS_TOKEN_ID,
    byte_fallback_tokenizer_json,
    tokenizer_config,
    tokenizer_json,
)

TEXTS = ["日本の首都は東京です", "Paris 😀 and 🇫🇷!", "naïve café, Ελλάδα", "The capital of France is Paris."]
MODEL = "tiny"
SHORT_TEMPLATE = "{% for message in messages %}{{ message['content'] + '\n' }}{% endfor %}"  # the context is 24


def write_tokenizer(directory, tokenizer_text: str, config: dict) -> Tokenizer:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_text)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(directory)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    return write_tokenizer(tmp_path_factory.mktemp("byte_level"), tokenizer_json(), tokenizer_config())


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory) -> Tokenizer:
    unk, bos, eos = BYTE_FALLBACK_SPECIAL_TOKENS
    return write_tokenizer(
        tmp_path_factory.mktemp("byte_fallback"),
        byte_fallback_tokenizer_json(),
        {"bos_token": bos, "eos_token": eos, "unk_token": unk, "chat_template": SHORT_TEMPLATE},
    )


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback", "smollm2"])
def any_tokenizer(request, byte_level, byte_fallback) -> Tokenizer:
    if request.param == "smollm2":
        return Tokenizer.from_dir(request.getfixturevalue("smollm2_dir"))
    return {"byte_level": byte_level, "byte_fallback": byte_fallback}[request.param]


def characters_before(encoded: bytes, position: int) -> int:
    """How many whole characters the UTF-8 bytes before `position` hold."""
    return len(encoded[:position].decode("utf-8", errors="ignore"))


def string_bytes(token: str) -> bytes:
    """The bytes a logprobs token string names (its `bytes:\\xe6` form undone)."""
    if token.startswith("bytes:"):
        return codecs.escape_decode(token[len("bytes:") :].encode())[0]
    return token.encode()


def assert_spans_index_the_text(spans, text: str, special=frozenset()) -> None:
    in_text = [span for span in spans if span.token not in special]
    encoded = text.encode("utf-8")
    assert b"".join(span.bytes for span in in_text) == encoded
    position = 0
    for span in in_text:
        assert span.text_offset == characters_before(encoded, position), (span, text)
        position += len(span.bytes)


@pytest.mark.parametrize("text", TEXTS)
def test_joined_token_bytes_are_the_text_and_offsets_index_it(any_tokenizer, text):
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    decoded = any_tokenizer.decode(ids)
    spans = token_spans(TokenBytes(any_tokenizer), ids, decoded)
    assert_spans_index_the_text(spans, decoded)
    if not text.isascii():  # some token holds part of a character: decoded alone it is U+FFFD
        assert any(any_tokenizer.decode([token]) == "\ufffd" for token in ids)


def test_byte_tokens_of_one_character_share_its_offset(byte_fallback):
    ids = byte_fallback.encode("ab日", add_special_tokens=False)
    spans = token_spans(TokenBytes(byte_fallback), ids, byte_fallback.decode(ids))
    assert [span.bytes for span in spans[-3:]] == [b"\xe6", b"\x97", b"\xa5"]
    assert [span.text_offset for span in spans[-3:]] == [2, 2, 2]
    assert [token_string(span.bytes) for span in spans[-3:]] == ["bytes:\\xe6", "bytes:\\x97", "bytes:\\xa5"]


def test_the_leading_space_a_sentencepiece_decoder_drops_is_not_in_the_first_tokens_bytes(byte_fallback):
    ids = byte_fallback.encode("The capital", add_special_tokens=False)
    assert TokenBytes(byte_fallback).of(ids[0]) == b" The"  # "▁The"
    spans = token_spans(TokenBytes(byte_fallback), ids, "The capital")
    assert [span.bytes for span in spans] == [b"The", b" capital"] and spans[1].text_offset == 3


def test_special_tokens_and_a_cut_tail_sit_at_the_end_of_the_text(byte_level):
    ids = byte_level.encode("Paris 日本", add_special_tokens=False)
    text = "Paris 日\ufffd"  # the generation ended inside 本: the decoder's U+FFFD ends the text
    spans = token_spans(TokenBytes(byte_level), [*ids[:-1], EOS_TOKEN_ID], text)
    assert spans[-1].bytes == b"<|im_end|>" and spans[-1].text_offset == len(text)
    first_of_hon = len(byte_level.encode("Paris 日", add_special_tokens=False))
    assert spans[first_of_hon].bytes == b"\xe6" and spans[first_of_hon].text_offset == len(text) - 1
    cut = token_spans(TokenBytes(byte_level), ids, "Par")  # a stop string cut the text after "Par"
    assert [span.text_offset for span in cut] == sorted(span.text_offset for span in cut)
    assert cut[-1].text_offset == 3


def test_bytes_that_are_no_utf8_do_not_derail_the_offsets_after_them(any_tokenizer):
    names = TokenBytes(any_tokenizer)
    stray = next(t for t in range(any_tokenizer.vocab_size) if names.of(t) == b"\x97")  # a lone continuation byte
    ids = [
        *any_tokenizer.encode("ab", add_special_tokens=False),
        stray,
        *any_tokenizer.encode("cd 日本", add_special_tokens=False),
    ]
    text = any_tokenizer.decode(ids)
    assert "\ufffd" in text
    spans = token_spans(names, ids, text)
    tail = any_tokenizer.encode("cd 日本", add_special_tokens=False)
    first = spans[-len(tail)]  # "cd" (or " cd": sentencepiece marks a word's start)
    assert first.text_offset == text.index("cd") - (first.bytes[:1] == b" ")
    assert text[first.text_offset :].encode().startswith(first.bytes)
    assert spans[-1].text_offset == len(text) - 1  # the last byte of 本


def test_a_token_that_is_whole_characters_is_named_by_its_text():
    assert token_string(b" Paris") == " Paris" and token_string("日".encode()) == "日"
    assert token_string(b" \xe6\x97") == "bytes: \\xe6\\x97"


# -- through the server -------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def served(request):
    tokenizer = request.getfixturevalue(request.param)
    llm = LLM(
        ReferenceExecutable(tiny_stateful_graph(0, 2), BackendOptions(max_batch=2, max_seq_len=MAX_SEQ_LEN)), tokenizer
    )
    with TestClient(create_app(llm, MODEL)) as client:
        yield client, tokenizer


def test_completion_logprobs_of_cjk_tokens(served):
    client, _ = served
    # the regex makes the random model write CJK; with logprobs every forced token is scored
    response = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 20, "logprobs": 2, "regex": "東京😀"}
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    assert text == "東京😀"
    assert "bytes:\\xe6" in logprobs["tokens"][0]  # byte tokens: none is U+FFFD any more
    raw = [string_bytes(token) for token in logprobs["tokens"]]
    assert b"".join(raw) == text.encode()
    encoded, position = text.encode(), 0
    for piece, offset in zip(raw, logprobs["text_offset"]):
        assert offset == characters_before(encoded, position)
        position += len(piece)
    assert len(logprobs["top_logprobs"]) == len(logprobs["tokens"]) == len(logprobs["token_logprobs"])


def test_chat_logprob_bytes_join_to_the_message(served):
    client, _ = served
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 9,
            "logprobs": True,
            "top_logprobs": 3,
            "regex": "京😀",
        },
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == "京😀"
    in_text = [entry for entry in content if entry["token"] not in ("</s>", "<|im_end|>")]
    assert b"".join(bytes(entry["bytes"]) for entry in in_text) == "京😀".encode()
    assert all(entry["token"] != "\ufffd" and len(entry["top_logprobs"]) == 3 for entry in content)
    for entry in content:
        for alternative in entry["top_logprobs"]:
            assert token_string(bytes(alternative["bytes"])) == alternative["token"]
