"""Draft heads: the hidden state solved from logits, training, drafting, and the heads file's checks."""

import json
import os
import shutil

import pytest
import torch

import kiln
from kiln.runtime.errors import ArtifactError
from kiln.runtime.last_hidden import HiddenFromLogits, SpeculatorError, output_head
from kiln.runtime.speculator_heads import build_heads, heads_file
from kiln.speculator_data import frequency_ranking
from kiln.train_speculator import TrainConfig, train_speculator, work_dir
from tiny_models import TRAINING_TEXT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [
    "Tell me about the village.",
    "What is the capital of France?",
    "Count from one to ten.",
    "Describe the seasons.",
]
TEXTS = [TRAINING_TEXT[:600]]
CONFIG = TrainConfig(stages=3, draft_vocab=256, steps=240, batch=32, lr=3e-3, text_fraction=0.2, reply_tokens=32)


@pytest.fixture(scope="module")
def artifact(tiny_model_dirs, tmp_path_factory):
    """A tiny llama artifact (reference backend) and a copy of it with trained mlp heads."""
    root = tmp_path_factory.mktemp("heads")
    plain = kiln.compile(
        str(tiny_model_dirs("llama")), out=root / "plain.kiln", backend="reference", max_seq_len=128, max_batch=1
    )
    trained = root / "trained.kiln"
    shutil.copytree(plain, trained)
    lines = []
    summary = train_speculator(
        kiln.load(trained), trained, CONFIG, prompts=PROMPTS, texts=TEXTS, report=lines.append, log_every=40
    )
    return plain, trained, summary, lines


def test_hidden_state_solved_from_logits_rebuilds_every_logit(artifact):
    llm = kiln.load(artifact[0])
    head = output_head(llm.graph)
    logits = llm.executable.run(torch.tensor([[5, 9, 14, 3]]), torch.arange(4)[None])[0]
    to_hidden = HiddenFromLogits.for_head(head, frequency_ranking([[5, 9, 14, 3]], head.weight.shape[0]))
    assert to_hidden.relative_error(head, logits) < 1e-4


def test_soft_capped_logits_are_refused_by_name():
    from kiln.ir import Graph, TensorType  # logits from tanh, as Gemma 2's soft cap makes them

    graph = Graph()
    x = graph.add_input("x", TensorType("f32", (1, 4)))
    graph.outputs = [graph.call("tanh", x)]
    with pytest.raises(SpeculatorError, match="soft-capped"):
        output_head(graph)


def test_training_lowers_the_loss_and_reports_progress_with_an_eta(artifact):
    _, trained, summary, lines = artifact
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == CONFIG.steps // 40 and all("ETA" in line for line in steps)
    first, last = (float(line.split("loss ")[1].split()[0]) for line in (steps[0], steps[-1]))
    assert last < 0.7 * first
    manifest = json.loads((trained / "manifest.json").read_text())
    entry = manifest["speculators"]["mlp"]
    assert entry["file"] == heads_file("mlp") and heads_file("mlp") in manifest["files"]
    assert entry["training"]["stage_accuracy"] == summary["stage_accuracy"]
    assert 0 <= summary["accepted_per_draft"] <= CONFIG.stages


def test_trained_heads_keep_greedy_output_and_beat_untrained_heads(artifact, tmp_path):
    plain, trained, _, _ = artifact
    llm = kiln.load(trained)
    prompts = [llm.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    expected = [r.token_ids for r in kiln.load(plain).generate(prompts, max_new_tokens=24)]
    results = [llm.generate(p, max_new_tokens=24, speculative="heads") for p in prompts]
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.target_steps and r.stats.drafted_tokens for r in results)
    untrained = tmp_path / "untrained.kiln"
    shutil.copytree(plain, untrained)
    shutil.copytree(work_dir(trained), work_dir(untrained))  # the same corpus, collected once
    train_speculator(
        kiln.load(untrained),
        untrained,
        CONFIG.__class__(**{**CONFIG.__dict__, "steps": 1, "lr": 1e-9}),
        prompts=PROMPTS,
        texts=TEXTS,
        report=lambda line: None,
    )
    baseline = [kiln.load(untrained).generate(p, max_new_tokens=24, speculative="heads") for p in prompts]
    assert [r.token_ids for r in baseline] == expected
    rate = sum(r.stats.accepted_tokens for r in results) / sum(r.stats.drafted_tokens for r in results)
    base = sum(r.stats.accepted_tokens for r in baseline) / sum(r.stats.drafted_tokens for r in baseline)
    assert rate > base + 0.1
    assert sum(r.stats.tokens_per_target_step for r in results) > sum(r.stats.tokens_per_target_step for r in baseline)


