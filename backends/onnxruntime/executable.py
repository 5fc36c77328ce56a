"""An ONNX model run by an `InferenceSession` through IOBinding over KV buffers it owns.

Each cache is one preallocated buffer [max_batch, kv_heads, max_seq_len, head_dim]. A call with
`batch` rows binds a view of rows [0, batch) (by pointer, no copy) as the model's `cache.*` input:
- in place: GroupQueryAttention caches are bound as the matching `present.*` output too, so the
  kernel writes the new keys and values into the buffer it reads (ORT's past-present buffer
  sharing); nothing is copied per step, and the bindings stay as they are while the batch
  size does not change;
  A cache a plain ScatterND updates, when nothing else reads it, is bound the same way (ORT's
  ScatterND copies its data input to its output only when the two buffers differ);
- copied back: a cache something else also reads gets its `present.*` in a scratch tensor,
  copied into the buffer's rows after the call (CPU only).
A paged cache's pools [num_blocks, kv_heads, block_size, head_dim] are bound whole, input and
output alike (its ScatterND writes them in place), and each call's `block_table` is fed like the
tokens (kiln.backends.paged_feeds checks it).

GroupQueryAttention derives the slots it writes from each row's last one, so slots (the positions,
unless a token tree gives them apart) must be contiguous per row (checked), and it takes a
multi-token step with past context only for batch 1: such a call with several rows runs one row at
a time. A model compiled with token trees also takes `slots` and `tree` (kiln.backends.token_trees):
its kernel reads RoPE's positions as position_ids and the tree as an attention bias.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from kiln.backends.cache_rows import check_rows, checked_feeds
from kiln.backends.executable import BackendOptions, Executable
from kiln.backends.paged_feeds import layout_feeds
from kiln.backends.token_trees import refuse_trees, tree_feeds
from kiln.ir import to_torch

from .errors import FeedError, ProviderError
from .model_files import DATA_FILE, MODEL_FILE, read_info
from .paged_attention import BLOCK_TABLE
from .providers import (
    check_lengths_fed,
    check_supported,
    choose_provider,
    device_binding,
    provider_list,
    session_options,
)
from .to_onnx import LOGIT_POSITIONS, SEQLENS_K, TOTAL_LENGTH


class OrtExecutable(Executable):
    """A compiled stateful forward on ONNX Runtime that owns its KV buffers."""

    def __init__(self, model_path: Path, options: BackendOptions, workdir: tempfile.TemporaryDirectory | None = None):
        self.options = options
        self.model_path = Path(model_path)
        self._workdir = workdir  # the lowered model's files live as long as the executable
        self.info = read_info(self.model_path)
        self.provider = choose_provider(options.device)
        model = onnx.load(str(self.model_path), load_external_data=False)
        check_supported(model, self.provider)
        check_lengths_fed(model, self.info, self.provider)
        self.session = ort.InferenceSession(
            str(self.model_path), session_options(options), providers=provider_list(self.provider, options.device)
        )
        self.device_type, self.device_id = device_binding(options.device)
        if self.device_type != "cpu" and not all(c["in_place"] for c in self.info["caches"]):
            raise ProviderError(
                f"this model updates some KV caches with plain ONNX ops, which the executable "
                f"copies back on the CPU only, not on {options.device}. Fix: use device='cpu'."
            )
        self.paged = self.info.get("paged")  # a pool of blocks per cache, fed a block table
        if self.paged is not None and not all(c["in_place"] for c in self.info["caches"]):
            raise ProviderError(
                "this model's paged KV pools are not all written in place (something else reads a pool "
                "before its kv_write); recompile it with this version of Kiln."
            )
        self.hold_caches([self._allocate(c) for c in self.info["caches"]], [c["shape"] for c in self.info["caches"]])
        # optional Executable capabilities (backends/executable.py), fixed per model
        self.copies_rows = all(isinstance(c, torch.Tensor) for c in self.caches)  # cache_views can be had
        self.selects_logits = LOGIT_POSITIONS in self.info["inputs"]  # run(..., last_only=True) skips the rest
        # torch writes these buffers (zeroing, prefix copies) on its own CUDA stream, ORT on another
        self._torch_stream = (
            torch.cuda.current_stream(self.caches[0].device)
            if self.caches and isinstance(self.caches[0], torch.Tensor) and self.caches[0].is_cuda
            else None
        )
        self.binding = self.session.io_binding()
        self._bound_rows: tuple[int, int] | None = None
        self._feed_arrays: dict[tuple[int, int, bool], dict[str, np.ndarray]] = {}  # (batch, seq, last_only)
        self._plain_trees: set[tuple[int, int, bool]] = set()  # shapes whose tree array holds the lower triangle
        self.token_trees = bool(self.info.get("token_trees"))
        self.verifies_trees = bool(self.info.get("verifies_trees"))  # kiln.backends.token_trees
        self._bound_feed_shape: tuple[int, int, bool] | None = None
        self._bound_logits: tuple[int, int, int] | None = None  # (pointer, batch, seq) of a bound `out`
        # Fixed per model, looked up once: a decode step is a few milliseconds, and Python work
        # per cache per call (60 caches for SmolLM2) would be a measurable share of it.
        self._copied_back = [i for i, c in enumerate(self.info["caches"]) if not c["in_place"]]
        self._logits_dtype = to_torch(self.info["logits_dtype"])
        self._logits_numpy_dtype = _numpy_dtype(self._logits_dtype)

    def _allocate(self, cache: dict):
        """A zeroed buffer: a torch tensor where torch can address the device (so the engine can
        copy cached prefixes between rows), else an ORT value on the device."""
        dtype = to_torch(cache["dtype"])
        if self.device_type == "cpu":
            return torch.zeros(cache["shape"], dtype=dtype)
        if self.device_type == "cuda" and torch.cuda.is_available():
            return torch.zeros(cache["shape"], dtype=dtype, device=f"cuda:{self.device_id}")
        buffer = ort.OrtValue.ortvalue_from_shape_and_type(
            cache["shape"], _numpy_dtype(dtype), self.device_type, self.device_id
        )
        buffer.update_inplace(np.zeros(cache["shape"], _numpy_dtype(dtype)))
        return buffer

    def reset(self) -> None:
        """Forget all cached keys and values (zero the buffers)."""
        for cache, spec in zip(self.caches, self.info["caches"]):
            if isinstance(cache, torch.Tensor):
                cache.zero_()
            else:
                cache.update_inplace(np.zeros(spec["shape"], _numpy_dtype(to_torch(spec["dtype"]))))

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        first_row: int = 0,
        out: torch.Tensor | None = None,
        last_only: bool = False,
        *,
        slots: torch.Tensor | None = None,
        tree: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab] for int64 tokens/positions [batch, seq] ([batch, 1, vocab]
        of the last position with `last_only`, where the model can select them); writes the caches
        of rows [first_row, first_row + batch) (bound by pointer: any row costs the same). `out`,
        a contiguous CPU tensor of that shape and the logits dtype, receives the logits instead of
        a new tensor (the engine's decode steps: no allocation, no rebinding per token).
        `slots`/`tree`: see kiln.backends.token_trees (a plain call's when left out);
        `block_table` (a paged cache, whose blocks replace rows): kiln.backends.paged_feeds."""
        table = layout_feeds(self.paged, tokens.size(0), first_row, block_table)
        tokens, positions = checked_feeds(tokens, positions, self.max_batch, self.max_seq_len)
        slots, tree = self._check_trees(positions, slots, tree)
        batch, seq = tokens.shape
        check_rows(first_row, batch, self.max_batch)
        last_only = last_only and self.selects_logits
        written = positions if slots is None else slots
        if seq > 1 and batch > 1 and self.info["contiguous_positions"] and bool(written[:, 0].any()):
            rows = [
                self._run_rows(
                    tokens[r : r + 1],
                    positions[r : r + 1],
                    first_row + r,
                    last_only=last_only,
                    slots=None if slots is None else slots[r : r + 1],
                    tree=None if tree is None else tree[r : r + 1],
                )
                for r in range(batch)
            ]
            kept = 1 if last_only else seq
            return torch.cat(rows) if out is None else torch.cat(rows, out=self._checked_out(out, batch, kept))
        return self._run_rows(tokens, positions, first_row, out, last_only, slots, tree, *table)

    def cache_views(self) -> list[torch.Tensor]:
        if not self.copies_rows:
            raise ProviderError(
                f"KV rows on {self.options.device} are not addressable here (torch has no "
                f"{self.device_type} support); prefix copies need a torch build for that device"
            )
        return self.caches

    def _check_trees(self, positions: torch.Tensor, slots, tree) -> tuple:
        """(slots, tree) checked, or None for each a plain call leaves out (filled on binding);
        the slots GroupQueryAttention writes (the positions when no slots are given) contiguous."""
        if not self.token_trees:
            refuse_trees(slots, tree)
        elif slots is not None or tree is not None:
            slots, tree = tree_feeds(positions, slots, tree)
            checked_feeds(slots, slots, self.max_batch, self.max_seq_len)  # every slot within the cache
        written = positions if slots is None else slots
        if self.info["contiguous_positions"] and written.size(1) > 1:
            name = "positions" if slots is None else "slots"
            expected = written[:, :1] + torch.arange(written.size(1))
            if not torch.equal(written, expected):
                raise FeedError(
                    f"{name} must be contiguous in each row (row b at {name}[b, 0], +1, +2, ...) "
                    "for the onnxruntime backend: GroupQueryAttention derives them from each row's "
                    f"last one. Fix: feed contiguous {name}, or use another backend."
                )
            if self.info.get("position_ids") and slots is not None and self._first_prompt_moved(positions, slots):
                raise FeedError(
                    "a row's first tokens (slots from 0) must sit at positions equal to their slots on "
                    "the onnxruntime backend: GroupQueryAttention rotates a first prompt from its first "
                    "position. Fix: run the prompt before the tree, or use another backend."
                )
        return slots, tree

    @staticmethod
    def _first_prompt_moved(positions: torch.Tensor, slots: torch.Tensor) -> bool:
        first = slots[:, 0] == 0
        return bool(first.any()) and not torch.equal(positions[first], slots[first])

    def _run_rows(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        first_row: int,
        out: torch.Tensor | None = None,
        last_only: bool = False,
        slots: torch.Tensor | None = None,
        tree: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One session run over cache rows [first_row, first_row + batch) (a paged call: its
        block table's blocks)."""
        batch, seq = tokens.shape
        self._bind_feeds(tokens, positions, last_only, slots, tree, block_table)
        if self._bound_rows != (first_row, batch):
            self._bind_caches(first_row, batch)
        scratch = self._bind_scratch(batch) if self._copied_back else []
        logits = self._bind_logits(batch, 1 if last_only else seq, out)
        if self._torch_stream is not None:
            self._torch_stream.synchronize()
        self.session.run_with_iobinding(self.binding)
        for index, out_cache in zip(self._copied_back, scratch):
            self.caches[index][first_row : first_row + batch].copy_(out_cache)
        return logits if isinstance(logits, torch.Tensor) else torch.from_numpy(logits.numpy())  # device -> host

    def _bind_feeds(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        last_only: bool = False,
        slots: torch.Tensor | None = None,
        tree: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
    ) -> None:
        """Copy the feeds into this shape's own arrays, bound once by pointer: binding fresh
        arrays costs more per decode step than the copy. Left-out slots are the positions, a
        left-out tree the lower triangle (written again only after a call that gave a tree)."""
        shape = (*tokens.shape, last_only)
        arrays = self._feed_arrays.get(shape)
        if arrays is None:
            arrays = self._feed_arrays[shape] = {
                name: _feed_array(name, shape, self.paged) for name in self.info["inputs"]
            }
        position_array = positions.numpy()
        slot_array = position_array if slots is None else slots.numpy()
        for name, array in arrays.items():
            if name == LOGIT_POSITIONS:  # fixed per shape
                continue
            if name == "tokens":
                array[...] = tokens.numpy()
            elif name == "positions":
                array[...] = position_array
            elif name == "slots":
                array[...] = slot_array
            elif name == "tree":
                self._fill_tree(array, shape, tree)
            elif name == BLOCK_TABLE:
                array[...] = block_table.numpy()
            elif name == SEQLENS_K:  # each row's last slot
                np.max(slot_array, axis=1, out=array, initial=0)
            else:  # TOTAL_LENGTH: the largest slot + 1
                array[...] = slot_array.max() + 1
        # binding copies a CPU input to a device at once (ORT's IOBinding): there, bind every step
        if self._bound_feed_shape != shape or self.device_type != "cpu":
            for name, array in arrays.items():
                self.binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
            self._bound_feed_shape = shape

    def _fill_tree(self, array: np.ndarray, shape: tuple, tree: torch.Tensor | None) -> None:
        if tree is not None:
            array[...] = tree.numpy()
            self._plain_trees.discard(shape)
        elif shape not in self._plain_trees:
            array[...] = np.tril(np.ones(array.shape[-2:], dtype=bool))
            self._plain_trees.add(shape)

    def _bind_caches(self, first_row: int, batch: int) -> None:
        """Bind rows [first_row, first_row + batch) of each buffer by pointer (no copy); a paged
        pool whole."""
        for cache, spec in zip(self.caches, self.info["caches"]):
            dtype = _numpy_dtype(to_torch(spec["dtype"]))
            row_bytes = int(np.prod(spec["shape"][1:])) * np.dtype(dtype).itemsize
            pointer, shape = cache.data_ptr() + first_row * row_bytes, [batch, *spec["shape"][1:]]
            if self.paged is not None:
                pointer, shape = cache.data_ptr(), list(spec["shape"])
            self.binding.bind_input(spec["input"], self.device_type, self.device_id, dtype, shape, pointer)
            if spec["in_place"]:
                self.binding.bind_output(spec["output"], self.device_type, self.device_id, dtype, shape, pointer)
        self._bound_rows = (first_row, batch)

    def _bind_scratch(self, batch: int) -> list[torch.Tensor]:
        """Fresh tensors for the caches updated by plain ONNX (their present.* is a new tensor)."""
        out = []
        for index in self._copied_back:
            cache, spec = self.caches[index], self.info["caches"][index]
            scratch = torch.empty([batch, *cache.shape[1:]], dtype=cache.dtype)
            self.binding.bind_output(
                spec["output"], "cpu", 0, _numpy_dtype(cache.dtype), list(scratch.shape), scratch.data_ptr()
            )
            out.append(scratch)
        return out

    def logits_buffer(self, batch: int, seq: int) -> torch.Tensor | None:
        """A tensor `run` can write logits [batch, seq, vocab] into (`out=`); None off the CPU."""
        if self.device_type != "cpu":
            return None
        return torch.empty(batch, seq, self.info["vocab"], dtype=self._logits_dtype)

    def _checked_out(self, out: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        shape = (batch, seq, self.info["vocab"])
        if (
            self.device_type != "cpu"
            or tuple(out.shape) != shape
            or out.dtype != self._logits_dtype
            or not out.is_contiguous()
            or out.device.type != "cpu"
        ):
            raise FeedError(
                f"out must be a contiguous CPU {self._logits_dtype} tensor {list(shape)} on a CPU "
                f"session, got {out.dtype} {list(out.shape)} on {out.device}"
            )
        return out

    def _bind_logits(self, batch: int, seq: int, out: torch.Tensor | None = None):
        """The logits output: `out` (checked and bound only when it is another buffer than the one
        bound: not per decode step) or a fresh tensor (on the CPU a torch tensor: no copy after)."""
        dtype = self._logits_dtype
        if self.device_type != "cpu":
            if out is not None:
                self._checked_out(out, batch, seq)  # raises: `out` is for CPU sessions
            logits = ort.OrtValue.ortvalue_from_shape_and_type(
                [batch, seq, self.info["vocab"]], _numpy_dtype(dtype), self.device_type, self.device_id
            )
            self.binding.bind_ortvalue_output(self.info["logits"], logits)
            return logits
        logits = out if out is not None else torch.empty(batch, seq, self.info["vocab"], dtype=dtype)
        key = (logits.data_ptr(), batch, seq)
        if out is None or self._bound_logits != key:
            if out is not None:
                self._checked_out(out, batch, seq)
            self.binding.bind_output(
                self.info["logits"], "cpu", 0, self._logits_numpy_dtype, list(logits.shape), logits.data_ptr()
            )
            self._bound_logits = key if out is not None else None
        return logits

    def save(self, directory: Path) -> list[str]:
        return save_model_files(self.model_path, directory)


class OrtModelForAnotherMachine(Executable):
    """A lowered model for an execution provider this machine lacks (e.g. an f16 model for CUDA
    compiled on a CPU-only machine): checked, saved into the artifact, run where kiln.load finds
    the provider."""

    def __init__(self, model_path: Path, options: BackendOptions, provider: str, workdir=None):
        self.options, self.model_path, self.provider = options, Path(model_path), provider
        self._workdir = workdir
        self.info = read_info(self.model_path)

    def run(self, tokens, positions, first_row: int = 0):
        raise self._not_here()

    def cache_views(self):
        raise self._not_here()

    def _not_here(self) -> ProviderError:
        return ProviderError(
            f"this model was lowered for {self.provider}, which this onnxruntime {ort.__version__} "
            "lacks. Fix: save it (kiln.compile does) and kiln.load it on a machine with the provider "
            "(onnxruntime-gpu for CUDA)."
        )

    def reset(self) -> None:
        pass

    def save(self, directory: Path) -> list[str]:
        return save_model_files(self.model_path, directory)


def save_model_files(model_path: Path, directory: Path) -> list[str]:
    """Put model.onnx and model.onnx.data into `directory` (hard links where the file system
    allows, else copies); returns their names."""
    import os
    import shutil

    for name in (MODEL_FILE, DATA_FILE):
        source, target = Path(model_path).parent / name, Path(directory) / name
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
    return [MODEL_FILE, DATA_FILE]


def _feed_array(name: str, shape: tuple[int, int, bool], paged: dict | None = None) -> np.ndarray:
    """The array an input is fed from, for tokens [batch, seq] (and whether only the last
    position's logits are wanted) and a paged cache's layout."""
    batch, seq, last_only = shape
    if name == BLOCK_TABLE:
        return np.empty((batch, paged["blocks_per_row"]), np.int32)
    if name == LOGIT_POSITIONS:
        return np.array([seq - 1], np.int64) if last_only else np.arange(seq, dtype=np.int64)
    if name == SEQLENS_K:
        return np.empty(batch, np.int32)
    if name == TOTAL_LENGTH:
        return np.empty((), np.int32)
    if name == "tree":
        return np.empty((batch, seq, seq), np.bool_)
    return np.empty((batch, seq), np.int64)


def _numpy_dtype(dtype: torch.dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype.type
