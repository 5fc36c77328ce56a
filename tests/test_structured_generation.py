"""Structured generation: JSON-schema, regex and choices constraints, and fast-forward.

The fast tests run a tiny random-weight Llama (ONNX Runtime backend): its output is noise, so every
valid answer shows the constraint at work. The slow test runs 200 constrained generations from
the real SmolLM2.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import kiln
from kiln.runtime.constraint_compiler import compile_constraint
from kiln.runtime.constraint_spec import constraint_spec
from kiln.runtime.engine_batch import EngineBatch
from kiln.runtime.errors import ConstraintError
from kiln.runtime.request import GenerationSettings
from kiln.runtime.sampler import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@[a-z]{3,5}\.(com|org)"


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dirs, tmp_path_factory):
    path = kiln.compile(
        str(tiny_model_dirs("llama")),
        out=tmp_path_factory.mktemp("tiny") / "m.kiln",
        backend="onnxruntime",
        max_seq_len=128,
        max_batch=2,
    )
    return kiln.load(path)


def prompt(llm, text="Once upon a time"):
    return llm.tokenizer.encode(text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_is_valid_json_under_the_schema(tiny_llm, temperature):
    for seed in range(3):
        result = tiny_llm.generate(
            prompt(tiny_llm), max_new_tokens=100, temperature=temperature, seed=seed, json_schema=PERSON
        )
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), PERSON)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_output_matches_the_whole_pattern(tiny_llm, temperature):
    for seed in range(3):
        result = tiny_llm.generate(prompt(tiny_llm), max_new_tokens=40, temperature=temperature, seed=seed, regex=EMAIL)
        assert re.fullmatch(EMAIL, result.text), result.text


def test_choices_output_is_one_of_the_choices(tiny_llm):
    choices = ["Paris, France", "Paris, Texas", "Rome"]
    texts = {tiny_llm.generate(prompt(tiny_llm), temperature=1.0, seed=seed, choices=choices).text for seed in range(6)}
    assert texts <= set(choices)


def test_constraint_masks_sampling_but_logprobs_stay_the_models(tiny_llm):
    result = tiny_llm.generate(prompt(tiny_llm), max_new_tokens=12, temperature=1.0, regex="[0-9]{3}", logprobs=1)
    assert re.fullmatch("[0-9]{3}", result.text)
    assert all(record.logprob < 0 for record in result.logprobs)  # not the masked distribution's 0


def batch(llm, prompts, seeds, temperature=0.0, **constraint):
    """Run prompts through the engine to the end; their results."""
    spec = constraint_spec(**constraint)
    request = GenerationSettings(
        max_new_tokens=100,
        sampling=SamplingParams(temperature=temperature),
        eos_ids=llm.tokenizer.eos_ids,
        constraint=compile_constraint(llm.tokenizer, spec),
    )
    run = EngineBatch(llm.engine, prompts, request, seeds)
    for _ in run:
        pass
    return run.results()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_forward_gives_the_same_tokens_in_fewer_model_steps(tiny_llm, temperature):
    p = prompt(tiny_llm)
    (fast,) = batch(tiny_llm, [p], [3], temperature, json_schema=PERSON)
    (slow,) = batch(tiny_llm, [p], [3], temperature, json_schema=PERSON, fast_forward=False)
    assert fast.token_ids == slow.token_ids and fast.text == slow.text
    jsonschema.validate(json.loads(fast.text), PERSON)
    assert fast.stats.forced_tokens == slow.stats.forced_tokens > 0
    assert slow.stats.model_steps == len(slow.token_ids)
    assert fast.stats.model_steps < slow.stats.model_steps


def test_constrained_rows_in_a_batch_match_each_prompt_alone(tiny_llm):
    prompts = [prompt(tiny_llm), prompt(tiny_llm, "The capital of France")]
    together = batch(tiny_llm, prompts, [1, 2], 1.0, json_schema=PERSON)
    alone = [batch(tiny_llm, [p], [s], 1.0, json_schema=PERSON, fast_forward=False)[0] for p, s in zip(prompts, [1, 2])]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    for result in together:
        jsonschema.validate(json.loads(result.text), PERSON)


def test_generate_fast_forward_keeps_the_tokens(tiny_llm):
    p = prompt(tiny_llm)
    fast = tiny_llm.generate(p, max_new_tokens=100, temperature=1.0, seed=5, json_schema=PERSON)
    slow = tiny_llm.generate(p, max_new_tokens=100, temperature=1.0, seed=5, json_schema=PERSON, fast_forward=False)
    assert fast.token_ids == slow.token_ids


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(regex=r"[^\x00-\x{10FFFF}]"), "No token can continue|No output can satisfy"),
        (dict(choices=[]), "choices is empty"),
        (dict(regex="a("), "cannot be compiled"),
        (dict(json_schema="{not json"), "not valid JSON"),
        (dict(regex="a", choices=["a"]), "were both given"),
    ],
)
def test_an_impossible_or_malformed_constraint_is_reported_before_generating(tiny_llm, constraint, message):
    with pytest.raises(ConstraintError, match=message):
        tiny_llm.generate(prompt(tiny_llm), max_new_tokens=8, **constraint)


def test_a_token_the_grammar_rejects_is_an_error_not_a_loop(tiny_llm):
    constraint = compile_constraint(tiny_llm.tokenizer, constraint_spec(regex="[0-9]+")).start()
    (letter,) = tiny_llm.tokenizer.encode("x", add_special_tokens=False)
    with pytest.raises(ConstraintError, match="does not fit"):
        constraint.advance(letter)


def test_a_full_token_budget_ends_with_length_not_an_error(tiny_llm):
    result = tiny_llm.generate(prompt(tiny_llm), max_new_tokens=3, json_schema=PERSON)
    assert result.finish_reason == "length" and len(result.token_ids) == 3


# -- the real SmolLM2: 200 constrained generations ------------------------------------------
def obj(properties: dict, **extra) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
        **extra,
    }


NAME = {"type": "string", "maxLength": 24}
SCHEMES = [  # (what to ask, the constraint), 25 generations each
    (
        "Describe a fictional person: name, age and home address.",
        dict(
            json_schema=obj(
                {
                    "name": NAME,
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "address": obj({"city": NAME, "country": NAME}),
                }
            )
        ),
    ),
    (
        "Classify the sentiment of this review and rate it from 0 to 5: 'Great food, slow service.'",
        dict(
            json_schema=obj(
                {
                    "sentiment": {"enum": ["positive", "negative", "mixed"]},
                    "rating": {"type": "number", "minimum": 0, "maximum": 5},
                }
            )
        ),
    ),
    (
        "List what to buy for a pancake breakfast, with quantities.",
        dict(
            json_schema=obj(
                {
                    "items": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 3,
                        "items": obj(
                            {
                                "item": {"type": "string", "maxLength": 16},
                                "quantity": {"type": "integer", "minimum": 1, "maximum": 12},
                            }
                        ),
                    }
                }
            )
        ),
    ),
    (
        "Report today's weather in Paris.",
        dict(
            json_schema=obj(
                {
                    "temperature_c": {"type": "number", "minimum": -40, "maximum": 50},
                    "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100},
                    "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                    "windy": {"type": "boolean"},
                }
            )
        ),
    ),
    (
        "Name three primary colors.",
        dict(
            json_schema=obj(
                {
                    "colors": {
                        "type": "array",
                        "items": {"enum": ["red", "yellow", "blue", "green"]},
                        "minItems": 1,
                        "maxItems": 3,
                    }
                }
            )
        ),
    ),
    ("On what date did Apollo 11 land on the Moon? Answer as YYYY-MM-DD.", dict(regex=r"(19|20)\d\d-[01]\d-[0-3]\d")),
    ("Give a US phone number for a pizza place.", dict(regex=r"\(\d{3}\) \d{3}-\d{4}")),
    ("What is the capital of France?", dict(choices=["Paris", "London", "Berlin", "Madrid"])),
]


@pytest.fixture(scope="session")
def smollm2(smollm2_dir, tmp_path_factory):
    path = kiln.compile(
        str(smollm2_dir),
        out=tmp_path_factory.mktemp("smollm2") / "m.kiln",
        backend="onnxruntime",
        max_seq_len=256,
        max_batch=8,
    )
    return kiln.load(path)


def check(result, constraint: dict) -> None:
    if "json_schema" in constraint:
        jsonschema.validate(json.loads(result.text), constraint["json_schema"])
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], result.text), result.text
    else:
        assert result.text in constraint["choices"]


@pytest.mark.slow
def test_200_constrained_smollm2_generations_all_parse_and_validate(smollm2):
    checked = 0
    for question, constraint in SCHEMES:
        prompt = smollm2.encode_chat([{"role": "user", "content": question}])
        greedy = smollm2.generate(prompt, max_new_tokens=64, **constraint)
        # a full batch decodes forced tokens one batched step each: cheaper than a call per row
        sampled = smollm2.generate(
            [prompt] * 24, max_new_tokens=64, temperature=0.8, seed=list(range(1, 25)), fast_forward=False, **constraint
        )
        for result in [greedy, *sampled]:
            assert result.finish_reason in ("stop", "eos"), (question, result.text)
            check(result, constraint)
            checked += 1
    assert checked == 200