def test_medusa_heads_beside_mlp_heads_keep_greedy_output(artifact, tmp_path):
    plain, trained, _, _ = artifact
    both = tmp_path / "both.kiln"
    shutil.copytree(trained, both)
    shutil.copytree(work_dir(trained), work_dir(both))
    config = TrainConfig(**{**CONFIG.__dict__, "kind": "medusa", "steps": 60, "head": "tied"})
    summary = train_speculator(kiln.load(both), both, config, prompts=PROMPTS, texts=TEXTS, report=lambda line: None)
    assert sorted(json.loads((both / "manifest.json").read_text())["speculators"]) == ["medusa", "mlp"]
    assert summary["config"]["kind"] == "medusa"
    llm = kiln.load(both)
    prompt = llm.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    expected = kiln.load(plain).generate(prompt, max_new_tokens=20).token_ids
    for kind in ("heads:medusa", "heads:mlp", "heads"):
        result = llm.generate(prompt, max_new_tokens=20, speculative=kind)
        assert result.token_ids == expected and result.stats.drafted_tokens > 0


def test_eagle_heads_learn_keep_greedy_output_beat_untrained_ones_and_check_their_file(artifact, tmp_path, monkeypatch):
    """A decoder layer over (state, next token's embedding), read out through the model's final
    norm and lm_head, attending over the whole context (trained on whole sequences): its loss
    falls, its drafts keep greedy output and are accepted more often than an untrained layer's;
    every earlier position's state is in the draft cache when a draft starts (the prompt's and
    the accepted tokens', but for a prompt prefix the engine copied); a damaged file is an ArtifactError."""
    from kiln.runtime.eagle_context import DraftCache

    seeded = []
    seed = DraftCache.seed
    monkeypatch.setattr(
        DraftCache,
        "seed",
        lambda self, context: (seed(self, context), seeded.append((self.length, self.end)))[0],
    )
    plain, trained, _, _ = artifact
    llm_plain = kiln.load(plain)
    prompts = [llm_plain.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    expected = [r.token_ids for r in llm_plain.generate(prompts, max_new_tokens=24)]
    eagle = TrainConfig(**{**CONFIG.__dict__, "kind": "eagle", "head": "tied", "steps": 160, "context": "whole"})
    rates = {}
    for name, config in (("untrained", {**eagle.__dict__, "steps": 1, "lr": 1e-9}), ("trained", eagle.__dict__)):
        copy = tmp_path / f"{name}.kiln"
        shutil.copytree(plain, copy)
        shutil.copytree(work_dir(trained), work_dir(copy))  # the same corpus, collected once
        lines = []
        train_speculator(
            kiln.load(copy),
            copy,
            TrainConfig(**config),
            prompts=PROMPTS,
            texts=TEXTS,
            report=lines.append,
            log_every=20,
        )
        llm = kiln.load(copy)
        results = [llm.generate(p, max_new_tokens=24, speculative="heads:eagle") for p in prompts]
        assert [r.token_ids for r in results] == expected
        rates[name] = sum(r.stats.accepted_tokens for r in results) / sum(r.stats.drafted_tokens for r in results)
    losses = [float(line.split("loss ")[1].split()[0]) for line in lines if line.startswith("step ")]
    assert len(losses) == eagle.steps // 20 and losses[-1] < 0.7 * losses[0]
    assert rates["trained"] > rates["untrained"] + 0.1
    # every position since the prompt's first computed one: the chat template's head, which the
    # engine copies from the previous prompt's row instead of computing, is all that is missing
    shared = max(len(os.path.commonprefix([prompts[0], other])) for other in prompts[1:])
    assert seeded and all(0 <= end - length <= shared for length, end in seeded)
    assert any(length == end for length, end in seeded)
    assert llm.generate(prompts[0], max_new_tokens=24, speculative="heads").token_ids == expected[0]  # the only kind
    path = copy / heads_file("eagle")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=heads_file("eagle")):
        kiln.load(copy, check_hashes=False).generate(prompts[0], max_new_tokens=4, speculative="heads:eagle")


