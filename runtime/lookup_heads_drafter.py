"""`LookupHeadsDrafter` (speculative="heads+lookup"): prompt lookup's continuation, the draft
heads' tree and the continuations of the model's stored replies merged into one token tree,
verified together in one target step.

They guess different tokens: prompt lookup the spans the answer copies from its context (long
and nearly free to draft), the heads the model's own phrasing (a few tokens deep), the stored
replies (reply_index.py, where the artifact has them) the phrases the model keeps reusing. Each
step all draft after the same newest token and `DraftTree.merged` stores their shared prefixes
once, in priority order under a node budget: lookup's most recent match (a chain, as long as its
adaptive length allows), then the heads' tree, then the stored replies' continuations (only
where prompt lookup found no match: on a code edit that copies its prompt they only widened the
tree, docs/generation.md), then lookup's other matches. The target's walk down the tree
(Request.verify_tree) takes whichever branch it agrees with; with sampling its accept/reject rule
over a node's distinct children keeps every token distributed as the target's, whichever part
drafted them.

Each part keeps its own feedback: the accepted path is read back from the tokens the context grew
by (the next proposal's context), and each part is told how deep its own nodes reached and how
many of the accepted ones were its own, so prompt lookup's draft length and the heads' resting
work as when each drafts alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.runtime.draft_tree import DraftTree
from kiln.runtime.speculative import PromptLookupDrafter

LOOKUP, HEADS, REPLIES = 1, 2, 4  # each merged node's source bits
# at most this many nodes a step: Inductor's exact width is 16 fed tokens (the newest and 15 nodes);
# lookup's own tree is already as wide where three matches continue
MAX_NODES = 15
# the stored replies' share of the tree follows how often their first node was right lately (a
# running average): all REPLY_NODES at RECALL_PAYS or more, down to one node where they keep missing
REPLY_NODES, RECALL_PAYS, RECALL_MEMORY = 12, 0.25, 0.2


class LookupHeadsDrafter:
    def __init__(self, heads, lookup: PromptLookupDrafter | None = None, max_nodes: int = MAX_NODES, replies=None):
        self.heads = heads  # a HeadsDrafter with per-generation state
        self.lookup = lookup or PromptLookupDrafter()
        self.replies = replies  # a ReplyIndex, shared (it keeps no per-request state), or None
        self.recall_rate = RECALL_PAYS  # running average: the share of steps a stored reply's first node was taken
        self.max_nodes = max_nodes
        self._last: tuple[DraftTree, list[int], int] | None = None  # merged tree, sources, context length
        self._verified: tuple[int, int] | None = None  # feedback(): depth verified, tokens accepted

    # the heads read the target's logits: passed through
    @property
    def reads_prompt(self) -> bool:
        return bool(getattr(self.heads, "reads_prompt", False))

    def observe(self, logits) -> None:
        self.heads.observe(logits)

    def observe_rows(self, logits, first: int) -> None:
        self.heads.observe_rows(logits, first)

    def propose(self, context: Sequence[int], max_tokens: int) -> DraftTree:
        self._tell_parts(context)
        looked_up = self.lookup.propose(context, max_tokens)
        guessed = self.heads.propose(context, max_tokens)
        # the stored replies are a prior over the model's phrasing: where the request's own context
        # continues the newest tokens, its match is the likelier and the node budget goes to it
        recall = self.replies is not None and not len(looked_up)
        recalled = self.replies.propose(context, max_tokens, self.reply_nodes()) if recall else DraftTree.chain([])
        parts = [DraftTree.chain(looked_up.first_path()), guessed, recalled, looked_up]
        tree, sources = DraftTree.merged(parts, self.max_nodes)
        # part bits: 0 and 3 are both lookup's, 1 the heads', 2 the stored replies'
        sources = [
            (LOOKUP if s & 0b1001 else 0) | (HEADS if s & 0b0010 else 0) | (REPLIES if s & 0b0100 else 0)
            for s in sources
        ]
        self._last, self._verified = (tree, sources, len(context)), None
        return tree

    def reply_nodes(self) -> int:
        """How many nodes the stored replies may draft this step."""
        return max(1, round(REPLY_NODES * min(1.0, self.recall_rate / RECALL_PAYS)))

    def feedback(self, drafted: int, accepted: int) -> None:
        """Kept until the next proposal, whose context shows which path the accepted tokens took."""
        self._verified = (drafted, accepted)

    def _tell_parts(self, context: Sequence[int]) -> None:
        """Each part's feedback on the last verified tree: the depth of its own nodes (within
        what was verified) and how many nodes of the accepted path were its own, from the root."""
        if self._last is None or self._verified is None:
            return
        (tree, sources, length), (verified_depth, accepted) = self._last, self._verified
        path = accepted_path(tree, list(context[length : length + accepted]))
        depths = tree.depths()
        for part, bit in ((self.lookup, LOOKUP), (self.heads, HEADS)):
            drafted = min(verified_depth, max((d for d, s in zip(depths, sources) if s & bit), default=0))
            own = 0
            while own < len(path) and sources[path[own]] & bit:
                own += 1
            part.feedback(drafted, min(own, drafted))
        if any(s & REPLIES for s in sources):
            taken = bool(path) and bool(sources[path[0]] & REPLIES)
            self.recall_rate += RECALL_MEMORY * (taken - self.recall_rate)


def accepted_path(tree: DraftTree, tokens: Sequence[int]) -> list[int]:
    """The nodes from the root that spell `tokens` (as far as the tree has them)."""
    path, at = [], -1
    for token in tokens:
        hit = next((c for c in tree.children(at) if tree.tokens[c] == token), None)
        if hit is None:
            break
        path.append(hit)
        at = hit
    return path
