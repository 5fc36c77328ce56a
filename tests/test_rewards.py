"""Reward models (`llm.reward`): a `*ForSequenceClassification` checkpoint compiled by the same
pipeline scores texts as Hugging Face's score head does (`model(**inputs).logits`, fp32, within
1e-4), and `generate(..., best_of=, reward_model=)` keeps the samples it rewards most."""

import pytest
import torch

import kiln
from kiln.frontend.checkpoint import load_model
from kiln.frontend.errors import CheckpointError
from kiln.ir.errors import OptionError
from kiln.runtime import rewards
from kiln.runtime.errors import ContextLengthError, GenerationError, TokenIdError
from tiny_models import save_tiny_reward_model

MAX_SEQ = 64
TEXTS = ["The capital of France is Paris.", "Once upon a time there was a little village by the sea, and the", "Hi"]
PAD = 2  # the tiny models' pad token (their EOS)


def compiled_reward_model(tmp_path_factory, arch: str, backend: str):
    """(the reward artifact loaded, the Hugging Face model, its tokenizer)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp(f"reward-{arch}-{backend}")
    source = save_tiny_reward_model(arch, root / "checkpoint")
    path = kiln.compile(str(source), out=root / "m.kiln", backend=backend, max_seq_len=MAX_SEQ, max_batch=2)
    model = AutoModelForSequenceClassification.from_pretrained(source, dtype=torch.float32).eval()
    return kiln.load(path), model, AutoTokenizer.from_pretrained(source)


@pytest.fixture(
    scope="module",
    params=[
        ("llama", "inductor"),
        ("qwen2", "inductor"),
        pytest.param(("qwen2", "onnxruntime"), marks=pytest.mark.slow),
    ],
    ids=lambda p: "-".join(p),
)
def reward_model(request, tmp_path_factory):
    return compiled_reward_model(tmp_path_factory, *request.param)


@pytest.fixture(scope="module")
def llama_reward(tmp_path_factory):
    return compiled_reward_model(tmp_path_factory, "llama", "reference")


@pytest.fixture(scope="module")
def policy(tiny_model_dirs, tmp_path_factory):
    path = kiln.compile(
        str(tiny_model_dirs("llama")),
        out=tmp_path_factory.mktemp("policy") / "m.kiln",
        backend="reference",
        max_seq_len=MAX_SEQ,
        max_batch=4,
    )
    return kiln.load(path)


def hf_rewards(model, ids_lists) -> list[float]:
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0, 0].item() for ids in ids_lists]


def test_rewards_of_a_batch_of_texts_equal_hugging_face_score_head(reward_model):
    llm, model, tokenizer = reward_model
    inputs = tokenizer(TEXTS, padding=True, return_tensors="pt")  # right-padded with the pad token
    assert len(set(inputs["attention_mask"].sum(-1).tolist())) == len(TEXTS)
    with torch.no_grad():
        want = model(**inputs).logits[:, 0].tolist()
    got = llm.reward(TEXTS)
    assert got == pytest.approx(want, abs=1e-4)
    assert llm.reward(TEXTS[1]) == pytest.approx(want[1], abs=1e-4)  # one text -> one float
    assert isinstance(llm.reward(TEXTS[1]), float)


def test_the_manifest_says_reward_model(reward_model, policy):
    llm, _, _ = reward_model
    assert llm.manifest["task"] == "reward" and llm.task == "reward"
    assert "task" not in policy.manifest and policy.task == "generate"
    assert llm.vocab_size == 512  # the embedding's ids, not the score head's one column


def test_trailing_pad_tokens_are_pooled_as_hugging_face_pools_them(llama_reward):
    llm, model, _ = llama_reward
    texts = [[5, 6, 7, PAD, PAD], [PAD, 9, PAD, 11], [PAD, PAD]]  # HF: last non-pad token; all pad: the first
    assert llm.reward(texts) == pytest.approx(hf_rewards(model, texts), abs=1e-4)


def test_a_conversation_is_rewarded_as_its_templated_text(llama_reward):
    llm, model, tokenizer = llama_reward
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The answer is Paris."},
    ]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    want = hf_rewards(model, [ids])[0]
    assert llm.reward(messages) == pytest.approx(want, abs=1e-4)
    assert llm.reward([text, messages]) == pytest.approx([want, want], abs=1e-4)


def test_a_text_longer_than_a_prefill_chunk_gives_the_same_reward(llama_reward, monkeypatch):
    llm, model, tokenizer = llama_reward
    monkeypatch.setattr(rewards, "REWARD_CHUNK", 5)  # the text crosses several model calls
    ids = tokenizer(TEXTS[1])["input_ids"]
    assert llm.reward(ids) == pytest.approx(hf_rewards(model, [ids])[0], abs=1e-4)


def test_bad_reward_input_is_a_clear_error(llama_reward):
    llm, _, _ = llama_reward
    with pytest.raises(GenerationError, match="The text to reward is empty"):
        llm.reward("")
    with pytest.raises(GenerationError, match="Text 1 to reward is empty"):
        llm.reward(["Hi", []])
    with pytest.raises(ContextLengthError, match="Text 0 has 70 tokens"):
        llm.reward([[5] * 70])
    with pytest.raises(TokenIdError):
        llm.reward([5, 10**6])
    with pytest.raises(GenerationError, match="reward takes a text"):
        llm.reward(3)


def test_a_reward_model_does_not_generate_and_a_causal_lm_gives_no_reward(llama_reward, policy):
    llm, _, _ = llama_reward
    for call in (
        lambda: llm.generate("Hi"),
        lambda: llm.submit("Hi"),
        lambda: llm.score("Hi", " there"),
        lambda: llm.generate("Hi", n=2),
    ):
        with pytest.raises(GenerationError, match="is a reward model .*Fix: call llm.reward"):
            call()
    with pytest.raises(GenerationError, match="is a causal LM.*no reward"):
        policy.reward("Hi")


def test_a_sequence_classifier_of_several_labels_is_refused(tmp_path):
    source = save_tiny_reward_model("llama", tmp_path / "classifier", num_labels=3)
    with pytest.raises(CheckpointError, match="3 labels is a classifier, not a reward model"):
        load_model(source)


def test_a_reward_model_is_not_sharded(tmp_path):
    source = save_tiny_reward_model("llama", tmp_path / "rm")
    with pytest.raises(OptionError, match="reward model.*Fix: compile it with tensor_parallel=1"):
        kiln.compile(str(source), out=tmp_path / "m.kiln", backend="reference", max_seq_len=MAX_SEQ, tensor_parallel=2)


SAMPLED = dict(max_new_tokens=6, temperature=1.0)
PROMPT = "The capital of France is"


def test_best_of_keeps_the_samples_the_reward_model_scores_highest(policy, llama_reward):
    reward_llm, model, tokenizer = llama_reward
    drawn = [policy.generate(PROMPT, seed=11 + j, **SAMPLED) for j in range(6)]
    scores = hf_rewards(model, [tokenizer(PROMPT + sample.text)["input_ids"] for sample in drawn])
    best = [drawn[i].token_ids for i in sorted(range(6), key=scores.__getitem__, reverse=True)[:2]]
    kept = policy.generate(PROMPT, n=2, best_of=6, seed=11, reward_model=reward_llm, **SAMPLED)
    assert [sample.token_ids for sample in kept] == best
    likeliest = policy.generate(PROMPT, n=2, best_of=6, seed=11, **SAMPLED)
    assert [sample.token_ids for sample in likeliest] != best  # the reward, not the log-probability, ranked them


def test_a_token_id_prompt_is_rewarded_with_its_special_tokens(policy, llama_reward):
    reward_llm, _, _ = llama_reward
    prompt = policy.encode_chat([{"role": "user", "content": "Hi"}])
    kept = policy.generate(prompt, n=3, seed=5, reward_model=reward_llm, **SAMPLED)  # all 3, best first
    text = policy.tokenizer.decode(prompt, skip_special_tokens=False)
    scores = reward_llm.reward([text + sample.text for sample in kept])
    assert scores == sorted(scores, reverse=True)
    assert sorted(s.token_ids for s in kept) == sorted(
        policy.generate(prompt, seed=5 + j, **SAMPLED).token_ids for j in range(3)
    )


def test_bad_reward_model_options_are_clear_errors(policy, llama_reward):
    reward_llm, _, _ = llama_reward
    with pytest.raises(GenerationError, match="pass best_of"):
        policy.generate(PROMPT, reward_model=reward_llm)
    with pytest.raises(GenerationError, match="reward_model must be a reward model"):
        policy.generate(PROMPT, n=1, best_of=2, reward_model=policy)
