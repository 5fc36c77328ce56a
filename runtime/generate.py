"""`LLM`: a loaded artifact that generates text.

    llm = kiln.load("model.kiln")
    llm.generate("Once upon a time", max_new_tokens=32).text
    for piece in llm.stream("Once upon a time"): print(piece, end="")
    llm.chat([{"role": "user", "content": "Hi!"}]).text

A prompt is a string or a list of token ids. Every request runs through the continuous-batching
`Engine` (engine.py): a list of prompts shares the compiled `max_batch` KV rows, each prompt
admitted as a row frees, and `llm.submit` queues requests from any thread or event loop.
Context policy: a prompt longer than the compiled max_seq_len raises `ContextLengthError`; a
prompt that fits but leaves too little room for max_new_tokens has its new tokens clamped to
what fits (the result says so: finish_reason "context", stats.clamped).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import torch

from kiln.runtime.bad_words import resolve_bad_words
from kiln.runtime.constraint_compiler import pop_constraint
from kiln.runtime.drafters import StoredHeads, engine_drafter, lone_drafter
from kiln.runtime.engine import Engine
from kiln.runtime.engine_batch import EngineBatch, Exclusive
from kiln.runtime.errors import ContextLengthError, GenerationError, TokenizerError
from kiln.runtime.request import GenerationSettings
from kiln.runtime.request_handle import RequestHandle
from kiln.runtime.results import GenerationResult
from kiln.runtime.rewards import check_reward_ids, reward_of
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.samples import generate_samples
from kiln.runtime.scoring import TokenScores, score_tokens
from kiln.runtime.search import pop_search, search_generations
from kiln.runtime.text_stream import TextStream
from kiln.runtime.token_ids import check_token_ids, check_token_set, model_vocab_size
from kiln.runtime.tokenizer import Tokenizer

SEED_LIMIT = 2**63  # seeds are 0 <= seed < 2**63, what every int64 generator takes


class LLM:
    """An Executable (owning its KV caches) plus the tokenizer and manifest it came with."""

    def __init__(
        self, executable, tokenizer: Tokenizer | None = None, manifest: dict | None = None, graph=None, directory=None
    ):
        self.executable = executable
        self.tokenizer = tokenizer
        self.manifest = manifest or {}
        self.graph = graph
        self.directory = directory  # the artifact's, where its draft heads are (None: built in memory)
        self._engine: Engine | None = None
        self.heads = StoredHeads(directory, self.manifest, graph)  # draft heads, loaded on first use

    @property
    def engine(self) -> Engine:
        """The continuous-batching scheduler over this executable's KV rows (made on first use)."""
        if self._engine is None or self._engine.executable is not self.executable:
            decoder = self.tokenizer.incremental_decoder if self.tokenizer else None
            self._engine = Engine(self.executable, decoder, vocab_size=self.vocab_size)
        return self._engine

    @property
    def vocab_size(self) -> int | None:
        """How many token ids the model takes (valid ids are 0 .. vocab_size - 1)."""
        if self.task == "reward":  # its output is one score per position, not a logit per id
            return self._model_meta.get("vocab_size") or (self.tokenizer.vocab_size if self.tokenizer else None)
        return model_vocab_size(self.executable, self.graph, self.tokenizer)

    @property
    def task(self) -> str:
        """ "generate" for a causal LM, "reward" for a reward model (its manifest says so)."""
        return (
            "reward"
            if self.manifest.get("task") == "reward" or self._model_meta.get("task") == "reward"
            else "generate"
        )

    @property
    def _model_meta(self) -> dict:
        graph = self.graph if self.graph is not None else getattr(self.executable, "graph", None)
        return getattr(graph, "meta", {}).get("model", {})

    @property
    def max_seq_len(self) -> int:
        return self.executable.options.max_seq_len

    @property
    def max_batch(self) -> int:
        return self.executable.options.max_batch

    # -- public API ----------------------------------------------------------------------
    def generate(
        self,
        prompts,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | Sequence[int] = 0,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        **sampling,
    ):
        """Generate for one prompt (-> GenerationResult) or a list of prompts (-> list of them).

        `seed` seeds each prompt's own generator (a list gives one seed per prompt), so a prompt's
        tokens do not depend on what it is batched with. `stop` strings end the text before them;
        `stop_token_ids` end it after such a token. `ignore_eos` generates exactly
        `max_new_tokens` (for benchmarks). `sampling` takes the other fields of `SamplingParams`:
        min_p, typical_p, eta, repetition_penalty, presence_penalty, frequency_penalty,
        logit_bias ({token id: bias}), logprobs (None, or how many alternatives to return),
        min_tokens (no EOS or stop token before that many) and bad_words (words or token id
        lists never generated, runtime/bad_words.py).

        `num_beams` (with length_penalty, early_stopping, num_return_sequences) runs beam search
        (runtime/beam_search.py), `penalty_alpha` with `top_k` contrastive search
        (runtime/contrastive_search.py), both as Hugging Face defines them, one prompt at a time.

        `speculative` turns on speculative decoding: inside the engine, where a list of prompts
        speculates side by side and drafts are token trees where the backend verifies them,
        "prompt_lookup" (n-gram drafts from each request's context) or "heads" (the draft heads
        `kiln train-speculator` stored in the artifact; "heads:mlp" or "heads:medusa" picks a
        kind) or "heads+lookup" (both, merged into one tree a step); or, one prompt at a time
        holding the executable alone, another `LLM` compiled from a model with the same tokenizer
        (it drafts), or any `kiln.runtime.speculative.Drafter`.
        Greedy output is identical to plain decoding; the stats report acceptance and tokens per
        target step.

        Structured output (one of): `json_schema` (a dict, JSON text or pydantic model class; the
        output is compact JSON valid under it), `regex` (the whole output matches it), `choices`
        (the output is one of these strings). Tokens the grammar forces are appended without
        sampling and fed several to a model call (`fast_forward=False` feeds them one call each,
        same output); the output ends (finish_reason "stop") when the grammar admits nothing
        more. A malformed or unsatisfiable constraint raises ConstraintError.

        `n` samples per prompt (given, even 1: a list of results per prompt), `best_of` draws that
        many and keeps the n likeliest; the prompt is prefilled once for all (runtime/samples.py).
        `reward_model` (a reward artifact from kiln.load) ranks the samples by its reward of prompt
        + sample text instead, highest first: the best `n` of `best_of` by reward.
        """
        n, best_of = sampling.pop("n", None), sampling.pop("best_of", None)
        reward_model = sampling.pop("reward_model", None)
        if reward_model is not None and n is None and best_of is None:
            raise GenerationError(
                "reward_model ranks the samples of n / best_of, and none were asked for. Fix: "
                "pass best_of (e.g. best_of=4) to keep the best by reward."
            )
        if n is not None or best_of is not None or reward_model is not None:
            return generate_samples(
                self,
                prompts,
                1 if n is None else n,
                best_of,
                seed,
                dict(
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    stop=stop,
                    ignore_eos=ignore_eos,
                    stop_token_ids=stop_token_ids,
                    **sampling,
                ),
                reward_model,
            )
        return self.stream(
            prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, stop_token_ids, **sampling
        ).results

    def stream(
        self,
        prompts,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | Sequence[int] = 0,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        **sampling,
    ) -> TextStream:
        """Like `generate`, but yield text as it completes: str pieces for one prompt, or
        (prompt index, piece) pairs for a list; the returned stream's `.results` holds the
        GenerationResults afterwards. Bad arguments raise here, before any model call."""
        speculative = sampling.pop("speculative", None)
        search = pop_search(sampling)
        resolve_bad_words(self.tokenizer, sampling)
        constraint = pop_constraint(self.tokenizer, sampling)
        params = sampling_params(temperature, top_k, top_p, sampling)
        single, token_lists, settings, seeds = self._plan(
            prompts, max_new_tokens, params, seed, stop, ignore_eos, stop_token_ids, constraint
        )
        if search is not None:
            return TextStream(
                search_generations(self, token_lists, settings, seeds, search, speculative, constraint), single
            )
        if speculative is not None and constraint is not None:
            raise GenerationError(
                "speculative decoding does not take json_schema, regex or choices. Fix: drop "
                "one of them (forced tokens already skip decode steps without a drafter)."
            )
        engine_drafter = self.engine_drafter(speculative)
        if engine_drafter is not None:  # drafts from each request's own context or heads: inside the engine
            settings = dataclasses.replace(settings, drafter_factory=engine_drafter)
        elif speculative is not None:
            return TextStream(self._speculative(token_lists, settings, seeds, speculative), single)
        return TextStream([EngineBatch(self.engine, token_lists, settings, seeds)], single)

    def submit(
        self,
        prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        **sampling,
    ) -> RequestHandle:
        """Queue one prompt on the engine and return at once: iterate the handle (or `async for`)
        for its text, `handle.result()` (or `await handle.wait()`) for its GenerationResult,
        `handle.cancel()` to stop it. Same keywords as `generate`; `speculative` takes
        the drafters that run inside the engine ("prompt_lookup", "heads", "heads+lookup"). Bad
        arguments raise here; a full queue raises QueueFullError."""
        speculative = sampling.pop("speculative", None)
        resolve_bad_words(self.tokenizer, sampling)
        constraint = pop_constraint(self.tokenizer, sampling)
        params = sampling_params(temperature, top_k, top_p, sampling)
        single, token_lists, settings, seeds = self._plan(
            prompt, max_new_tokens, params, seed, stop, ignore_eos, stop_token_ids, constraint
        )
        if not single:
            raise GenerationError("submit takes one prompt. Fix: call it once per prompt (or use generate for a list).")
        if speculative is not None:
            engine_drafter = self.engine_drafter(speculative)
            if engine_drafter is None:
                raise GenerationError(
                    f"submit drafts by prompt lookup or heads only, got speculative={speculative!r:.60}. "
                    "Fix: pass 'prompt_lookup', 'heads' or 'heads+lookup', or use generate for the other drafters."
                )
            if constraint is not None:
                raise GenerationError(
                    "speculative decoding does not take json_schema, regex, choices or grammar. Fix: "
                    "drop one of them (forced tokens already skip decode steps without a drafter)."
                )
            settings = dataclasses.replace(settings, drafter_factory=engine_drafter)
        return self.engine.submit(token_lists[0], settings, seeds[0])

    def chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        """Generate the assistant's reply to a conversation, using the model's chat template."""
        return self.generate(self.encode_chat(messages), **kwargs)

    def stream_chat(self, messages: list[dict], **kwargs) -> TextStream:
        """Like `chat`, streaming the reply's text."""
        return self.stream(self.encode_chat(messages), **kwargs)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The token ids of a conversation with the generation prompt appended."""
        return self._require_tokenizer().encode_chat(messages, add_generation_prompt=True)

    def score(self, prompt, continuation, top_n: int = 0) -> TokenScores:
        """The log-probability of each token of `continuation` after `prompt` (runtime/scoring.py):
        `.token_logprobs`, `.total`, and with `top_n` the likeliest alternatives per token. Text
        is tokenized as the prompt of `generate` (special tokens added) and the continuation without
        special tokens; or pass token id lists. Waits until no other request runs."""
        self._require_generator()
        prompt_ids = self._encode_one(prompt)
        continuation_ids = (
            self._require_tokenizer().encode(continuation, add_special_tokens=False)
            if isinstance(continuation, str)
            else self._encode_one(continuation)
        )
        check_token_ids(prompt_ids, self.vocab_size, "the prompt")
        check_token_ids(continuation_ids, self.vocab_size, "the continuation")
        with self.engine.exclusive() as executable:
            return score_tokens(executable, prompt_ids, continuation_ids, top_n)

    def reward(self, texts):
        """A reward model's scalar reward of one text (-> float) or of a list of texts (-> list of
        floats), as Hugging Face's sequence classifier scores them (runtime/rewards.py). A text is
        a str (tokenized with special tokens, as `tokenizer(text)` does: an already-templated
        conversation is just text), a list of token ids, or a conversation (a list of message
        dicts, rendered by the chat template without a generation prompt). Waits until no other
        request runs."""
        if self.task != "reward":
            raise GenerationError(
                "This artifact is a causal LM: it generates and scores tokens but gives no reward. "
                "Fix: compile a reward model (a *ForSequenceClassification checkpoint with one "
                "label) and call reward on it; llm.score(prompt, continuation) gives "
                "log-probabilities."
            )
        single, id_lists = self._reward_inputs(texts)
        for i, ids in enumerate(id_lists):
            check_reward_ids(ids, self.max_seq_len, None if single else i)
            check_token_ids(ids, self.vocab_size, "the text" if single else f"text {i}")
        pad = self._model_meta.get("pad_token_id")
        with self.engine.exclusive() as executable:
            rewards = [reward_of(executable, ids, pad) for ids in id_lists]
        return rewards[0] if single else rewards

    # -- internals -----------------------------------------------------------------------
    def _require_generator(self) -> None:
        if self.task == "reward":
            source = self._model_meta.get("architecture", "a sequence classifier")
            raise GenerationError(
                f"This artifact is a reward model ({source}): it scores whole texts and does not "
                "generate. Fix: call llm.reward(texts), or load an artifact compiled from a causal "
                "LM to generate."
            )

    def _reward_inputs(self, texts) -> tuple[bool, list[list[int]]]:
        """(whether one text was given, the texts' token ids): str, token ids or a conversation each."""

        def one(text) -> list[int]:
            if _is_conversation(text):
                return self._require_tokenizer().encode_chat(list(text), add_generation_prompt=False)
            return self._encode_one(text)

        if isinstance(texts, str) or _is_token_list(texts) or _is_conversation(texts):
            return True, [one(texts)]
        if isinstance(texts, (list, tuple)) and texts:
            return False, [one(text) for text in texts]
        raise GenerationError(
            f"reward takes a text, a list of token ids or a conversation, or a non-empty list of "
            f"those; got {texts!r:.60}."
        )

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError(
                "This artifact has no tokenizer. Fix: pass prompts as lists of token ids, "
                "or recompile from a model directory with tokenizer.json."
            )
        return self.tokenizer

    def _plan(
        self,
        prompts,
        max_new_tokens,
        params: SamplingParams,
        seed,
        stop,
        ignore_eos=False,
        stop_token_ids=(),
        constraint=None,
    ):
        """Validate everything up front: (whether one prompt was given, the prompts' token ids,
        the request, one seed per prompt)."""
        self._require_generator()
        single, token_lists = self._encode_prompts(prompts)
        if max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
        vocab_size = self.vocab_size
        for i, ids in enumerate(token_lists):
            if not ids:
                which = "The prompt" if single else f"Prompt {i}"
                raise GenerationError(f"{which} is empty. Fix: give at least one token of prompt.")
            if len(ids) > self.max_seq_len:
                raise ContextLengthError(len(ids), self.max_seq_len, None if single else i)
            check_token_ids(ids, vocab_size, "the prompt" if single else f"prompt {i}")
        seeds = _seeds(seed, len(token_lists))
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if stops:
            self._require_tokenizer()
        stop_ids = [int(t) for t in stop_token_ids]
        check_token_ids(stop_ids, vocab_size, "stop_token_ids")
        check_token_set((token for token, _ in params.logit_bias), vocab_size, "logit_bias")
        settings = GenerationSettings(
            max_new_tokens=int(max_new_tokens),
            sampling=params,
            stop=stops,
            eos_ids=self.tokenizer.eos_ids if self.tokenizer and not ignore_eos else frozenset(),
            stop_token_ids=frozenset(stop_ids),
            constraint=constraint,
        )
        return single, token_lists, settings, seeds

    def _speculative(self, token_lists, settings, seeds, speculative) -> list:
        """Speculative generations of one prompt each, holding the executable alone while they run."""
        from kiln.runtime.speculative import SpeculativeGeneration

        decoder = self.tokenizer.incremental_decoder if self.tokenizer else None
        return [
            Exclusive(
                self.engine,
                SpeculativeGeneration(
                    self.executable,
                    prompt,
                    settings,
                    seed,
                    lone_drafter(speculative, LLM),
                    decoder,
                    vocab_size=self.vocab_size,
                ),
            )
            for prompt, seed in zip(token_lists, seeds)
        ]

    def engine_drafter(self, speculative):
        """A factory of per-request drafters for the engine ("prompt_lookup", "heads[:KIND]",
        "heads[:KIND]+lookup"), or
        None for the drafters that run alone (runtime/drafters.py)."""
        return engine_drafter(speculative, self.heads)

    def _encode_prompts(self, prompts) -> tuple[bool, list[list[int]]]:
        """(whether one prompt was given, the prompts as token id lists)."""
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        if isinstance(prompts, str) or _is_token_list(prompts):
            return True, [self._encode_one(prompts)]
        if isinstance(prompts, (list, tuple)) and prompts:
            return False, [self._encode_one(p) for p in prompts]
        raise GenerationError(
            f"A prompt is a string or a list of token ids, got {type(prompts).__name__} "
            f"{prompts!r:.60}. Fix: pass a str, a list of ints, or a non-empty list of those."
        )

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


def _seeds(seed, count: int) -> list[int]:
    """One seed per prompt from `seed` (one for all, or a sequence), each 0 <= seed < 2**63."""
    try:
        given = [seed] * count if isinstance(seed, (numbers.Number, str)) else list(seed)
    except TypeError:  # not a sequence: refused below as a seed
        given = [seed] * count
    if len(given) != count:
        raise GenerationError(f"{len(given)} seeds for {count} prompts. Fix: give one seed per prompt.")
    for value in given:
        if not _is_seed(value):
            raise GenerationError(f"seed must be an integer in [0, 2**63), got {value!r:.40}. Fix: pass e.g. seed=0.")
    return [int(value) for value in given]


def _is_seed(value) -> bool:
    try:
        whole = int(value) == value  # ints, integral floats, numpy integers
    except (TypeError, ValueError, OverflowError):  # None, nan, inf, ...
        return False
    return whole and not isinstance(value, bool) and 0 <= value < SEED_LIMIT


def _is_conversation(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)


def _is_token_list(x) -> bool:
    return (
        isinstance(x, (list, tuple))
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        and (len(x) > 0 or isinstance(x, list))
    )
