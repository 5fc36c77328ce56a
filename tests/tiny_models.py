"""Tiny random-weight causal LMs, saved as local checkpoints for tests.

Every architecture Kiln claims (ARCHITECTURES, and the FAMILIES of test_architectures.py) gets a
model small enough to build in well under a second (hidden 64, 2-4 layers), with seeded weights,
saved like a real Hugging Face checkpoint: `config.json`, `model.safetensors`,
`generation_config.json`, `tokenizer.json` and `tokenizer_config.json`. All of them share one
byte-level BPE tokenizer, trained here deterministically on `TRAINING_TEXT`. `save_tiny_gguf`
writes the llama model as a GGUF file.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

ARCHITECTURES = ["gpt2", "llama", "qwen2", "mistral", "gemma3"]
# Families with their own attention or routing, tested in test_architectures.py: ALiBi (BLOOM,
# MPT), multi-query (Falcon), attention-logit soft-capping (Gemma 2), mixture of experts
# (Mixtral: softmax, top-2, renormalized; OLMoE: top-2 of 8 without renormalization).
FAMILIES = ["bloom", "mpt", "falcon", "gemma2", "mixtral", "olmoe"]

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BOS_TOKEN, EOS_TOKEN = "<|im_start|>", "<|im_end|>"
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2
MAX_POSITIONS = 128
SLIDING_WINDOW = 8  # small, so that windowed attention differs from full at length 9+
# The FAMILIES have 3 layers: the capture traces the first two (frontend/layer_templates.py) and
# copies the second, so test_architectures.py checks the copies of every family against Hugging Face.
FAMILY_LAYERS = 3

# Ten times the usual 0.02: logits spread out (std ~1.6), so greedy argmax has no near ties, and
# greedy generations vary instead of repeating one token (which would hide KV-cache bugs).
INITIALIZER_RANGE = 0.2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = """\
Once upon a time there was a little village by the sea. The people of the village were
fishermen, bakers, weavers and farmers. Every morning the fishermen sailed out before the sun
rose, and every evening they came back with boats full of silver fish. The bakers woke up in
the middle of the night to bake bread, and the smell of warm bread filled the streets.
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
The capital of Spain is Madrid. Paris is known for the Eiffel Tower, and Rome for the Colosseum.
What is the capital of France? The answer is Paris. What is two plus two? The answer is four.
A compiler translates a program written in one language into another language. A good compiler
checks the program, optimizes it, and produces fast code. Tensors are arrays of numbers with a
shape and a type. A neural network is a function made of layers, and each layer multiplies its
input by a matrix of weights, adds a bias, and applies a nonlinear activation.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore. How much wood
would a woodchuck chuck if a woodchuck could chuck wood? Peter Piper picked a peck of pickled
peppers. It was the best of times, it was the worst of times, it was the age of wisdom.
In the spring the trees turn green and the birds sing in the garden. In the summer the days are
long and warm, and children play in the fields until late. In the autumn the leaves turn red and
yellow and fall to the ground. In the winter snow covers the hills and the lakes freeze over.
The numbers one, two, three, four, five, six, seven, eight, nine and ten are small numbers.
Questions and answers: Who wrote this story? Where does the river go? Why is the sky blue?
Because sunlight scatters in the air, and blue light scatters more than red light.
"""


@functools.cache
def tokenizer_json(lacking_bytes: tuple[int, ...] = ()) -> str:
    """The shared tokenizer as `tokenizer.json` text: byte-level BPE with `VOCAB_SIZE` tokens.
    `lacking_bytes`: bytes left out of its alphabet (as real vocabularies lack bytes their
    training text never had, e.g. SmolLM2 lacks 0xF1 and 0xF2, so it cannot spell U+9D537)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=sorted(set(pre_tokenizers.ByteLevel.alphabet()) - {byte_level_char(b) for b in lacking_bytes}),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"the tiny tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}: "
            "lengthen TRAINING_TEXT or lower VOCAB_SIZE"
        )
    return tokenizer.to_str()


BYTE_FALLBACK_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2; then <0x00>..<0xFF> at 3..258


