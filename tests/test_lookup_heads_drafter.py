"""speculative="heads+lookup": prompt lookup's continuation and the heads' tree merged into one
token tree a step (runtime/lookup_heads_drafter.py), verified by the target in one step."""

import shutil

import openai
import pytest

import kiln
from kiln.ir.errors import ArtifactError
from kiln.runtime.draft_tree import DraftTree
from kiln.runtime.lookup_heads_drafter import HEADS, LOOKUP, REPLIES, LookupHeadsDrafter
from kiln.runtime.request import Request
from kiln.runtime.server import create_app
from kiln.runtime.speculative import PromptLookupDrafter
from kiln.train_speculator import TrainConfig, train_speculator
from served import served
from tiny_models import TRAINING_TEXT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Tell me about the village.", "Count from one to ten.", "Describe the seasons."]
# a span the answer can copy: prompt lookup drafts from it
REPEATED = "The old mill by the river turns. The old mill by the river turns. The old mill by the"
EAGLE = TrainConfig(
    kind="eagle",
    head="tied",
    stages=3,
    draft_vocab=256,
    steps=60,
    batch=32,
    lr=3e-3,
    text_fraction=0.2,
    reply_tokens=24,
)


@pytest.fixture(scope="module")
def artifacts(tiny_model_dirs, tmp_path_factory):
    """A tiny llama artifact (reference backend: it verifies trees) and a copy with eagle heads."""
    root = tmp_path_factory.mktemp("lookup_heads")
    plain = kiln.compile(
        str(tiny_model_dirs("llama")), out=root / "plain.kiln", backend="reference", max_seq_len=160, max_batch=2
    )
    trained = root / "trained.kiln"
    shutil.copytree(plain, trained)
    train_speculator(kiln.load(trained), trained, EAGLE, prompts=PROMPTS, texts=[TRAINING_TEXT[:600]], report=str)
    return plain, trained


def test_merged_tree_stores_shared_prefixes_once_within_the_budget():
    lookup = DraftTree.chain([1, 2, 3, 4])
    heads = DraftTree.of_continuations([[1, 2, 5], [1, 6], [7]], max_nodes=8)
    tree, sources = DraftTree.merged([lookup, heads], max_nodes=7)
    assert tree.tokens == (1, 2, 3, 4, 5, 6, 7)
    assert tree.parents == (-1, 0, 1, 2, 1, 0, -1)
    assert sources == [0b11, 0b11, 0b01, 0b01, 0b10, 0b10, 0b10]
    # each node sees the newest token, its ancestors and itself, nothing else
    seen = tree.visibility()
    for node in range(len(tree)):
        ancestors, at = {0, node + 1}, tree.parents[node]
        while at >= 0:
            ancestors.add(at + 1)
            at = tree.parents[at]
        assert {i for i in range(len(tree) + 1) if seen[node + 1, i]} == ancestors
    # past the budget a node drops with its descendants; a shared node costs nothing more
    small, small_sources = DraftTree.merged([lookup, heads], max_nodes=5)
    assert small.tokens == (1, 2, 3, 4, 5) and small.parents == (-1, 0, 1, 2, 1)
    assert small_sources[-1] == 0b10
    deep_first, _ = DraftTree.merged([DraftTree.chain([9, 8]), DraftTree.chain([1, 2, 3])], max_nodes=3)
    assert deep_first.tokens == (9, 8, 1)  # 2 and 3 dropped with their parent's budget


class FixedHeads:
    """Heads that always guess `guess` after the newest token, recording their feedback."""

    def __init__(self, guess):
        self.guess, self.heard = guess, []

    def propose(self, context, max_tokens):
        return DraftTree.chain(self.guess[:max_tokens])

    def feedback(self, drafted, accepted):
        self.heard.append((drafted, accepted))


def test_each_part_hears_how_far_its_own_nodes_were_accepted():
    heads = FixedHeads([40, 41])
    lookup = PromptLookupDrafter()
    lookup.length = 3
    drafter = LookupHeadsDrafter(heads, lookup)
    context = [1, 2, 3, 4, 5, 9, 1, 2]  # '1 2' was followed by 3 4 5
    tree = drafter.propose(context, 10)
    assert tree.tokens == (3, 4, 5, 40, 41) and tree.parents == (-1, 0, 1, -1, 3)
    drafter.feedback(3, 3)  # the target took the lookup chain, then its own token 7
    context += [3, 4, 5, 7]
    drafter.propose(context, 10)
    assert heads.heard == [(2, 0)] and lookup.length == 5  # lookup fully accepted: it drafts longer
    drafter.feedback(2, 1)  # this time the heads' first guess only
    context += [40, 8]
    drafter.propose(context, 10)
    assert heads.heard[-1] == (2, 1)


