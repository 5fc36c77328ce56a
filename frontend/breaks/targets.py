"""What `compile-model explain TARGET` captures: the subjects for a model, or for a user's module.

A model (Hugging Face directory or GGUF) gives three subjects:
- `forward`: the forward as people call it, with a `DynamicCache`: a prefill and decode steps,
  so the report shows the recompiles as the cache grows;
- `stateless`: the stateless forward `(tokens, positions) -> logits` that Kiln compiles;
- `generate`: `model.generate`, explained only (Kiln's runtime runs its own decode loop).
`path/to/file.py:callable` names a function returning `(module, inputs)`: inputs is a tuple of
positional arguments, a dict of keyword arguments, or a function making fresh ones (for inputs
that calls mutate and that cannot be deep-copied, like a cache holding a lock). If the keywords
hold `past_key_values` or `use_cache`, the stateless variant drops the cache and passes
`use_cache=False`.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

from ..capture import EXAMPLE_BATCH, EXAMPLE_SEQ, StatelessForward
from ..errors import KilnError
from .analysis import Subject

SECTIONS = ("forward", "stateless", "generate")
PROMPT_TOKENS = 7  # not 0/1, which Dynamo specializes
DECODE_STEPS = 2  # the second step shows the cache-growth recompile
GENERATE_TOKENS = 4
CACHE_KEYWORDS = ("past_key_values", "use_cache")


class ExplainTargetError(KilnError):
    """`compile-model explain` cannot build what it should capture from the target given."""


def load_target(target: str, sections: tuple[str, ...] = SECTIONS) -> list[Subject]:
    """The subjects to explain for `target`: a model path, or `file.py:callable`."""
    if ".py:" in target:
        module, inputs = load_module_factory(target)
        return module_subjects(module, inputs, target)
    from ..checkpoint import load_model

    return model_subjects(load_model(target).model, sections)


def model_subjects(lm: torch.nn.Module, sections: tuple[str, ...] = SECTIONS) -> list[Subject]:
    """The subjects of a Hugging Face causal LM, in `SECTIONS` order."""
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ExplainTargetError(f"Unknown section(s) {sorted(unknown)}. Fix: choose from {list(SECTIONS)}.")
    lm = lm.eval().float()
    makers = {
        "forward": forward_with_cache_subject,
        "stateless": stateless_forward_subject,
        "generate": generate_subject,
    }
    return [makers[name](lm) for name in SECTIONS if name in sections]


def _prompt(lm, length: int = PROMPT_TOKENS, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, lm.config.get_text_config().vocab_size, (batch, length), generator=generator)


def forward_with_cache_subject(lm: torch.nn.Module) -> Subject:
    """The forward as people call it: a DynamicCache, a prefill, then decode steps."""
    from transformers import DynamicCache

    prompt = _prompt(lm)

    def run(fn):
        cache = DynamicCache(config=lm.config)
        out = fn(input_ids=prompt, past_key_values=cache, use_cache=True)
        logits = out.logits
        for _ in range(DECODE_STEPS):
            out = fn(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        return logits

    stateless = StatelessForward(lm)
    positions = torch.arange(PROMPT_TOKENS).unsqueeze(0)
    return Subject(
        "forward",
        f"`model(input_ids, past_key_values=DynamicCache(), use_cache=True)`: a prefill of "
        f"{PROMPT_TOKENS} tokens, then {DECODE_STEPS} decode steps of 1 token",
        lm,
        run,
        module=lm,
        stateless=Subject("forward (stateless)", "", stateless, lambda fn: fn(prompt, positions), module=lm),
    )


def stateless_forward_subject(lm: torch.nn.Module) -> Subject:
    """What Kiln compiles: `(tokens, positions) -> logits` with no cache, at capture's example shape."""
    tokens = _prompt(lm, EXAMPLE_SEQ, EXAMPLE_BATCH)
    positions = torch.arange(EXAMPLE_SEQ).expand(EXAMPLE_BATCH, EXAMPLE_SEQ).contiguous()
    return Subject(
        "stateless forward",
        f"`(tokens, positions) -> logits` with `use_cache=False`, what Kiln compiles "
        f"(batch {EXAMPLE_BATCH}, {EXAMPLE_SEQ} tokens)",
        StatelessForward(lm),
        lambda fn: fn(tokens, positions),
        module=lm,
    )


