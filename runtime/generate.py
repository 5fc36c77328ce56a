"""`LLM`: a loaded artifact that generates text.

    llm = kiln.load("model.kiln")
    llm.generate("Once upon a time", max_new_tokens=32).text
    for piece in llm.stream("Once upon a time"): print(piece, end="")
    llm.chat([{"role": "user", "content": "Hi!"}]).text

A prompt is a string or a list of token ids; a list of prompts is generated as batches of at
most max_batch rows. Context policy: a prompt longer than the compiled max_seq_len raises
`ContextLengthError`; a prompt that fits but leaves too little room for max_new_tokens has its
new tokens clamped to what fits (the result says so: finish_reason "context", stats.clamped).
"""
from __future__ import annotations

from typing import Sequence

import torch

from kiln.runtime.decode_loop import BatchGeneration, GenerationRequest
from kiln.runtime.errors import ContextLengthError, GenerationError, TokenizerError
from kiln.runtime.results import GenerationResult
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.text_stream import TextStream
from kiln.runtime.tokenizer import Tokenizer


class LLM:
    """An Executable (owning its KV caches) plus the tokenizer and manifest it came with."""

    def __init__(self, executable, tokenizer: Tokenizer | None = None, manifest: dict | None = None, graph=None):
        self.executable = executable
        self.tokenizer = tokenizer
        self.manifest = manifest or {}
        self.graph = graph

    @property
    def max_seq_len(self) -> int:
        return self.executable.options.max_seq_len

    @property
    def max_batch(self) -> int:
        return self.executable.options.max_batch

    # -- public API ----------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | Sequence[int] = 0, stop: str | Sequence[str] | None = None,
                 ignore_eos: bool = False, stop_token_ids: Sequence[int] = (), **sampling):
        """Generate for one prompt (-> GenerationResult) or a list of prompts (-> list of them).

        `seed` seeds each prompt's own generator (a list gives one seed per prompt), so a prompt's
        tokens do not depend on what it is batched with. `stop` strings end the text before them;
        `stop_token_ids` end it after such a token. `ignore_eos` generates exactly
        `max_new_tokens` (for benchmarks). `sampling` takes the other fields of `SamplingParams`:
        min_p, typical_p, eta, repetition_penalty, presence_penalty, frequency_penalty,
        logit_bias ({token id: bias}) and logprobs (None, or how many alternatives to return).

        `speculative` turns on speculative decoding, one prompt at a time: "prompt_lookup"
        (n-gram drafts from the context), another `LLM` compiled from a model with the same
        tokenizer (it drafts), or any `kiln.runtime.speculative.Drafter`. Greedy output is
        identical to plain decoding; the stats report acceptance and tokens per target step.
        """
        return self.stream(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, ignore_eos,
                           stop_token_ids, **sampling).results

    def stream(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | Sequence[int] = 0, stop: str | Sequence[str] | None = None,
               ignore_eos: bool = False, stop_token_ids: Sequence[int] = (), **sampling) -> TextStream:
        """Like `generate`, but yield text as it completes: str pieces for one prompt, or
        (prompt index, piece) pairs for a list; the returned stream's `.results` holds the
        GenerationResults afterwards. Bad arguments raise here, before any model call."""
        speculative = sampling.pop("speculative", None)
        params = sampling_params(temperature, top_k, top_p, sampling)
        single, batches = self._plan(prompts, max_new_tokens, params, seed, stop, ignore_eos, stop_token_ids)
        if speculative is not None:
            batches = [self._speculative(batch, speculative) for batch in batches]
            batches = [one for group in batches for one in group]
        return TextStream(batches, single)

    def chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        """Generate the assistant's reply to a conversation, using the model's chat template."""
        return self.generate(self.encode_chat(messages), **kwargs)

    def stream_chat(self, messages: list[dict], **kwargs) -> TextStream:
        """Like `chat`, streaming the reply's text."""
        return self.stream(self.encode_chat(messages), **kwargs)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The token ids of a conversation with the generation prompt appended."""
        return self._require_tokenizer().encode_chat(messages, add_generation_prompt=True)

    # -- internals -----------------------------------------------------------------------
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError("This artifact has no tokenizer. Fix: pass prompts as lists of token ids, "
                                 "or recompile from a model directory with tokenizer.json.")
        return self.tokenizer

    def _plan(self, prompts, max_new_tokens, params: SamplingParams, seed, stop, ignore_eos=False, stop_token_ids=()):
        """Validate everything up front and build the batches (not yet run)."""
        single, token_lists = self._encode_prompts(prompts)
        if max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
        for i, ids in enumerate(token_lists):
            if not ids:
                which = "The prompt" if single else f"Prompt {i}"
                raise GenerationError(f"{which} is empty. Fix: give at least one token of prompt.")
            if len(ids) > self.max_seq_len:
                raise ContextLengthError(len(ids), self.max_seq_len, None if single else i)
        seeds = [int(seed)] * len(token_lists) if isinstance(seed, (int, float)) else [int(s) for s in seed]
        if len(seeds) != len(token_lists):
            raise GenerationError(f"{len(seeds)} seeds for {len(token_lists)} prompts. Fix: give one seed per prompt.")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if stops:
            self._require_tokenizer()
        request = GenerationRequest(
            max_new_tokens=int(max_new_tokens), sampling=params, stop=stops,
            eos_ids=self.tokenizer.eos_ids if self.tokenizer and not ignore_eos else frozenset(),
            stop_token_ids=frozenset(int(t) for t in stop_token_ids))
        decoder = self.tokenizer.incremental_decoder if self.tokenizer else None
        n = self.max_batch
        batches = [BatchGeneration(self.executable, token_lists[i:i + n], request, seeds[i:i + n], decoder)
                   for i in range(0, len(token_lists), n)]
        return single, batches

    def _speculative(self, batch: BatchGeneration, speculative) -> list:
        """The rows of a planned batch as speculative generations of one prompt each."""
        from kiln.runtime.speculative import ModelDrafter, PromptLookupDrafter, SpeculativeGeneration

        def drafter():
            if speculative == "prompt_lookup":
                return PromptLookupDrafter()
            if isinstance(speculative, LLM):
                return ModelDrafter(speculative.executable)
            if hasattr(speculative, "propose") and hasattr(speculative, "feedback"):
                return speculative
            raise GenerationError(f"speculative={speculative!r:.60} is not a drafter. Fix: pass 'prompt_lookup', "
                                  "a draft LLM from kiln.load, or an object with propose() and feedback().")

        return [SpeculativeGeneration(self.executable, row.prompt, batch.request, row.seed, drafter(), batch.decoder_factory)
                for row in batch.rows]

    def _encode_prompts(self, prompts) -> tuple[bool, list[list[int]]]:
        """(whether one prompt was given, the prompts as token id lists)."""
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        if isinstance(prompts, str) or _is_token_list(prompts):
            return True, [self._encode_one(prompts)]
        if isinstance(prompts, (list, tuple)) and prompts:
            return False, [self._encode_one(p) for p in prompts]
        raise GenerationError(f"A prompt is a string or a list of token ids, got {type(prompts).__name__} "
                              f"{prompts!r:.60}. Fix: pass a str, a list of ints, or a non-empty list of those.")

    def _encode_one(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self._require_tokenizer().encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not _is_token_list(prompt):
            raise GenerationError(f"A prompt is a string or a list of token ids, got {prompt!r:.60}.")
        return [int(t) for t in prompt]


def sampling_params(temperature: float, top_k: int, top_p: float, extra: dict) -> SamplingParams:
    """SamplingParams from generate's arguments; an unknown keyword is an error naming the known ones."""
    known = set(SamplingParams.__dataclass_fields__) - {"temperature", "top_k", "top_p"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise GenerationError(f"Unknown sampling option(s) {unknown}. Fix: use the known ones: {sorted(known)}.")
    return SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), **extra)


def _is_token_list(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) and (
        len(x) > 0 or isinstance(x, list))
