"""The model's stored replies as a drafter (runtime/reply_index.py): lookup, storage and its checks."""

import json
import shutil

import pytest
import torch

import kiln
from kiln.ir.errors import ArtifactError
from kiln.runtime.reply_index import REPLIES_FILE, SEPARATOR, ReplyIndex, load_reply_index, replies_stream
from kiln.train_speculator import TrainConfig, train_speculator
from tiny_models import TRAINING_TEXT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Tell me about the village.", "Count from one to ten."]
CONFIG = TrainConfig(stages=2, draft_vocab=256, steps=20, batch=16, text_fraction=0.2, reply_tokens=16)


def test_the_longest_suffix_found_drafts_its_most_frequent_continuations():
    replies = [[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 3, 4, 6, 8], [3, 4, 5]]
    index = ReplyIndex(replies_stream(replies), max_ngram=3, length=3, branches=2)
    # "2 3 4" occurs twice, followed by 5 and by 6: both, in the stream's order for equal counts
    assert index.continuations([0, 2, 3, 4]) == [[5], [6]]
    # "8 3 4" is nowhere, "3 4" four times: 5 (twice, each at a reply's end), 6 and "6 8"
    assert index.continuations([8, 3, 4]) == [[5], [6]]
    # no n-gram spans two replies: "5 9" (reply 0's end, reply 1's start) is not found
    pairs = ReplyIndex(replies_stream(replies), max_ngram=2, min_ngram=2)
    assert pairs.continuations([5, 9]) == [] and pairs.continuations([1, 2]) == [[3, 4, 5]]
    assert index.continuations([42]) == []  # nowhere in the store
    tree = index.propose([0, 1, 2], max_tokens=2)
    assert tree.first_path() == [3, 4]  # "1 2" -> 3 4 (5 cut by max_tokens)
    assert replies_stream(replies).tolist().count(SEPARATOR) == len(replies)


@pytest.fixture(scope="module")
def trained(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("reply_index")
    plain = kiln.compile(
        str(tiny_model_dirs("llama")), out=root / "plain.kiln", backend="reference", max_seq_len=96, max_batch=2
    )
    artifact = root / "trained.kiln"
    shutil.copytree(plain, artifact)
    train_speculator(kiln.load(artifact), artifact, CONFIG, prompts=PROMPTS, texts=[TRAINING_TEXT[:300]], report=str)
    return artifact


def test_training_stores_the_models_replies_in_the_artifact(trained):
    llm = kiln.load(trained)
    manifest = json.loads((trained / "manifest.json").read_text())
    assert REPLIES_FILE in manifest["files"] and manifest["speculator_replies"]["replies"] == len(PROMPTS)
    chats = [llm.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    replies = [r.token_ids for r in llm.generate(chats, max_new_tokens=CONFIG.reply_tokens)]
    index = load_reply_index(trained, manifest)
    assert index.stream.tolist() == replies_stream(replies).tolist()
    # after a reply's opening tokens the index drafts how that reply went on
    first = replies[0]
    assert index.continuations(chats[0] + first[:6])[0] == first[6 : 6 + index.length]


def test_damaged_or_foreign_stored_replies_are_refused_by_name(trained, tmp_path):
    copy = tmp_path / "copy.kiln"
    shutil.copytree(trained, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / REPLIES_FILE).write_bytes((copy / REPLIES_FILE).read_bytes()[:-8])
    with pytest.raises(ArtifactError, match="speculator.replies.safetensors .*damaged"):
        load_reply_index(copy, manifest)
    shutil.copy(trained / REPLIES_FILE, copy / REPLIES_FILE)
    foreign = {**manifest, "speculator_replies": {**manifest["speculator_replies"], "source_hash": "0" * 64}}
    with pytest.raises(ArtifactError, match="another model's replies"):
        load_reply_index(copy, foreign)
    assert load_reply_index(copy, {**manifest, "speculator_replies": None}) is None
    # the artifact's load checks it too, as every file it lists: truncated, or changed in place
    data = bytearray((trained / REPLIES_FILE).read_bytes())
    (copy / REPLIES_FILE).write_bytes(b"damaged")
    with pytest.raises(ArtifactError, match=REPLIES_FILE):
        kiln.load(copy)
    data[-1] ^= 0xFF
    (copy / REPLIES_FILE).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"{REPLIES_FILE} does not match its sha256"):
        kiln.load(copy)
    assert torch.equal(replies_stream([[1]]), torch.tensor([1, SEPARATOR], dtype=torch.int32))
