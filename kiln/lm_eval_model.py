"""The lm-evaluation-harness model `kiln`: score and generate with a compiled Kiln artifact.

    lm_eval --model kiln --model_args path=model.kiln --tasks TASK [--limit N]

(registered by kiln/lm_eval_plugin.py). Tokenization follows lm-eval's own `hf` model (the same
context/continuation split, the same rolling windows, left truncation to the context), so scores
are comparable with `--model hf` on the checkpoint the artifact was compiled from.

Scoring runs each context+continuation as one prefill from position 0 (`executable.run` returns
logits for every position), several rows per call up to the artifact's max_batch; generation runs
through `LLM.generate`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from kiln.runtime.errors import GenerationError

log = logging.getLogger(__name__)

# Logits come back for every position: bound one call's logits to this many floats (512 MiB).
LOGITS_BUDGET = 128 * 1024 * 1024
# generate_until keywords that map onto LLM.generate's; anything else is ignored with a warning.
GENERATION_KEYWORDS = {"temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty", "seed"}


class KilnLM(TemplateLM):
    """lm-eval's LM interface over a Kiln artifact (`path=`) or an already loaded `LLM` (`llm=`)."""

    def __init__(
        self,
        path: str | None = None,
        llm=None,
        batch_size: int | str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        check_hashes: bool = True,
        **ignored,
    ):
        super().__init__()
        if (path is None) == (llm is None):
            raise GenerationError(
                "The kiln lm-eval model needs exactly one artifact. Fix: pass --model_args path=PATH/TO/model.kiln."
            )
        if llm is None:
            import kiln

            llm = kiln.load(path, check_hashes=_as_bool(check_hashes))
        if llm.tokenizer is None:
            raise GenerationError(
                "This artifact has no tokenizer, and lm-eval tasks are text. "
                "Fix: recompile from a model directory with tokenizer.json."
            )
        for name in sorted(set(ignored) - {"device", "max_batch_size"}):
            log.warning("kiln lm-eval model: ignoring model argument %s=%r", name, ignored[name])
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self._max_length = min(int(max_length), llm.max_seq_len) if max_length else llm.max_seq_len
        self._max_gen_toks = int(max_gen_toks)
        self._rows = llm.max_batch if batch_size in (None, "auto") else max(1, min(int(batch_size), llm.max_batch))
        self._eot = _special_id(self.tokenizer, "eos_token")
        if self._eot is None:
            self._eot = min(self.tokenizer.eos_ids) if self.tokenizer.eos_ids else 0
        self._device = "cpu"

    # -- what TemplateLM asks of a model ---------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context is conditioned on: BOS when the tokenizer has one, like `hf`."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.manifest.get("source", "kiln")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids as `hf` makes them: the tokenizer's own special tokens, unless the text already
        starts with BOS."""
        if add_special_tokens is None:
            bos = self.tokenizer.special_tokens.get("bos_token")
            add_special_tokens = not (bos and string.startswith(bos))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether greedy decoding would produce it) per
        (key, context ids, continuation ids), left-truncated to max_length like `hf`."""
        rows = []
        for _, context, continuation in requests:
            if not continuation or len(continuation) > self._max_length:
                raise GenerationError(
                    f"A continuation of {len(continuation)} tokens cannot be scored in max_length="
                    f"{self._max_length}. Fix: compile the artifact with a longer --max-seq-len."
                )
            whole = (list(context) + list(continuation))[-(self._max_length + 1) :]
            rows.append((whole[:-1], whole[-len(continuation) :]))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        progress = tqdm(total=len(rows), disable=disable_tqdm, desc="kiln: scoring")
        for batch in self._batches(order, [len(r[0]) for r in rows]):
            for i, scored in zip(batch, self._score_batch([rows[i] for i in batch])):
                results[i] = scored
                key = requests[i][0]
                if key is not None:  # rolling windows have no key: they are cached per document
                    self.cache_hook.add_partial("loglikelihood", key, scored)
            progress.update(len(batch))
        progress.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, scored in windows of max_length tokens (as `hf`:
        the first window starts after the prefix token, later ones condition on what came before)."""
        totals = []
        for (text,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="kiln: rolling windows"):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length,
                    context_len=1,
                )
            ]
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            totals.append(sum(logprob for logprob, _ in scored))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), totals[-1])
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until a stop string, EOS or max_gen_toks; requests with the same
        generation settings go to the engine together."""
        args = [r.args for r in requests]
        results: list[str | None] = [None] * len(args)
        groups: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(repr(sorted(gen_kwargs.items())), []).append(i)
        progress = tqdm(total=len(args), disable=disable_tqdm, desc="kiln: generating")
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(args[indices[0]][1], self._max_gen_toks)
            eos_text = self.tokenizer.decode([self._eot], skip_special_tokens=False)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            context_room = self._max_length - max_new
            if context_room <= 0:
                raise GenerationError(
                    f"max_gen_toks={max_new} leaves no room for a context in max_length="
                    f"{self._max_length}. Fix: lower max_gen_toks or compile a longer context."
                )
            prompts = [self.tok_encode(args[i][0])[-context_room:] or [self.prefix_token_id] for i in indices]
            outputs = self.llm.generate(
                prompts, max_new_tokens=max_new, stop=[s for s in until if s], **_generation_settings(kwargs)
            )
            for i, output in zip(indices, outputs):
                results[i] = postprocess_generated_text(output.text, until, None)
                self.cache_hook.add_partial("generate_until", args[i], results[i])
            progress.update(len(indices))
        progress.close()
        return results

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation under the artifact's chat template (--apply_chat_template)."""
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt)

    # -- internals -------------------------------------------------------------------------------
    def _batches(self, order: list[int], lengths: list[int]) -> Iterable[list[int]]:
        """Consecutive rows of `order`, at most the artifact's max_batch (and the logits budget) per call."""
        vocab = self.tokenizer.vocab_size
        batch: list[int] = []
        for i in order:
            longest = max([lengths[j] for j in batch] + [lengths[i]])
            if batch and (len(batch) == self._rows or (len(batch) + 1) * longest * vocab > LOGITS_BUDGET):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def _executable(self):
        """The executable, held alone: the engine waits, and forgets the prefixes this overwrites."""
        engine = getattr(self.llm, "engine", None)
        return engine.exclusive() if engine is not None else contextlib.nullcontext(self.llm.executable)

    def _score_batch(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Right-pad the inputs into one prefill call; padding only writes cache slots no real query reads."""
        width = max(len(inputs) for inputs, _ in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.int64)
        for b, (inputs, _) in enumerate(rows):
            tokens[b, : len(inputs)] = torch.tensor(inputs)
        positions = torch.arange(width).expand(len(rows), width).contiguous()
        with torch.no_grad(), self._executable() as executable:
            logits = executable.run(tokens, positions)
        scored = []
        for b, (inputs, continuation) in enumerate(rows):
            tail = logits[b, len(inputs) - len(continuation) : len(inputs)].float()
            log_probs = torch.log_softmax(tail, dim=-1)
            target = torch.tensor(continuation)
            logprob = float(log_probs.gather(-1, target[:, None]).sum())
            scored.append((logprob, bool((tail.argmax(-1) == target).all())))
        return scored


def _generation_settings(kwargs: dict) -> dict:
    """LLM.generate keywords from lm-eval's normalized generation kwargs (greedy unless do_sample)."""
    settings = {k: kwargs[k] for k in GENERATION_KEYWORDS if k in kwargs}
    if not kwargs.get("do_sample"):
        settings["temperature"] = 0.0
    for name in sorted(set(kwargs) - GENERATION_KEYWORDS - {"do_sample"}):
        log.warning("kiln lm-eval model: ignoring generation setting %s=%r", name, kwargs[name])
    return settings


def _special_id(tokenizer, name: str) -> int | None:
    """The id of a special token named in tokenizer_config (e.g. eos_token), if it is one token."""
    text = tokenizer.special_tokens.get(name)
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    return ids[0] if len(ids) == 1 else None


def _as_bool(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() not in ("0", "false", "no")
