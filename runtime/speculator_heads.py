"""Draft heads on the target's last hidden state, and their file in the artifact.

Three kinds, each drafting one chain of `stages` tokens after the newest token t_{p+1}, from the
hidden state h_p that produced it (last_hidden.py):
- `mlp` (IBM's multi-stage MLP speculator): stage i mixes a projection of the previous stage's
  state (stage 0: h_p) with the embedding of the token stage i-1 predicted (stage 0: t_{p+1}),
  then LayerNorm, GELU and a vocabulary head; the embedding table is the model's own, frozen;
- `medusa`: head i is a residual block h_p + SiLU(W_i h_p) and a vocabulary head; it predicts
  t_{p+2+i} from h_p alone;
- `eagle`: one decoder layer of the model's own shape predicting the next hidden state, read out
  through the model's final norm and lm_head (eagle_heads.py).
Vocabulary heads cover the `draft_vocab` most frequent tokens of the training data (a draft
outside them is never proposed) and are either the heads' own (`own`: initialized from the
model's lm_head rows, then trained) or the model's lm_head rows themselves (`tied`: frozen, not
stored; read from the model when loading).

The heads file (speculator.KIND.safetensors) holds the stage weights, `vocab_ids` and
`inverse_rows` (the logits rows the hidden state is solved from), and metadata: kind, stages,
head, the model's hidden and vocabulary sizes and its source_hash. It is listed with its sha256
in the manifest's files and described under the manifest's `speculators`; heads trained for
another model or a damaged file raise ArtifactError.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

from kiln.runtime.artifact import MANIFEST, file_sha256, read_manifest, sealed
from kiln.runtime.draft_tree import DraftTree
from kiln.runtime.errors import ArtifactError
from kiln.runtime.last_hidden import OutputHead

KINDS = ("mlp", "medusa", "eagle")
HEAD_CHOICES = ("own", "tied")
HEADS_FORMAT = "kiln-speculator-1"


def heads_file(kind: str) -> str:
    return f"speculator.{kind}.safetensors"


class DraftHeads(nn.Module):
    """The stages shared by both kinds: vocabulary heads over `vocab_ids`."""

    kind = ""

    def __init__(self, model_head: OutputHead, stages: int, vocab_ids: torch.Tensor, head: str):
        super().__init__()
        hidden = model_head.weight.shape[1]
        self.stages, self.head_choice, self.hidden = stages, head, hidden
        self.register_buffer("vocab_ids", vocab_ids.long().clone(), persistent=False)
        rows = model_head.weight[self.vocab_ids].detach().clone()
        if head == "own":
            self.heads = nn.ParameterList(nn.Parameter(rows.clone()) for _ in range(stages))
        else:  # tied: the model's rows, frozen and not saved
            self.register_buffer("tied_rows", rows, persistent=False)

    def head_weight(self, stage: int) -> torch.Tensor:
        return self.heads[stage] if self.head_choice == "own" else self.tied_rows

    def logits(self, stage: int, state: torch.Tensor) -> torch.Tensor:
        readouts = getattr(self, "int8_readouts", None)
        if readouts is not None:
            return readouts[stage if len(readouts) > 1 else 0](state)
        return F.linear(state, self.head_weight(stage))

    @torch.no_grad()
    def compact(self, vocab: int | None = None, int8: bool = False) -> DraftHeads:
        """These heads made cheaper to draft with, in place (no longer trainable): only the
        `vocab` most frequent draft tokens (vocab_ids are ranked by frequency) and, with `int8`,
        int8 weights in every readout and stage matrix (Int8Linear)."""
        if vocab and vocab < len(self.vocab_ids):
            self.vocab_ids = self.vocab_ids[:vocab]
            if self.head_choice == "own":
                self.heads = nn.ParameterList(nn.Parameter(rows[:vocab], requires_grad=False) for rows in self.heads)
            else:
                self.tied_rows = self.tied_rows[:vocab]
        if int8:
            from kiln.runtime.int8_linear import Int8Linear

            readouts = self.stages if self.head_choice == "own" else 1
            self.int8_readouts = [Int8Linear(self.head_weight(stage)) for stage in range(readouts)]
            for module in list(self.modules()):
                for child, linear in list(module.named_children()):
                    if isinstance(linear, nn.Linear):
                        setattr(module, child, Int8Linear.of(linear))
        return self.eval()

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced logits over the draft vocabulary, one [batch, draft_vocab] per stage:
        hidden [batch, hidden] is h_p, tokens [batch, stages] are t_{p+1} ... t_{p+stages}."""
        raise NotImplementedError

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, token: int, count: int, min_confidence: float = 0.0) -> list[int]:
        """Up to `count` greedy drafts after `token`; stops early once the product of the heads'
        probabilities for their own picks falls below `min_confidence`."""
        raise NotImplementedError

    @torch.inference_mode()
    def chains(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Each row's full greedy draft (token ids [batch, stages]) after tokens [batch]."""
        raise NotImplementedError

    def first_logits(self, hidden: torch.Tensor, token: int) -> torch.Tensor:
        """Stage 0's logits over the draft vocabulary after `token`."""
        raise NotImplementedError

    def training_outputs(self, hidden: torch.Tensor, tokens: torch.Tensor, next_hidden: torch.Tensor):
        """(teacher-forced logits per stage, an extra loss term, the weight of the token
        cross-entropy); next_hidden [batch, stages, hidden] are h_{p+1} .. h_{p+stages}, what
        heads that predict states (eagle) regress to."""
        return self(hidden, tokens), torch.zeros(()), 1.0

    @torch.inference_mode()
    def draft_tree(
        self, hidden: torch.Tensor, token: int, count: int, alternatives: int = 2, min_confidence: float = 0.0
    ) -> DraftTree:
        """The greedy chain (`draft`) and, beside its first token, the next `alternatives`
        likeliest first tokens as leaves: where stage 0 misses, its runners-up often hit, for a
        few more rows of the verifying step."""
        chain = self.draft(hidden, token, count, min_confidence)
        if not chain or alternatives <= 0:
            return DraftTree.chain(chain)
        ranked = self.first_logits(hidden, token).topk(min(alternatives + 1, len(self.vocab_ids))).indices
        others = [[int(self.vocab_ids[i])] for i in ranked if int(self.vocab_ids[i]) != chain[0]][:alternatives]
        return DraftTree.of_continuations([chain, *others], max_nodes=len(chain) + alternatives)


class MLPSpeculator(DraftHeads):
    kind = "mlp"

    def __init__(self, model_head: OutputHead, stages: int, vocab_ids: torch.Tensor, head: str = "own"):
        super().__init__(model_head, stages, vocab_ids, head)
        hidden = self.hidden
        self.register_buffer("embedding", model_head.embedding.detach(), persistent=False)
        self.proj = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(stages))
        self.norm = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(stages))
        # IBM's weighting: the state's share shrinks stage by stage, the token's grows
        self.state_weight = 0.5 ** (0.5 / stages)
        self.token_weight = math.sqrt(1 - self.state_weight**2)

    def first_logits(self, hidden, token):
        return self.logits(0, self._stage(0, hidden, torch.tensor(token)))

    def _stage(self, stage: int, state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        embedded = F.rms_norm(self.embedding[token], (self.hidden,))  # the model's scale differs from the state's
        mixed = self.state_weight * self.proj[stage](state) + self.token_weight * embedded
        return F.gelu(self.norm[stage](mixed))

    def forward(self, hidden, tokens):
        state, out = hidden, []
        for stage in range(self.stages):
            state = self._stage(stage, state, tokens[:, stage])
            out.append(self.logits(stage, state))
        return out

    @torch.inference_mode()
    def draft(self, hidden, token, count, min_confidence=0.0):
        state, drafted, confidence = hidden, [], 1.0
        current = torch.tensor(token)
        for stage in range(min(count, self.stages)):
            state = self._stage(stage, state, current)
            pick, confidence = _pick(self.logits(stage, state), confidence, min_confidence)
            if pick is None:
                break
            current = self.vocab_ids[pick]
            drafted.append(int(current))
        return drafted

    @torch.inference_mode()
    def chains(self, hidden, tokens):
        state, current, out = hidden, tokens, []
        for stage in range(self.stages):
            state = self._stage(stage, state, current)
            current = self.vocab_ids[self.logits(stage, state).argmax(-1)]
            out.append(current)
        return torch.stack(out, dim=1)


class MedusaHeads(DraftHeads):
    kind = "medusa"

    def __init__(self, model_head: OutputHead, stages: int, vocab_ids: torch.Tensor, head: str = "own"):
        super().__init__(model_head, stages, vocab_ids, head)
        self.blocks = nn.ModuleList(nn.Linear(self.hidden, self.hidden) for _ in range(stages))
        for block in self.blocks:  # start as the identity, as Medusa does
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def _state(self, stage: int, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + F.silu(self.blocks[stage](hidden))

    def first_logits(self, hidden, token):
        return self.logits(0, self._state(0, hidden))

    def forward(self, hidden, tokens):
        return [self.logits(stage, self._state(stage, hidden)) for stage in range(self.stages)]

    @torch.inference_mode()
    def draft(self, hidden, token, count, min_confidence=0.0):
        drafted, confidence = [], 1.0
        for stage in range(min(count, self.stages)):
            pick, confidence = _pick(self.logits(stage, self._state(stage, hidden)), confidence, min_confidence)
            if pick is None:
                break
            drafted.append(int(self.vocab_ids[pick]))
        return drafted

    @torch.inference_mode()
    def chains(self, hidden, tokens):
        return torch.stack(
            [self.vocab_ids[self.logits(stage, self._state(stage, hidden)).argmax(-1)] for stage in range(self.stages)],
            dim=1,
        )


def _pick(logits: torch.Tensor, confidence: float, min_confidence: float) -> tuple[int | None, float]:
    """The argmax of a stage's logits and the running confidence; None once it is too low."""
    pick = int(torch.argmax(logits))
    if min_confidence > 0:
        confidence *= float(torch.softmax(logits.float(), dim=-1)[pick])
        if confidence < min_confidence:
            return None, confidence
    return pick, confidence


def build_heads(
    kind: str, model_head: OutputHead, stages: int, vocab_ids: torch.Tensor, head: str, context: str = "draft"
) -> DraftHeads:
    """Untrained heads; `context` (eagle): what the layer attends over (eagle_heads.CONTEXTS)."""
    if kind == "eagle":
        from kiln.runtime.eagle_heads import EagleHeads

        return EagleHeads(model_head, stages, vocab_ids, head, context)
    cls = {"mlp": MLPSpeculator, "medusa": MedusaHeads}[kind]
    return cls(model_head, stages, vocab_ids, head)


# -- the heads file ----------------------------------------------------------------------------
def save_heads(
    heads: DraftHeads, inverse_rows: torch.Tensor, directory: Path, source_hash: str | None, training: dict
) -> Path:
    """Write the heads into the artifact at `directory` and list them (sha256, bytes) in its
    manifest, with a `speculators` entry; the manifest is replaced atomically, last."""
    name = heads_file(heads.kind)
    tensors = {key: value.detach().contiguous() for key, value in heads.state_dict().items()}
    tensors["vocab_ids"] = heads.vocab_ids.clone()
    tensors["inverse_rows"] = inverse_rows.long().clone()
    metadata = {
        "format": HEADS_FORMAT,
        "kind": heads.kind,
        "stages": str(heads.stages),
        "head": heads.head_choice,
        "hidden": str(heads.hidden),
        "source_hash": source_hash or "",
    }
    if hasattr(heads, "context"):
        metadata["context"] = heads.context
    entry = {
        "file": name,
        "kind": heads.kind,
        "stages": heads.stages,
        "head": heads.head_choice,
        "draft_vocab": len(heads.vocab_ids),
        **({"context": heads.context} if hasattr(heads, "context") else {}),
        "source_hash": source_hash,
        "training": training,
    }
    return add_file(
        directory,
        name,
        lambda temporary: save_file(tensors, str(temporary), metadata=metadata),
        lambda manifest: {"speculators": {**manifest.get("speculators", {}), heads.kind: entry}},
    )


def add_file(directory: Path, name: str, write, fields) -> Path:
    """Write file `name` into the artifact at `directory` (`write(path)`, atomically), list it
    (sha256, bytes) in the manifest and merge `fields(manifest)` into it; the manifest is
    replaced atomically, last, one writer at a time (two trainings ending together)."""
    directory = Path(directory)
    with open(directory / MANIFEST, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = read_manifest(directory)
        path = directory / name
        _atomic(path, write)
        files = {**manifest["files"], name: {"sha256": file_sha256(path), "bytes": path.stat().st_size}}
        updated = {**manifest, "files": files, **fields(manifest)}
        updated.pop("fields_sha256", None)
        text = json.dumps(sealed(updated), indent=2, sort_keys=True) + "\n"
        _atomic(directory / MANIFEST, lambda target: target.write_text(text, encoding="utf-8"))
        return path


def _atomic(target: Path, write) -> None:
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    try:
        write(Path(temporary))
        os.chmod(temporary, 0o644)  # as the artifact's other files (mkstemp makes it private)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def read_listed(directory: Path, manifest: dict, name: str, what: str, remedy: str) -> tuple[dict, dict]:
    """(metadata, tensors) of the safetensors file `name` the manifest lists; ArtifactError naming
    it (`what`, and the command that makes it again: `remedy`) when it is missing, does not match
    its sha256 or cannot be read."""
    path = Path(directory) / name
    listed = manifest.get("files", {}).get(name, {})
    if not path.is_file() or file_sha256(path) != listed.get("sha256"):
        raise ArtifactError(
            f"{path} is missing or does not match its sha256 in {MANIFEST}: the {what} is "
            f"damaged. Fix: make it again with {remedy}."
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(
            f"{path} is not a readable safetensors file ({e}). Fix: make it again with {remedy}."
        ) from None


def load_heads(directory: Path, manifest: dict, model_head: OutputHead, kind: str | None = None):
    """(heads, inverse_rows) of `kind` (None: eagle, else mlp, else the only kind there) from the artifact;
    ArtifactError when there are none, they are damaged, or they were trained for another model."""
    directory = Path(directory)
    trained = manifest.get("speculators") or {}
    if not trained:
        raise ArtifactError(f"{directory} has no draft heads. Fix: `kiln train-speculator {directory}` first.")
    kind = kind or next((k for k in ("eagle", "mlp") if k in trained), sorted(trained)[0])
    entry = trained.get(kind)
    if not isinstance(entry, dict) or entry.get("file") not in manifest["files"]:
        raise ArtifactError(
            f"{directory} has no {kind} heads (it has: {sorted(trained)}). "
            f"Fix: `kiln train-speculator {directory} --kind {kind}`."
        )
    path = directory / entry["file"]
    metadata, tensors = read_listed(
        directory, manifest, entry["file"], "heads file", f"`kiln train-speculator {directory} --kind {kind}`"
    )
    _check_fits(path, metadata, tensors, manifest, model_head)
    # eagle heads stored before the whole-context form attend over the draft's own positions
    from kiln.runtime.eagle_heads import CONTEXTS

    context = metadata.get("context", "draft")
    if context not in CONTEXTS:
        raise ArtifactError(
            f"{path} holds eagle heads attending over {context!r}, which this Kiln does not know. "
            "Fix: retrain the heads with this Kiln."
        )
    heads = build_heads(
        metadata["kind"], model_head, int(metadata["stages"]), tensors.pop("vocab_ids"), metadata["head"], context
    )
    inverse_rows = tensors.pop("inverse_rows")
    try:
        heads.load_state_dict(tensors)
    except RuntimeError as e:
        raise ArtifactError(
            f"{path} does not hold {kind} heads of the shape its metadata says ({_first_line(e)}). "
            "Fix: retrain the heads."
        ) from None
    return heads.eval(), inverse_rows


def _check_fits(path, metadata: dict, tensors: dict, manifest: dict, model_head: OutputHead) -> None:
    """Heads trained for this model: same checkpoint (source_hash), hidden size and vocabulary."""
    if (
        metadata.get("format") != HEADS_FORMAT
        or metadata.get("kind") not in KINDS
        or metadata.get("head") not in HEAD_CHOICES
        or "vocab_ids" not in tensors
        or "inverse_rows" not in tensors
    ):
        raise ArtifactError(f"{path} is not a Kiln heads file ({metadata.get('format')!r}). Fix: retrain the heads.")
    vocab, hidden = model_head.weight.shape
    source = manifest.get("source_hash")
    ids = tensors["vocab_ids"]
    if (
        (metadata.get("source_hash") or None) != source
        or int(metadata.get("hidden", -1)) != hidden
        or len(ids) == 0
        or int(ids.max()) >= vocab
    ):
        raise ArtifactError(
            f"{path} holds heads trained for another model (source_hash "
            f"{metadata.get('source_hash', '')[:12]!r}, hidden {metadata.get('hidden')}; this "
            f"artifact: {(source or '')[:12]!r}, hidden {hidden}). Fix: `kiln train-speculator` "
            "on this artifact."
        )


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