def test_eagle_heads_refuse_a_model_without_an_rmsnorm_layer_by_name():
    from kiln.ir import Graph, TensorType

    graph = Graph()  # logits straight from the embedding: no layer, no final RMSNorm to copy
    tokens = graph.add_input("tokens", TensorType("i64", (1, 4)))
    table = graph.add_param("embed", torch.randn(16, 8))
    graph.outputs = [graph.call("linear", graph.call("embedding", table, tokens), table)]
    with pytest.raises(SpeculatorError, match="pre-norm decoder layer"):
        build_heads("eagle", output_head(graph), 2, torch.arange(16), "tied")


def test_sampled_generation_with_heads_runs_and_counts_its_drafts(artifact):
    llm = kiln.load(artifact[1])
    result = llm.generate("Once upon a time", max_new_tokens=16, temperature=0.8, seed=3, speculative="heads")
    assert len(result.token_ids) == 16 and result.stats.drafted_tokens > 0


def test_an_artifact_without_heads_says_how_to_train_them(artifact):
    with pytest.raises(ArtifactError, match="train-speculator"):
        kiln.load(artifact[0]).generate("Hi", max_new_tokens=4, speculative="heads")


def test_a_damaged_heads_file_is_an_artifact_error(artifact, tmp_path):
    copy = tmp_path / "damaged.kiln"
    shutil.copytree(artifact[1], copy)
    path = copy / heads_file("mlp")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="damaged"):
        kiln.load(copy)
    llm = kiln.load(copy, check_hashes=False)
    with pytest.raises(ArtifactError, match=heads_file("mlp")):
        llm.generate("Hi", max_new_tokens=4, speculative="heads")


