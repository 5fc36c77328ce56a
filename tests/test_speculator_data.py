"""What draft heads train on (kiln/speculator_data.py, kiln/speculator_prompts.py): the prompts,
and the model's replies decoded once, kept and resumed."""

import pytest

import kiln

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Name a fruit.", "What is two plus two?", "Describe a river.", "Say goodbye."]


@pytest.fixture(scope="module")
def plain(tiny_model_dirs, tmp_path_factory):
    """A tiny llama artifact (reference backend, max_batch 1: replies decode in groups of four)."""
    root = tmp_path_factory.mktemp("collection")
    return kiln.compile(
        str(tiny_model_dirs("llama")), out=root / "plain.kiln", backend="reference", max_seq_len=128, max_batch=1
    )


def test_more_prompts_are_the_bundled_ones_then_generated_ones_in_a_fixed_order():
    from kiln.speculator_data import read_prompts
    from kiln.speculator_prompts import CODE_EVERY, generated_prompts, most_prompts, prompts_for

    bundled = read_prompts()
    assert prompts_for(10, bundled) == bundled[:10]
    more = prompts_for(600, bundled)
    assert more[: len(bundled)] == bundled and len(more) == len(set(more)) == 600
    assert prompts_for(600, bundled) == more  # the same list every time: a cached corpus is found again
    assert set(more[len(bundled) :]) <= set(generated_prompts())
    first = generated_prompts()[: 10 * CODE_EVERY]  # every CODE_EVERY-th a programming task, while both last
    assert [i for i, p in enumerate(first) if "function" in p] == list(range(CODE_EVERY - 1, len(first), CODE_EVERY))
    assert len(prompts_for(most_prompts(), bundled)) == most_prompts()


def test_an_interrupted_collection_resumes_after_its_last_group_of_replies(plain, tmp_path):
    from kiln import speculator_data as data

    llm = kiln.load(plain)
    prompts = [*PROMPTS, "Name a color.", "Say hello."]  # two groups of four on a max_batch 1 artifact

    def stop_after_the_first_group(line):
        if line.startswith("replies 4/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        data._replies(llm, prompts, 4, stop_after_the_first_group, data.ReplyStore(tmp_path / "replies.pt", "key"))
    lines = []
    replies = data._replies(llm, prompts, 4, lines.append, data.ReplyStore(tmp_path / "replies.pt", "key"))
    assert lines[0].startswith("replies: 4/6 decoded before") and lines[-1].startswith("replies 6/6")
    assert len(replies) == 6 and all(reply for _, _, reply in replies)
    lines.clear()
    again = data._replies(llm, prompts, 4, lines.append, data.ReplyStore(tmp_path / "replies.pt", "another key"))
    assert again == replies and lines[-1].startswith("replies 6/6, ")  # another model's store: decoded again


def test_more_prompts_decode_only_the_new_ones_and_keep_the_order(plain, tmp_path):
    from kiln import speculator_data as data

    llm = kiln.load(plain)
    store = tmp_path / "replies.pt"
    first = data._replies(llm, PROMPTS, 4, lambda line: None, data.ReplyStore(store, "key"))
    decoded = []
    more = ["Say hello.", *PROMPTS[:2], "Name a color."]
    replies = data._replies(llm, more, 4, decoded.append, data.ReplyStore(store, "key"))
    assert decoded[0].startswith("replies: 2/4 decoded before") and decoded[-1].startswith("replies 4/4")
    assert replies[1:3] == first[:2]  # reused, in the new list's order
    assert replies == data._replies(llm, more, 4, lambda line: None)  # as decoding them all gives
