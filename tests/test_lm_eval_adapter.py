"""The lm-evaluation-harness model `kiln`: its three methods equal lm-eval's own `hf` model on the
checkpoint the artifact was compiled from (a tiny random Llama; max_length 32, so long inputs are
left-truncated and rolling texts take several windows)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from lm_eval.api.instance import Instance

import kiln
from kiln.lm_eval_model import KilnLM
from tiny_models import TRAINING_TEXT

MAX_LENGTH = 32
PAIRS = [
    ("The capital of France is", " Paris"),
    ("Once upon a", " time there was a little village"),
    ("", "The quick brown fox"),
    (TRAINING_TEXT[:300], " sea shells"),
]


@pytest.fixture(scope="module")
def models(tiny_model_dirs, tmp_path_factory):
    from lm_eval.models.huggingface import HFLM

    source = tiny_model_dirs("llama")
    path = kiln.compile(
        str(source),
        out=tmp_path_factory.mktemp("lm_eval") / "model.kiln",
        backend="reference",
        max_seq_len=MAX_LENGTH,
        max_batch=2,
    )
    hf = HFLM(pretrained=str(source), device="cpu", dtype="float32", max_length=MAX_LENGTH, batch_size=1)
    return KilnLM(path=str(path)), hf


def instances(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


def test_loglikelihood_equals_hf_including_empty_and_truncated_contexts(models):
    ours, hf = models
    requests = instances("loglikelihood", PAIRS)
    for (logprob, greedy), (expected, expected_greedy) in zip(ours.loglikelihood(requests), hf.loglikelihood(requests)):
        assert logprob == pytest.approx(expected, abs=1e-3)
        assert greedy == expected_greedy


def test_loglikelihood_rolling_over_several_windows_equals_hf(models):
    ours, hf = models
    texts = [(TRAINING_TEXT[:600],), ("A short one.",)]
    assert len(ours.tok_encode(texts[0][0])) > 3 * MAX_LENGTH
    got = ours.loglikelihood_rolling(instances("loglikelihood_rolling", texts))
    assert got == pytest.approx(hf.loglikelihood_rolling(instances("loglikelihood_rolling", texts)), abs=2e-3)


def test_generate_until_equals_hf_greedy_and_stops_before_the_stop_string(models):
    ours, hf = models
    requests = instances(
        "generate_until",
        [
            ("The capital of France is", {"until": ["."], "max_gen_toks": 12}),
            ("Once upon a time", {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}),
        ],
    )
    got = ours.generate_until(requests)
    assert got == hf.generate_until(requests)
    assert all("." not in text for text in got[:1])


def test_lm_eval_finds_the_kiln_model_through_the_startup_hook():
    code = (
        "import kiln.lm_eval_plugin as p; p.install()\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('kiln').__name__, get_model('dummy').__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["KilnLM", "DummyLM"]
