"""Which drafter a `speculative=` setting names, for the engine (per request) or run alone.

Inside the engine: "prompt_lookup" (each request drafts from its own context), "heads" /
"heads:KIND" (the draft heads `kiln train-speculator` stored in the artifact, loaded once per
kind and shared by every request's drafter) and "heads+lookup" / "heads:KIND+lookup" (both,
with the model's replies stored beside the heads, merged into one tree a step:
lookup_heads_drafter.py). Run alone, one prompt at a time: a draft LLM or any
object with propose() and feedback() (kiln.runtime.speculative.Drafter).
"""

from __future__ import annotations

import functools
from pathlib import Path

from kiln.runtime.errors import GenerationError
from kiln.runtime.speculative import PromptLookupDrafter


class StoredHeads:
    """An artifact's draft heads, loaded on first use per kind."""

    def __init__(self, directory: Path | None, manifest: dict, graph):
        self.directory, self.manifest, self.graph = directory, manifest, graph
        self._loaded: dict = {}  # kind -> HeadsDrafter holding the heads and the hidden-state solver
        self._replies: list = []  # [the ReplyIndex or None], once looked for

    def drafter(self, kind: str | None):
        """A fresh HeadsDrafter (its own per-generation state) over the stored heads of `kind`."""
        from kiln.runtime.heads_drafter import HeadsDrafter

        if self.directory is None or self.graph is None:
            raise GenerationError(
                "speculative='heads' reads the heads stored in an artifact. Fix: load the "
                "artifact with kiln.load after `kiln train-speculator` on it."
            )
        if kind not in self._loaded:
            self._loaded[kind] = HeadsDrafter.from_artifact(self.directory, self.manifest, self.graph, kind)
        return self._loaded[kind].fresh()

    def reply_index(self):
        """The model's replies stored beside the heads, indexed (reply_index.py); None without."""
        from kiln.runtime.reply_index import load_reply_index

        if not self._replies:
            found = load_reply_index(self.directory, self.manifest) if self.directory is not None else None
            self._replies.append(found)
        return self._replies[0]


def engine_drafter(speculative, heads: StoredHeads):
    """A factory of per-request drafters for the engine (heads loaded here, so that missing heads
    fail at the call); None for the drafters that run alone."""
    if speculative == "prompt_lookup":
        return PromptLookupDrafter
    if isinstance(speculative, str) and speculative.endswith(LOOKUP_SUFFIX):
        return _lookup_and_heads(speculative.removesuffix(LOOKUP_SUFFIX), heads)
    if isinstance(speculative, str) and speculative.split(":")[0] == "heads":
        kind = speculative.partition(":")[2] or None
        heads.drafter(kind)
        return functools.partial(heads.drafter, kind)
    return None


LOOKUP_SUFFIX = "+lookup"  # "heads+lookup", "heads:KIND+lookup": the heads' tree and prompt lookup's, merged


def _lookup_and_heads(named: str, heads: StoredHeads):
    """Per-request LookupHeadsDrafters over the stored heads `named` ("heads" or "heads:KIND")."""
    from kiln.ir.errors import ArtifactError
    from kiln.runtime.lookup_heads_drafter import LookupHeadsDrafter

    if named.split(":")[0] != "heads":
        raise GenerationError(
            f"speculative={named + LOOKUP_SUFFIX!r:.60} names no heads to merge prompt lookup with. "
            "Fix: speculative='heads+lookup' (or 'heads:KIND+lookup')."
        )
    kind = named.partition(":")[2] or None
    try:
        heads.drafter(kind)
    except ArtifactError as error:
        raise ArtifactError(f"{error} (speculative='heads+lookup' without heads: use 'prompt_lookup')") from None
    replies = heads.reply_index()
    return lambda: LookupHeadsDrafter(heads.drafter(kind), replies=replies)


def lone_drafter(speculative, draft_llm_class):
    """The drafter of a generation that runs alone: a draft LLM's model, or the caller's object."""
    from kiln.runtime.speculative import ModelDrafter

    if isinstance(speculative, draft_llm_class):
        return ModelDrafter(speculative.executable, vocab_size=speculative.vocab_size)
    if hasattr(speculative, "propose") and hasattr(speculative, "feedback"):
        return speculative
    raise GenerationError(
        f"speculative={speculative!r:.60} is not a drafter. Fix: pass 'prompt_lookup', "
        "'heads', a draft LLM from kiln.load, or an object with propose() and feedback()."
    )