@functools.cache
def byte_fallback_tokenizer_json() -> str:
    """A Llama/Mistral-style tokenizer with `VOCAB_SIZE` tokens: sentencepiece BPE over "▁"-joined
    words, trained on `TRAINING_TEXT` (ASCII), whose other characters fall back to byte tokens
    `<0xE6>`; its decoder drops the text's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def pieces_of(tokenizer) -> Tokenizer:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        return tokenizer

    special, byte_tokens = BYTE_FALLBACK_SPECIAL_TOKENS, [f"<0x{b:02X}>" for b in range(256)]
    learner = pieces_of(Tokenizer(models.BPE(unk_token="<unk>")))
    learner.train_from_iterator(
        TRAINING_TEXT.splitlines(keepends=True),
        trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE - len(byte_tokens), min_frequency=1, special_tokens=special, show_progress=False
        ),
    )
    learned = json.loads(learner.to_str())["model"]
    pieces = sorted((t for t in learned["vocab"] if t not in special), key=learned["vocab"].get)
    vocab = {token: i for i, token in enumerate(special + byte_tokens + pieces)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tokenizer = pieces_of(Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(special)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the byte-fallback tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return tokenizer.to_str()


def byte_level_char(byte: int) -> str:
    """The character a byte-level BPE vocabulary (GPT-2's mapping) writes `byte` as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def tokenizer_config() -> dict:
    """The `tokenizer_config.json` that goes with `tokenizer_json()`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }


def tiny_config(arch: str, **overrides):
    """The transformers config of the tiny `arch` model; `overrides` replace its fields."""
    from transformers import (
        BloomConfig,
        FalconConfig,
        Gemma2Config,
        Gemma3TextConfig,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        MptConfig,
        OlmoeConfig,
        Qwen2Config,
    )

    tokens = dict(
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        initializer_range=INITIALIZER_RANGE,
    )
    decoder = dict(
        tokens,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
    )
    if arch == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=MAX_POSITIONS, **tokens)
    elif arch == "llama":  # SmolLM2's shape: GQA, RoPE, RMSNorm, SwiGLU, tied embeddings
        config = LlamaConfig(tie_word_embeddings=True, **decoder)
    elif arch == "qwen2":  # q/k/v projections carry a bias
        config = Qwen2Config(tie_word_embeddings=False, **decoder)
    elif arch == "mistral":
        config = MistralConfig(sliding_window=SLIDING_WINDOW, tie_word_embeddings=False, **decoder)
    elif arch == "gemma3":
        config = Gemma3TextConfig(
            **dict(decoder, num_hidden_layers=4),
            head_dim=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=32,  # not head_dim, so that a wrong attention scale shows
            attn_logit_softcapping=50.0,  # transformers 5.23 Gemma3 ignores this
            final_logit_softcapping=30.0,
            tie_word_embeddings=False,  # tied, the sqrt(hidden)-scaled embedding makes it echo its input
        )
    elif arch == "bloom":  # ALiBi, fused qkv, layer norm on the embeddings
        config = BloomConfig(hidden_size=64, n_layer=FAMILY_LAYERS, n_head=4, **tokens)
    elif arch == "mpt":  # ALiBi from a table of max_seq_len keys; above the compiled 128 (see README)
        config = MptConfig(
            d_model=64, n_layers=FAMILY_LAYERS, n_heads=4, expansion_ratio=2, max_seq_len=2 * MAX_POSITIONS, **tokens
        )
    elif arch == "falcon":  # multi-query: one k/v head, picked out of the fused qkv by index lists
        config = FalconConfig(
            hidden_size=64,
            num_hidden_layers=FAMILY_LAYERS,
            num_attention_heads=4,
            multi_query=True,
            new_decoder_architecture=False,
            parallel_attn=True,
            alibi=False,
            bias=False,
            max_position_embeddings=MAX_POSITIONS,
            **tokens,
        )
    elif arch == "gemma2":
        config = Gemma2Config(
            **dict(decoder, num_hidden_layers=4),  # sliding, full, sliding, full: the last is a copy
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=5.0,  # small, so that the tanh bends the tiny model's scores
            final_logit_softcapping=30.0,
        )
    elif arch == "mixtral":
        config = MixtralConfig(
            **dict(decoder, num_hidden_layers=FAMILY_LAYERS), num_local_experts=4, num_experts_per_tok=2
        )
    elif arch == "olmoe":  # q/k norms, 8 experts, top-2 weights not renormalized
        config = OlmoeConfig(
            **dict(decoder, intermediate_size=64, num_hidden_layers=FAMILY_LAYERS), num_experts=8, num_experts_per_tok=2
        )
    else:
        raise ValueError(f"no tiny model for {arch!r}; choose one of {ARCHITECTURES + FAMILIES}")
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def save_tiny_checkpoint(arch: str, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Build the tiny `arch` model with weights seeded by `seed` and save it to `out_dir`."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    model.save_pretrained(out_dir)
    (out_dir / "tokenizer.json").write_text(tokenizer_json())
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return out_dir


def save_tiny_reward_model(arch: str, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """The tiny `arch` model as a reward model (its `*ForSequenceClassification`, one label: a
    score head over the last hidden state), weights seeded by `seed`, saved to `out_dir`."""
    from transformers import AutoModelForSequenceClassification

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(
        tiny_config(arch, **{"num_labels": 1, **overrides}), dtype=torch.float32
    )
    model.save_pretrained(out_dir)
    (out_dir / "tokenizer.json").write_text(tokenizer_json())
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return out_dir


def save_tiny_gguf(llama_dir: str | Path, gguf_path: str | Path) -> Path:
    """Write the llama checkpoint at `llama_dir` as an F32 GGUF file, the way llama.cpp does.

    llama.cpp stores q/k projection rows permuted (interleaved rotary halves); transformers
    undoes that on load, so a loader that gets the permutation wrong fails a logits comparison.
    """
    import gguf
    from safetensors.torch import load_file

    llama_dir, gguf_path = Path(llama_dir), Path(gguf_path)
    config = json.loads((llama_dir / "config.json").read_text())
    weights = {name: tensor.numpy() for name, tensor in load_file(llama_dir / "model.safetensors").items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads

    writer = gguf.GGUFWriter(gguf_path, arch="llama")
    writer.add_name("kiln tiny llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer)

    def permute(rows, n_heads):  # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute
        return (
            rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
        )

    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", weights[layer + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", permute(weights[layer + "self_attn.q_proj.weight"], heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", permute(weights[layer + "self_attn.k_proj.weight"], kv_heads))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weights[layer + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", weights[layer + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", weights[layer + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights[layer + "mlp.gate_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights[layer + "mlp.up_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weights[layer + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    if not config.get("tie_word_embeddings", True):
        writer.add_tensor("output.weight", weights["lm_head.weight"])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def _add_tokenizer(writer) -> None:
    """Add the shared tokenizer to a GGUF writer as llama.cpp's `gpt2` (byte-level BPE) model."""
    import gguf

    spec = json.loads(tokenizer_json())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if token in SPECIAL_TOKENS else gguf.TokenType.NORMAL for token in tokens]
    )
    writer.add_token_merges([" ".join(pair) for pair in spec["model"]["merges"]])
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_pad_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
