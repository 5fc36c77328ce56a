"""The runtime tokenizer: encode/decode, special tokens, streaming decode and chat templates."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.errors import TokenizerError
from kiln.runtime.tokenizer import Tokenizer
from tiny_models import BOS_TOKEN_ID, EOS_TOKEN_ID, tokenizer_config, tokenizer_json

MULTIBYTE = "Once upon a time: héllo wörld, 你好, naïve café 🙂👍🏽!"


def make_dir(tmp_path, config: dict | None = None, generation_config: dict | None = None):
    (tmp_path / "tokenizer.json").write_text(tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config() if config is None else config))
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


@pytest.fixture
def tokenizer(tmp_path) -> Tokenizer:
    return Tokenizer.from_dir(make_dir(tmp_path))


def test_encode_decode_round_trip(tokenizer):
    assert tokenizer.decode(tokenizer.encode(MULTIBYTE)) == MULTIBYTE


def test_special_tokens_come_from_tokenizer_config(tokenizer):
    assert tokenizer.bos_id == BOS_TOKEN_ID and tokenizer.eos_ids == {EOS_TOKEN_ID}


def test_generation_config_adds_eos_ids(tmp_path):
    tokenizer = Tokenizer.from_dir(make_dir(tmp_path, generation_config={"eos_token_id": [0, EOS_TOKEN_ID]}))
    assert tokenizer.eos_ids == {0, EOS_TOKEN_ID}


def test_incremental_decode_emits_only_complete_characters(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    decoder = tokenizer.incremental_decoder()
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.finish())
    assert "".join(pieces) == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # some byte tokens held back half a character


def test_incremental_decode_flushes_an_incomplete_tail(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1  # byte pieces: no single token holds the whole character
    decoder = tokenizer.incremental_decoder()
    assert [decoder.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.finish() == tokenizer.decode(ids[:-1])


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="No tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_renders_messages(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_helpers_match_transformers(tmp_path):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}"
    )
    tokenizer = Tokenizer.from_dir(make_dir(tmp_path, dict(tokenizer_config(), chat_template=template)))
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "<b>é</b>"}])
        == '<|im_start|>[{"role": "user", "content": "<b>é</b>"}]'
    )
    with pytest.raises(TokenizerError, match="user first"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_chat_template_runs_sandboxed(tmp_path):
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = Tokenizer.from_dir(make_dir(tmp_path, dict(tokenizer_config(), chat_template=template)))
    with pytest.raises(TokenizerError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_is_a_clear_error(tmp_path):
    config = {k: v for k, v in tokenizer_config().items() if k != "chat_template"}
    tokenizer = Tokenizer.from_dir(make_dir(tmp_path, config))
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