def test_heads_from_another_model_are_an_artifact_error(artifact, tmp_path):
    from kiln.runtime.speculator_heads import load_heads, save_heads

    copy = tmp_path / "other.kiln"
    shutil.copytree(artifact[1], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    llm = kiln.load(copy)
    heads, rows = load_heads(copy, manifest, output_head(llm.graph))
    save_heads(heads, rows, copy, "f" * 64, {})  # as trained on a checkpoint with another source_hash
    with pytest.raises(ArtifactError, match="another model"):
        kiln.load(copy).generate("Hi", max_new_tokens=4, speculative="heads")


def test_training_resumes_from_its_checkpoint(artifact, tmp_path):
    copy = tmp_path / "resume.kiln"
    shutil.copytree(artifact[0], copy)
    shutil.copytree(work_dir(artifact[1]), work_dir(copy))  # the collected corpus: no second collection
    config = CONFIG.__class__(**{**CONFIG.__dict__, "steps": 20})
    calls = []

    def interrupt_after_ten(line):
        calls.append(line)
        if line.startswith("step 10/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_speculator(
            kiln.load(copy),
            copy,
            config,
            prompts=PROMPTS,
            texts=TEXTS,
            report=interrupt_after_ten,
            log_every=5,
            checkpoint_every=1000,
        )
    lines = []
    train_speculator(kiln.load(copy), copy, config, prompts=PROMPTS, texts=TEXTS, report=lines.append, log_every=5)
    assert any("resuming from step 10" in line for line in lines)
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["15/20", "20/20"]
    assert (copy / heads_file("mlp")).is_file()


def test_bad_training_options_are_option_errors():
    from kiln.ir.errors import OptionError

    bads = ({"kind": "eagle2"}, {"head": "shared"}, {"stages": 0}, {"text_fraction": 2.0}, {"kind": "eagle"})
    for bad in (*bads, {"context": "sideways"}, {"window": 1}, {"noise": -0.1}, {"prompts": 0}, {"prompts": 10**6}):
        with pytest.raises(OptionError):
            TrainConfig(**bad).check()


def test_heads_draft_trees_in_the_engine_for_requests_side_by_side(artifact, monkeypatch):
    """Several prompts (and `submit`, as the server calls it) draft with heads at once; each
    step's draft is the heads' chain with runners-up for its first token, as one tree."""
    from kiln.runtime.request import Request

    plain, trained, _, _ = artifact
    llm = kiln.load(trained)
    prompts = [llm.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    expected = [r.token_ids for r in kiln.load(plain).generate(prompts, max_new_tokens=16)]
    trees = []
    verify_tree = Request.verify_tree
    monkeypatch.setattr(
        Request, "verify_tree", lambda self, logits, tree: (trees.append(tree), verify_tree(self, logits, tree))[1]
    )
    results = llm.generate(prompts, max_new_tokens=16, speculative="heads")
    assert [r.token_ids for r in results] == expected
    assert any(not tree.is_chain for tree in trees) and all(r.stats.drafted_tokens for r in results)
    assert llm.submit(prompts[0], max_new_tokens=16, speculative="heads").result().token_ids == expected[0]


def cached_corpus(trained):
    """(the model's output head, the corpus training cached beside `trained`, the draft
    vocabulary's ids, each token's index in it)."""
    from kiln import speculator_data as data
    from kiln.speculator_trainer import vocab_index

    head = output_head(kiln.load(trained).graph)
    saved = torch.load(work_dir(trained) / "corpus.pt", weights_only=True)
    saved.pop("key")
    corpus = data.Corpus(**saved)
    vocab_ids = corpus.ranking[: CONFIG.draft_vocab]
    return head, corpus, vocab_ids, vocab_index(vocab_ids, head.weight.shape[0])


def test_heads_learn_the_models_own_greedy_choices_also_on_text(artifact):
    """A draft is accepted when it is what the model would say: on text the targets are the
    model's argmax after each text token (solved back from the corpus' hidden states), not the
    text's own next tokens, which a small model rarely agrees with."""
    from kiln.speculator_trainer import IGNORE, Trainer

    head, corpus, vocab_ids, targets = cached_corpus(artifact[1])
    trainer = Trainer(build_heads("mlp", head, CONFIG.stages, vocab_ids, "own"), corpus, targets, CONFIG, head)
    text = corpus.positions(CONFIG.stages, replies=False)
    _, fed, wanted = trainer.batch(text)
    after = text[:, None] + torch.arange(1, CONFIG.stages + 1)  # the positions of t_{p+1} .. t_{p+stages}
    choice = (corpus.hidden[after] @ head.weight.T + (head.bias if head.bias is not None else 0)).argmax(-1)
    assert torch.equal(fed, corpus.tokens[after])
    assert torch.equal(wanted, targets[choice])
    in_vocab = wanted != IGNORE
    assert (wanted != targets[corpus.tokens[after + 1]])[in_vocab].float().mean() > 0.5  # not the text's tokens


def test_soft_targets_are_the_models_distribution_at_each_stages_target(artifact):
    """Soft targets (EAGLE's) at stage i are the model's own distribution over the draft
    vocabulary from its real state h_{p+1+i}: its argmax is the greedy token stage i is scored
    on, and the loss is the KL divergence from it (the greedy token's cross-entropy without them)."""
    import dataclasses

    from kiln.speculator_trainer import IGNORE, Trainer, token_loss

    head, corpus, vocab_ids, targets = cached_corpus(artifact[1])
    heads = build_heads("mlp", head, CONFIG.stages, vocab_ids, "own")
    soft = Trainer(heads, corpus, targets, CONFIG, head)
    positions = corpus.positions(CONFIG.stages, replies=True)
    _, _, wanted = soft.batch(positions)
    states = corpus.hidden[positions[:, None] + torch.arange(1, CONFIG.stages + 1)]
    for stage in range(CONFIG.stages):
        teacher = soft.teacher.probabilities(states[:, stage])
        in_vocab = wanted[:, stage] != IGNORE
        assert torch.equal(teacher.argmax(-1)[in_vocab], wanted[in_vocab, stage])
        assert torch.allclose(teacher.sum(-1), torch.ones(len(positions)))
    logits = torch.randn(len(positions), len(vocab_ids))
    expected = (teacher * (teacher.log() - torch.log_softmax(logits, -1))).sum(-1).mean()
    assert torch.allclose(token_loss(logits, wanted[:, -1], soft.teacher, states[:, -1]), expected)
    greedy = Trainer(heads, corpus, targets, dataclasses.replace(CONFIG, soft_targets=False), head)
    assert greedy.teacher is None
    hard = torch.nn.functional.cross_entropy(logits, wanted[:, -1], ignore_index=IGNORE)
    assert torch.allclose(token_loss(logits, wanted[:, -1], None, states[:, -1]), hard)


@pytest.mark.parametrize(("arch", "context"), [("qwen2", "whole"), ("mistral", "draft")])
def test_eagle_trees_keep_greedy_output_on_other_architectures(tiny_model_dirs, tmp_path, arch, context, monkeypatch):
    """Eagle heads copy each model's layer (qkv biases, sliding windows, Gemma's offset norms and
    GELU); the trees they grow from their own probabilities, verified in one step with the
    ancestor mask (their first path, the greedy chain, where sliding windows rule trees out),
    keep plain greedy output, with int8 weights and a cut draft vocabulary, attending over the
    whole context or the draft's own positions; heads stored before the context was recorded
    load as the draft's own form, and an unknown context is an ArtifactError."""
    from kiln.runtime import heads_drafter
    from kiln.runtime.request import Request
    from kiln.runtime.speculator_heads import load_heads, save_heads

    monkeypatch.setattr(heads_drafter, "DEFAULT_SETTINGS", heads_drafter.DraftSettings(vocab=128, tree_nodes=6))
    out = kiln.compile(str(tiny_model_dirs(arch)), out=tmp_path / "m.kiln", backend="reference", max_seq_len=96)
    config = TrainConfig(
        **{**CONFIG.__dict__, "kind": "eagle", "head": "tied", "steps": 10, "reply_tokens": 8, "context": context}
    )
    train_speculator(kiln.load(out), out, config, prompts=PROMPTS[:1], texts=TEXTS, report=lambda line: None)
    if context == "draft":  # as stored before the context was recorded
        heads, rows = load_heads(out, kiln.load(out).manifest, output_head(kiln.load(out).graph))
        del heads.context
        save_heads(heads, rows, out, kiln.load(out).manifest.get("source_hash"), {})
    llm = kiln.load(out)
    assert llm.heads.drafter("eagle").heads.context == context
    prompt = llm.encode_chat([{"role": "user", "content": PROMPTS[2]}])
    expected = llm.generate(prompt, max_new_tokens=12).token_ids
    trees = []
    verify_tree = Request.verify_tree
    monkeypatch.setattr(
        Request, "verify_tree", lambda self, logits, tree: (trees.append(tree), verify_tree(self, logits, tree))[1]
    )
    result = llm.generate(prompt, max_new_tokens=12, speculative="heads:eagle")
    assert result.token_ids == expected and result.stats.drafted_tokens > 0
    assert any(len(tree) == 6 and not tree.is_chain for tree in trees) == llm.engine.verifies_trees
    if context == "draft":
        heads.context = "sideways"
        save_heads(heads, rows, out, llm.manifest.get("source_hash"), {})
        with pytest.raises(ArtifactError, match="sideways"):
            kiln.load(out).generate(prompt, max_new_tokens=4, speculative="heads:eagle")


def test_whole_context_training_sees_what_drafting_computes(artifact):
    """One pass over a sequence (training) gives, at each stage, the state a draft started at
    each position computes over its draft cache (the real states before it, its own after)."""
    from kiln.runtime.eagle_context import DraftCache

    torch.manual_seed(0)
    heads = build_heads("eagle", output_head(kiln.load(artifact[0]).graph), 3, torch.arange(64), "tied", "whole")
    hidden, tokens = torch.randn(1, 10, heads.hidden), torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        states = heads.sequence_states(hidden, tokens)
        for start in range(7):
            cache = DraftCache(heads)
            cache.observe(hidden[0, : start + 1], 0)
            context = [1, *tokens[0, : start + 1].tolist()]
            state, own = cache.seed(context), []
            for stage in range(3):
                fed = torch.tensor([context[-1] if stage == 0 else int(tokens[0, start + stage])])
                state = heads._step(heads._input(state[None], fed), own, cache, cache.end)[0]
                torch.testing.assert_close(state, states[stage][0, start + stage], atol=1e-5, rtol=1e-4)


def test_compacted_heads_keep_the_most_frequent_tokens_and_int8_logits_near_fp32(artifact):
    """compact(): the draft vocabulary cut to its first (most frequent) ids, and int8 weights
    whose logits stay within a few percent of fp32's, so the drafts barely change."""
    from kiln.runtime.speculator_heads import load_heads

    llm = kiln.load(artifact[1])
    head = output_head(llm.graph)
    exact, _ = load_heads(artifact[1], llm.manifest, head)
    cheap, _ = load_heads(artifact[1], llm.manifest, head)
    cheap.compact(vocab=100, int8=True)
    assert torch.equal(cheap.vocab_ids, exact.vocab_ids[:100])
    hidden, tokens = torch.randn(8, head.weight.shape[1]), torch.randint(0, 100, (8, CONFIG.stages))
    with torch.no_grad():
        for want, got in zip(exact(hidden, tokens), cheap(hidden, tokens)):
            assert (got - want[:, :100]).abs().max() < 0.05 * want.abs().max()


def test_a_losing_heads_drafter_rests_then_tries_again():
    from types import SimpleNamespace

    from kiln.runtime.draft_tree import DraftTree
    from kiln.runtime.heads_drafter import DraftSettings, HeadsDrafter

    heads = SimpleNamespace(kind="mlp", draft_tree=lambda *args: DraftTree.chain([5, 6, 7]))
    drafter = HeadsDrafter(heads, lambda logits: logits, DraftSettings(pause_below=0.5, rest_steps=3))
    drafter.observe(torch.zeros(4))
    assert len(drafter.propose([1], 3)) == 3
    drafter.feedback(3, 2)  # a good draft: the running average stays high
    assert len(drafter.propose([1], 3)) == 3
    for _ in range(4):
        drafter.feedback(3, 0)
    assert [len(drafter.propose([1], 3)) for _ in range(4)] == [0, 0, 0, 3]


@pytest.mark.slow  # an Inductor compile: 5-15 s on 2 cores
def test_the_eagle_step_compiled_by_inductor_drafts_as_the_torch_layer(artifact):
    """Draft-context eagle heads' step, captured into IR, through the passes and lowered by
    Inductor (fp32 weights here; int8 ones are the quantize phase's, tested with the backend):
    its trees and chains are the torch layer's. Backends that do not lower it keep the torch layer."""
    from kiln.runtime.eagle_step import CompiledEagleStep
    from kiln.runtime.eagle_tree import grow_tree
    from kiln.runtime.heads_drafter import DraftSettings, step_compiles

    torch.manual_seed(0)
    head = output_head(kiln.load(artifact[0]).graph)
    heads = build_heads("eagle", head, 3, torch.arange(96), "tied", "draft")
    assert step_compiles(heads, "inductor") and not step_compiles(heads, "reference")
    compiled = build_heads("eagle", head, 3, torch.arange(96), "tied", "draft")
    compiled.load_state_dict(heads.state_dict())
    compiled.compiled_step = CompiledEagleStep(compiled, DraftSettings().tree_top_k, "inductor", int8=False)
    for _ in range(4):
        hidden, token = torch.randn(heads.hidden), int(torch.randint(0, 96, ()))
        assert grow_tree(compiled, hidden, token, 3, 3, 6) == grow_tree(heads, hidden, token, 3, 3, 6)
        assert compiled.draft(hidden, token, 3) == heads.draft(hidden, token, 3)