def generate_subject(lm: torch.nn.Module) -> Subject:
    """`model.generate`, greedy; explained only: Kiln's runtime replaces it."""
    prompt = _prompt(lm)
    config = lm.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]

    def run(fn):
        return fn(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=GENERATE_TOKENS,
            do_sample=False,
            pad_token_id=pad,
        )

    return Subject(
        "generate",
        f"`model.generate(input_ids, max_new_tokens={GENERATE_TOKENS}, do_sample=False)` on a "
        f"{PROMPT_TOKENS}-token prompt",
        lm.generate,
        run,
        compiled_by_kiln=False,
        notes=[
            "Kiln does not compile `generate`: its runtime runs the decode loop (sampling, stop checks, "
            "batching) in Python around one compiled forward with a static KV cache, so none of these "
            "breaks exist in a Kiln artifact. They are what `torch.compile(model.generate)` meets."
        ],
    )


def module_subjects(module: torch.nn.Module, inputs, name: str) -> list[Subject]:
    """The subject of a user's module called with example `inputs`: a tuple, a dict of keywords,
    or a function making fresh ones."""
    module = module.eval()
    make_inputs = inputs if callable(inputs) else _copier(inputs)
    example = make_inputs()
    stateless = None
    if isinstance(example, dict) and any(k in example for k in CACHE_KEYWORDS):
        use_cache = "use_cache" in inspect.signature(module.forward).parameters

        def make_stateless():
            plain = {k: v for k, v in make_inputs().items() if k != "past_key_values"}
            return {**plain, "use_cache": False} if use_cache else plain

        stateless = Subject(f"{name} (stateless)", "", module, _caller(make_stateless), module=module)
    return [
        Subject(
            "forward",
            f"`{type(module).__name__}` called on the example inputs of `{name}`",
            module,
            _caller(make_inputs),
            module=module,
            stateless=stateless,
        )
    ]


def _copier(inputs):
    """Fresh deep copies of `inputs` (calls may mutate them, e.g. a cache object)."""
    try:
        copy.deepcopy(inputs)
    except Exception as error:  # any object may refuse copying
        raise ExplainTargetError(
            f"The example inputs cannot be copied ({error}), and calls may change them. Fix: return a "
            "function that makes fresh inputs instead: `return module, lambda: {...}`."
        ) from error
    return lambda: copy.deepcopy(inputs)


def _caller(make_inputs):
    """A workload calling `fn` once on fresh inputs."""

    def run(fn):
        fresh = make_inputs()
        return fn(**fresh) if isinstance(fresh, dict) else fn(*fresh)

    return run


def load_module_factory(spec: str):
    """Import `path/to/file.py`, call its `callable`, check it returned `(module, inputs)`."""
    path_text, _, attribute = spec.rpartition(":")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ExplainTargetError(f"No such file: '{path}'. Fix: pass `path/to/file.py:callable` with an existing file.")
    name = "kiln_explain_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(name, path)
    code = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = code  # dataclasses and pickling look the module up by name
    module_spec.loader.exec_module(code)
    factory = getattr(code, attribute, None)
    if not callable(factory):
        raise ExplainTargetError(
            f"'{path}' has no callable `{attribute}`. Fix: name a function defined there "
            "that returns `(module, inputs)`."
        )
    result = factory()
    if not (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], torch.nn.Module)
        and (isinstance(result[1], (tuple, list, dict)) or callable(result[1]))
    ):
        raise ExplainTargetError(
            f"`{attribute}()` in '{path}' returned {type(result).__name__}, not `(module, inputs)`. Fix: return the "
            "nn.Module and its example inputs: a tuple of positional arguments, a dict of keyword arguments, "
            "or a function making them."
        )
    module, inputs = result
    return module, tuple(inputs) if isinstance(inputs, list) else inputs