def test_stored_replies_draft_where_lookup_finds_nothing_and_shrink_while_they_miss():
    from kiln.runtime.lookup_heads_drafter import REPLY_NODES
    from kiln.runtime.reply_index import ReplyIndex, replies_stream

    stored = [[7, 8, 9, 10, 11], [7, 8, 12], [7, 13]] + [[t, t + 1, t + 2] for t in range(100, 200, 3)]
    drafter = LookupHeadsDrafter(FixedHeads([40]), PromptLookupDrafter(), replies=ReplyIndex(replies_stream(stored)))
    context = [1, 2, 3, 7]  # no earlier 7 in the context: lookup drafts nothing, the replies do
    tree = drafter.propose(context, 10)
    assert tree.tokens == (40, 8, 9, 10, 11, 12, 13) and drafter._last[1][1] == REPLIES
    assert drafter.reply_nodes() == REPLY_NODES
    for newest in range(100, 136, 3):  # the target takes neither part's guess: the replies' share falls
        drafter.feedback(1, 0)
        context += [50 + newest, newest]
        tree = drafter.propose(context, 10)
    assert drafter.reply_nodes() == 1 and tree.tokens == (40, newest + 1)
    drafter.feedback(1, 1)  # ... and grows again once their node is taken
    context += [newest + 1, 160]
    drafter.propose(context, 10)
    assert drafter.reply_nodes() > 1
    # a match in the context itself leaves the replies out
    drafter.feedback(1, 0)
    context += [5, 1, 2]
    drafter.propose(context, 10)
    assert not any(s & REPLIES for s in drafter._last[1])


def test_greedy_output_is_plain_decodings_in_the_engine_with_both_parts_drafting(artifacts, monkeypatch):
    plain, trained = artifacts
    llm = kiln.load(trained)
    prompts = [llm.encode_chat([{"role": "user", "content": p}]) for p in [REPEATED, *PROMPTS[:2]]]
    expected = [r.token_ids for r in kiln.load(plain).generate(prompts, max_new_tokens=24, ignore_eos=True)]
    drafts, verified = [], []
    propose, verify_tree = LookupHeadsDrafter.propose, Request.verify_tree
    monkeypatch.setattr(
        LookupHeadsDrafter, "propose", lambda self, c, m: (propose(self, c, m), drafts.append(self._last[1]))[0]
    )
    monkeypatch.setattr(
        Request, "verify_tree", lambda self, logits, tree: (verified.append(tree), verify_tree(self, logits, tree))[1]
    )
    results = llm.generate(prompts, max_new_tokens=24, ignore_eos=True, speculative="heads+lookup")
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.drafted_tokens > 0 for r in results) and results[0].stats.tokens_per_target_step > 1
    assert any(s & LOOKUP for sources in drafts for s in sources)  # the repeated span: lookup drafted
    assert any(s == HEADS for sources in drafts for s in sources)  # and the heads beside it
    assert any(s & REPLIES for sources in drafts for s in sources)  # and the replies stored in training
    assert any(not tree.is_chain for tree in verified)  # one target step verified the merged tree
    handle = llm.submit(prompts[0], max_new_tokens=24, ignore_eos=True, speculative="heads+lookup")
    assert handle.result().token_ids == expected[0]


def test_sampled_generation_goes_through_the_tree_accept_reject_and_is_seeded(artifacts, monkeypatch):
    _, trained = artifacts
    llm = kiln.load(trained)
    prompt = llm.encode_chat([{"role": "user", "content": REPEATED}])
    verified = []
    verify_tree = Request.verify_tree
    monkeypatch.setattr(
        Request, "verify_tree", lambda self, logits, tree: (verified.append(tree), verify_tree(self, logits, tree))[1]
    )
    runs = [
        llm.generate(prompt, max_new_tokens=20, temperature=0.8, seed=5, speculative="heads+lookup") for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].stats.drafted_tokens > 0
    assert any(not tree.is_chain for tree in verified)


def test_the_server_drafts_every_request_with_both(artifacts):
    plain, trained = artifacts
    llm = kiln.load(trained)
    with served(create_app(llm, "tiny", speculative="heads+lookup")) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        response = client.completions.create(
            model="tiny", prompt=REPEATED, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
    assert response.choices[0].text == kiln.load(plain).generate(REPEATED, max_new_tokens=24, ignore_eos=True).text


def test_an_artifact_without_heads_names_the_fix(artifacts):
    plain, _ = artifacts
    with pytest.raises(ArtifactError, match="train-speculator.*prompt_lookup"):
        kiln.load(plain).generate("Hi", max_new_tokens=4, speculative="heads+lookup")
    with pytest.raises(Exception, match="heads\\+lookup"):
        kiln.load(plain).generate("Hi", max_new_tokens=4, speculative="mlp+lookup")
