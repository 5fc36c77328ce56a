"""The runtime's tokenizer: `tokenizer.json` via the `tokenizers` library, special tokens from
`tokenizer_config.json` / `generation_config.json`, and the chat template.

It reads only what an artifact (or a Hugging Face directory) ships; transformers is not needed.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from kiln.runtime.chat_template import render_chat, select_chat_template
from kiln.runtime.detokenizer import IncrementalDecoder
from kiln.runtime.errors import GenerationError, TokenizerError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON ({e}). Fix: restore the file from the model.") from None


def _token_text(entry) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


class Tokenizer:
    """Text <-> token ids, the special tokens, and chat-template rendering."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        config: dict | None = None,
        generation_config: dict | None = None,
        chat_template: str | None = None,
    ):
        self._tok = tokenizer
        self.config = config or {}
        self.special_tokens = {
            key: _token_text(self.config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.bos_id = self._id(self.special_tokens["bos_token"])
        eos = {self._id(self.special_tokens["eos_token"])}
        gen_eos = (generation_config or {}).get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids: frozenset[int] = frozenset(i for i in eos if isinstance(i, int))
        self.chat_template = chat_template or select_chat_template(self.config.get("chat_template"))

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Load tokenizer.json (required) and the optional config files next to it."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"No tokenizer.json in {directory}. Fix: use a model directory that ships "
                "a fast tokenizer (tokenizer.json), or pass prompts as token ids."
            )
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust library raises a bare Exception on malformed files
            raise TokenizerError(f"{path} cannot be loaded ({e}). Fix: restore the file from the model.") from None
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(
            tok,
            _read_json(directory / "tokenizer_config.json"),
            _read_json(directory / "generation_config.json"),
            template,
        )

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids decoding leaves out of the text (skip_special_tokens): EOS, chat markers, ..."""
        return frozenset(i for i, token in self._tok.get_added_tokens_decoder().items() if token.special)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens (e.g. BOS) as the tokenizer's post-processor adds them."""
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the Rust library's answer to a str it cannot take as UTF-8
            _check_unicode(text)
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (for libraries that build their own view of it)."""
        return self._tok.to_str()

    def incremental_decoder(self) -> IncrementalDecoder:
        """A streaming decoder that emits only complete characters."""
        return IncrementalDecoder(self.decode)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text for a conversation, rendered with the model's chat template."""
        if not self.chat_template:
            raise TokenizerError(
                "This model has no chat template (no `chat_template` in tokenizer_config.json "
                "and no chat_template.jinja). Fix: use generate() with a plain prompt, or add a "
                "template to tokenizer_config.json before compiling."
            )
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt,
            **{k: v for k, v in self.special_tokens.items() if v is not None},
            **variables,
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation; the template already holds the special tokens."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _check_unicode(text) -> None:
    """GenerationError for a str holding a lone surrogate (e.g. from "\\ud800" in JSON): not Unicode text."""
    surrogate = re.search("[\ud800-\udfff]", text) if isinstance(text, str) else None
    if surrogate is not None:
        raise GenerationError(
            f"The text holds a lone surrogate {surrogate.group()!a} at character "
            f"{surrogate.start()}, which is not Unicode text and has no tokens. Fix: pass valid "
            "Unicode (decode input with errors='replace' if it may hold broken escapes)."
        )
