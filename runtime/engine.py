"""Continuous batching: one scheduler thread over the static KV buffers' `max_batch` rows.

Each request gets a row of its own for its whole life. Every engine step
1. admits waiting requests into free rows (reusing cached prefixes, kv_slots.py);
2. feeds one chunk (at most `prefill_chunk` tokens) of the oldest request that has more than one
   token to feed (a prompt, or its newest token plus the tokens a constraint forced after it:
   fast-forward) through a single-row call at its row;
3. runs one decode call over rows [0, highest decoding row] that feeds every decoding request
   its newest token and samples its next one; before it, when no request waits for a row, the
   request in the highest busy row moves into the lowest free row below it (`row_moves.py`), so the
   call does not keep spanning rows freed as a batch drains.
So a long prompt is prefilled a chunk at a time between decode steps instead of stalling them,
and a request that finishes frees its row for the next one at once. Rows in the decode call
with nothing to decode (free, or still prefilling) get a placeholder at the slot their next
real token will overwrite, which no query can see before that.

A request's output does not depend on what runs beside it: rows never read each other's slots,
and each request samples from its own seeded generator.

With a paged KV cache (an executable compiled with kv_layout="paged"), a row is a lane of the
call's block table instead, and memory is the pool's blocks (kv_blocks.py): a request is
admitted when its tokens' blocks are free, takes a block each time it fills one, shares the
blocks of a prefix others computed, and is preempted when the pool runs out (engine_paging.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from contextlib import contextmanager

import numpy as np
import torch

from kiln.backends.cache_rows import copy_prefix, copy_slots
from kiln.backends.executable import capabilities
from kiln.backends.token_trees import executable_verifies_trees, lower_triangle
from kiln.runtime.draft_tree import DraftTree
from kiln.runtime.engine_paging import block_copier, decode_table_feed, make_room, table_feed
from kiln.runtime.errors import QueueFullError
from kiln.runtime.kv_blocks import KvBlocks
from kiln.runtime.kv_slots import KvSlots
from kiln.runtime.request import GenerationSettings, Request, RequestStatus
from kiln.runtime.request_handle import RequestHandle
from kiln.runtime.row_moves import move_top_row_down
from kiln.runtime.token_ids import check_request_ids, model_vocab_size

log = logging.getLogger(__name__)

PREFILL_CHUNK = 128
MAX_QUEUE = 256
SHARED_PREFILL = 16  # prompt tokens worth waiting for another request to prefill (`_prefill_to_share`)


class Engine:
    """The scheduler. `submit` from any thread; a daemon thread runs the steps."""

    def __init__(
        self,
        executable,
        decoder_factory=None,
        prefill_chunk: int = PREFILL_CHUNK,
        max_queue: int = MAX_QUEUE,
        prefix_caching: bool = True,
        vocab_size: int | None = None,
    ):
        self.executable = executable
        self.max_batch = executable.options.max_batch
        self.max_seq_len = executable.options.max_seq_len
        self.vocab_size = vocab_size or model_vocab_size(executable)
        self.decoder_factory = decoder_factory
        self.prefill_chunk = max(2, prefill_chunk)
        self.max_queue = max_queue
        self.capabilities = capabilities(executable)  # the optional ones (backends/executable.py)
        # drafts as token trees: where a tree is verified in one call and accepted slots can be moved
        self.verifies_trees = self.capabilities.copies_rows and executable_verifies_trees(executable)
        self.paged = getattr(executable, "paged", None)  # the block pool's layout, or None: static rows
        self.preemptions = 0  # requests a paged cache's pool ran out for (engine_paging.py)
        if self.paged:
            self.verifies_trees = False  # drafts are not verified in the engine over a paged cache yet
            self.slots = KvBlocks(self.max_batch, self.paged, block_copier(executable), prefix_caching)
        else:
            self.slots = KvSlots.serving(self.max_batch, prefix_caching, self.capabilities)
        # a prompt chunk needs its last position's logits only, where the executable can skip the rest
        self._last_only = {"last_only": True} if self.capabilities.selects_logits else {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_id = 0
        self._lock = threading.Lock()  # guards `waiting` and the id counter
        self._work = threading.Event()
        self._stepping = threading.RLock()  # held during a step; `exclusive()` holds it too
        self._thread: threading.Thread | None = None
        self._decode_logits: dict[int, dict] = {}  # rows -> run()'s `out=` for decode steps, if any

    # -- any thread ----------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def slots_in_use(self) -> int:
        return self.slots.in_use

    @property
    def blocks_in_use(self) -> int | None:
        """Blocks of a paged KV cache holding a request's keys and values (None: static rows)."""
        return self.slots.blocks_in_use if self.paged else None

    @property
    def blocks_free(self) -> int | None:
        return self.slots.blocks_free if self.paged else None

    def submit(
        self,
        prompt: list[int],
        settings: GenerationSettings,
        seed: int,
        bounded: bool = True,
        sink: queue.SimpleQueue | None = None,
        tag=None,
        background: bool = True,
    ) -> RequestHandle:
        """Queue a request (its settings validated by the caller; its token ids checked here, as
        an id outside the vocabulary would fail the model call); `bounded` refuses it when
        max_queue wait. `background=False` leaves the stepping to the caller (`drive`) unless the
        engine thread already runs."""
        check_request_ids(prompt, settings, self.vocab_size)
        with self._lock:
            if bounded and len(self.waiting) >= self.max_queue:
                raise QueueFullError(self.max_queue)
            handle = RequestHandle(self._next_id, sink, tag)
            self._next_id += 1
            decoder = self.decoder_factory() if self.decoder_factory else None
            self.waiting.append(Request(list(prompt), settings, seed, self.max_seq_len, decoder, handle))
        if background:
            self._ensure_thread()
        self._work.set()
        return handle

    @property
    def threaded(self) -> bool:
        """Whether the engine thread runs (then it does all the stepping)."""
        return self._thread is not None and self._thread.is_alive()

    def drive(self) -> bool:
        """One step in the calling thread (when no engine thread runs); whether work remains.

        Why not always the engine thread: torch's OpenMP pools belong to the thread that starts a
        parallel region, and a pool whose workers still spin slows down another thread's pool
        severalfold on a small machine. A process that calls the model from its main thread
        (generate, perplexity, benchmarks) therefore keeps every model call there."""
        with self._stepping:
            return self.step()

    @contextmanager
    def exclusive(self):
        """Hold the executable alone (e.g. for speculative decoding, which uses rows from 0):
        waits until no request is running, and forgets every row's cached prefix afterwards."""
        while True:
            self._stepping.acquire()
            if not self.running and not self.waiting:
                break
            if not self.threaded:  # nobody else will run what is left (e.g. an abandoned stream)
                self.step()
            self._stepping.release()
            time.sleep(0.001)
        try:
            yield self.executable
        finally:
            self.slots.forget()
            self._stepping.release()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
            self._thread.start()

    def run_in_this_thread(self, stop: threading.Event) -> None:
        """Make the calling thread the engine thread until `stop` is set (`kiln serve` gives it
        the main thread, and serves HTTP from another).

        Why: libgomp (torch's OpenMP) lets a pool's idle workers spin for the next parallel region
        only while no more threads than cores sit in pools. The main thread, which loading the
        model already gave a pool, is the one that can keep that; a daemon engine thread beside it
        gets workers that sleep between regions, and a decode step (~150 parallel regions) pays a
        wake-up for each: SmolLM2-135M's step took 12.7 ms on the main thread, 27.5 ms on another
        (2 threads, 2 cores)."""
        self.adopt_this_thread()
        try:
            self._loop(stop)
        finally:
            self._thread = None

    def adopt_this_thread(self) -> None:
        """Mark the calling thread as the engine thread, so that `submit` from other threads
        starts none, before it enters `run_in_this_thread` (no request can slip in between)."""
        if self.threaded and self._thread is not threading.current_thread():
            raise RuntimeError("the engine already runs in another thread; adopt this one before any submit")
        self._thread = threading.current_thread()

    def _loop(self, stop: threading.Event | None = None) -> None:
        while stop is None or not stop.is_set():
            if not self._work.wait(timeout=None if stop is None else 0.1):
                continue
            self._work.clear()  # cleared before stepping: a submit during the step sets it again
            busy = True
            while busy:
                with self._stepping:
                    busy = self.step()

    # -- the engine thread ---------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step; whether any request is still waiting or running."""
        try:
            self._drop_cancelled()
            self._admit()
            prefilling = next((r for r in self.running if r.unfed > 1), None)
            if prefilling is not None:
                self._guarded([prefilling], self._feed_chunk, prefilling)
            self._compact()
            decoding = [r for r in self.running if r.unfed == 1]
            if decoding:
                self._guarded(decoding, self._decode, decoding)
        except Exception as error:
            log.exception("engine step failed; failing every request in flight")
            self._fail_all(error)
        return bool(self.running or self.waiting)

    def _admit(self) -> None:
        while self.waiting:
            request = self.waiting[0]
            try:
                if not self._admit_next(request):
                    return
            except Exception as error:  # noqa: BLE001 - that request fails, the others go on
                self._fail(request, error)

    def _admit_next(self, request: Request) -> bool:
        """Give the first waiting request a free KV row; False when none is free, or when it
        should wait for a prefill in flight (`_prefill_to_share`)."""
        if self._prefill_to_share(request):
            return False
        tokens = request.prompt + request.tokens  # a preempted request resumes with what it generated
        placement = self.slots.place(tokens, self.prefill_chunk)
        if placement is None:
            return False
        with self._lock:
            self.waiting.popleft()
        if not request.generating:  # nothing to generate (max_new_tokens 0)
            self._end(request, RequestStatus.DONE)
            return True
        request.status = RequestStatus.RUNNING
        request.kv_row, request.fed = placement.row, placement.reused
        if not request.tokens:
            request.reused = placement.reused
        if self.paged:
            self.slots.occupy(request.kv_row, request, tokens, placement.reused)
        else:
            self.slots.occupy(request.kv_row, request, tokens[: placement.reused], placement.labels)
        self.running.append(request)
        if placement.copy_from is not None:
            copy_prefix(self.executable.cache_views(), placement.copy_from, placement.row, placement.reused)
        return True

    def _prefill_to_share(self, request: Request) -> bool:
        """Whether a running request is still prefilling at least SHARED_PREFILL tokens that
        `request`'s prompt starts with. Admitted once they are fed, `request` copies them from that
        row (prefix caching) instead of computing them again: the samples of `n` / `best_of`, or a
        burst of requests behind one system prompt, prefill their common part once."""
        if not (self.slots.prefix_caching and self.slots.row_copies):
            return False
        for other in self.running:
            if other.fed < len(other.prompt):
                shared = self.slots.shareable(other.prompt, request.prompt, self.prefill_chunk)
                if shared >= SHARED_PREFILL and shared > other.fed:
                    return True
        return False

    def _compact(self) -> None:
        if not self.paged and not self.waiting and self.slots.row_copies:
            move_top_row_down(self.slots, self.executable, self.running)

    def _feed_chunk(self, request: Request) -> None:
        start = time.perf_counter()
        tokens = request.pending()[: self.prefill_chunk]
        if self.paged and not make_room(self, [request], len(tokens)):
            return  # preempted: the pool has no block for it now
        positions = torch.arange(request.fed, request.fed + len(tokens), dtype=torch.int64)[None]
        every_row = request.reads_prompt  # a drafter with a draft cache over the prompt's states
        kept = {} if every_row else self._last_only
        feeds = torch.tensor([tokens], dtype=torch.int64), positions
        logits = self.executable.run(*feeds, **self._rows([request.kv_row]), **kept)
        self.slots.fed(request.kv_row, tokens, request.fed)
        request.fed += len(tokens)
        if every_row:  # all but the row that chooses the first new token (accept shows that one)
            rows = logits[0] if request.unfed else logits[0, :-1]
            request.observe_prompt(rows.float(), request.fed - len(tokens))
        if not request.unfed:
            self._accept(request, logits[0, -1])
        request.prefill_s += time.perf_counter() - start

    def _decode(self, requests: list[Request]) -> None:
        """One call over KV rows [0, the highest decoding one]: each decoding request's newest token
        (and its drafts, for requests with a drafter: `_verify`)."""
        if self.paged:  # each request's next slot needs a block (some may be preempted for it)
            requests = make_room(self, requests, 1)
            if not requests:
                return
        drafts = [] if self.paged else [self._draft(request) for request in requests]
        if any(drafts):
            return self._verify(requests, drafts)
        start = time.perf_counter()
        batch_rows = max(r.kv_row for r in requests) + 1
        # Python lists, one tensor each at the end: element-wise writes into a tensor cost
        # microseconds apiece, which the engine would pay every token.
        tokens = [0] * batch_rows
        positions = [
            min(len(self.slots.contents[kv_row]), self.max_seq_len - 1)  # placeholders
            for kv_row in range(batch_rows)
        ]
        for request in requests:
            tokens[request.kv_row], positions[request.kv_row] = request.newest(), request.fed
        logits = self.executable.run(
            torch.from_numpy(np.array(tokens, dtype=np.int64).reshape(batch_rows, 1)),
            torch.from_numpy(np.array(positions, dtype=np.int64).reshape(batch_rows, 1)),
            **self._logits_out(batch_rows),
            **(decode_table_feed(self.slots, requests, batch_rows) if self.paged else {}),
        )
        # rows of logits through numpy views: torch indexing is dispatcher work per row per token
        numpy_logits = logits.numpy()[:, 0] if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
        for kv_row in range(batch_rows):
            self.slots.scribbled(kv_row, positions[kv_row])
        for request in requests:
            kv_row = request.kv_row
            self.slots.fed(kv_row, [tokens[kv_row]], request.fed)
            request.fed += 1
            self._accept(
                request, torch.from_numpy(numpy_logits[kv_row]) if numpy_logits is not None else logits[kv_row, 0]
            )
        elapsed = time.perf_counter() - start
        for request in requests:
            request.decode_s += elapsed

    def _draft(self, request: Request) -> DraftTree:
        """The request's drafts (none without a drafter): a tree where the executable verifies
        token trees and can move a row's slots, else a chain."""
        return request.draft(self.max_seq_len, trees=self.verifies_trees, vocab_size=self.vocab_size)

    def _verify(self, requests: list[Request], drafts: list[DraftTree]) -> None:
        """Speculative decoding in the engine: one call over KV rows [0, the highest decoding one]
        feeding each decoding request its newest token and its draft tree's nodes in the slots
        after it (`kiln.backends.token_trees`; a chain needs no tree inputs), rows padded to the
        widest draft with copies of their last node (pads and rejected drafts write slots past the
        request's tokens, which the next step overwrites before any query reads them). Every row's
        slots are consecutive and inside the cache, as every backend needs: the call is no wider
        than the room the fullest decoding row has left nor than the executable's `exact_width`
        (drafts beyond it are cut), and a row no
        request decodes in writes its placeholders at the end of its cache.
        Each request keeps its accepted drafts, moved to the slots right after its newest token,
        and adds the target's own token after them."""
        start = time.perf_counter()
        width = min(1 + max(len(d) for d in drafts), min(self.max_seq_len - r.fed for r in requests))
        width = min(width, self.capabilities.exact_width or width)  # greedy output stays plain's
        drafts = [d if len(d) < width else d.within(None, width - 1) for d in drafts]
        batch_rows = max(r.kv_row for r in requests) + 1
        trees = not all(d.is_chain for d in drafts)
        feeds = [self._pad_feed(kv_row, width) for kv_row in range(batch_rows)]
        for request, draft in zip(requests, drafts):
            feeds[request.kv_row] = self._draft_feed(request, draft, width)
        tokens, positions, slots, visible = (torch.stack([torch.as_tensor(f[k]) for f in feeds]) for k in range(4))
        extra = {"slots": slots, "tree": visible} if trees else {}
        logits = self.executable.run(tokens, slots if not trees else positions, **extra)
        for kv_row in range(batch_rows):
            self.slots.scribbled(kv_row, int(slots[kv_row, 0]))
        for request, draft in zip(requests, drafts):
            fed, newest = request.fed, int(tokens[request.kv_row, 0])
            piece, path = request.verify_tree(logits[request.kv_row, : 1 + len(draft)].float().cpu(), draft)
            self._keep_path(request.kv_row, fed, path)
            self.slots.fed(request.kv_row, [newest, *(draft.tokens[node] for node in path)], fed, width)
            request.fed += 1 + len(path)
            self._emitted(request, piece)
        elapsed = time.perf_counter() - start
        for request in requests:
            request.decode_s += elapsed

    def _draft_feed(self, request: Request, draft: DraftTree, width: int) -> tuple:
        """(tokens, positions, slots, visibility) of a request's row: its newest token, then the
        draft's nodes at the positions of their depths, then pads repeating the last node."""
        tokens = [request.newest(), *draft.tokens]
        depths = [0, *draft.depths()]
        seen = draft.visibility()
        pad = width - len(tokens)
        tokens += [tokens[-1]] * pad
        depths += [depths[-1]] * pad
        slots = [request.fed + j for j in range(width)]
        if pad:  # a pad sees what the node it repeats sees (and so writes what it writes)
            rows = torch.cat([seen, seen[-1:].expand(pad, -1)])
            seen = torch.cat([rows, torch.zeros(width, pad, dtype=torch.bool)], dim=1)
            seen[len(draft) + 1 :, len(draft) + 1 :] |= torch.eye(pad, dtype=torch.bool)
        positions = [request.fed + depth for depth in depths]
        return tokens, positions, slots, seen

    def _pad_feed(self, kv_row: int, width: int) -> tuple:
        """A row no request decodes in: placeholders past what it holds (or over its last slots,
        which the caller marks as junk, where it is full)."""
        start = min(len(self.slots.contents[kv_row]), self.max_seq_len - width)
        slots = list(range(start, start + width))
        return [0] * width, slots, slots, lower_triangle(width)

    def _keep_path(self, kv_row: int, fed: int, path: list[int]) -> None:
        """Move the accepted nodes' keys and values to the slots right after the newest token's
        (node i was written at slot fed + 1 + i; a chain's accepted nodes are there already)."""
        moves = [(depth, node) for depth, node in enumerate(path, start=1) if node + 1 != depth]
        views = self.executable.cache_views() if moves else ()  # ~1.3 ms on tinygrad: once a call
        for depth, node in moves:
            copy_slots(views, kv_row, kv_row, fed + 1 + node, fed + 1 + node + 1, to_start=fed + depth)

    def _rows(self, lanes: list[int]) -> dict:
        """run()'s keywords placing a call on `lanes`: its first row, or a paged cache's block table."""
        return table_feed(self.slots, lanes) if self.paged else {"first_row": lanes[0]}

    def _logits_out(self, batch_rows: int) -> dict:
        """`out=` for a decode call over `batch_rows` rows when the executable can write logits
        into a buffer it made (`logits_buffer`): one per row count, reused every step (a step's
        logits are consumed before the next)."""
        keywords = self._decode_logits.get(batch_rows)
        if keywords is None:
            buffer = self.capabilities.logits_buffer(batch_rows, 1)
            keywords = self._decode_logits[batch_rows] = {} if buffer is None else {"out": buffer}
        return keywords

    def _accept(self, request: Request, logits: torch.Tensor) -> None:
        self._emitted(request, request.accept(logits))

    def _emitted(self, request: Request, piece: str) -> None:
        """After a request took new tokens (their text `piece`): forced tokens, TTFT, the text to
        its caller, the end."""
        # Tokens a constraint forces: alone, a request appends them now and feeds them as one
        # chunk (fast-forward); beside others they ride one per shared decode step instead, which
        # costs nothing extra there, where a single-row chunk call per request would (measured:
        # 1.6-3x the CPU time with 8 rows).
        if request.generating and len(self.running) == 1:
            piece += request.push_forced()
        if not request.ttft_s:
            request.ttft_s = time.perf_counter() - request.submitted_at
        if piece:
            request.handle.post_piece(piece)
        if not request.generating:
            self._end(request, RequestStatus.DONE)

    def _guarded(self, requests: list[Request], fn, *args) -> None:
        """Run a model call; if it fails, fail the requests it served (the others go on)."""
        try:
            fn(*args)
        except Exception as error:  # noqa: BLE001 - handed to each caller, who re-raises it
            for request in requests:
                self._fail(request, error)

    def _fail(self, request: Request, error: Exception) -> None:
        """End one request with `error` wherever it is (waiting or running)."""
        if request.status is RequestStatus.RUNNING:
            self.slots.contents[request.kv_row] = []  # a failed call or copy may have left the row half written
        self._end(request, RequestStatus.FAILED, error)

    def _fail_all(self, error: Exception) -> None:
        for request in [*self.running, *self.waiting]:
            self._fail(request, error)

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled = [r for r in [*self.running, *self.waiting] if r.handle.cancel_requested]
        for request in cancelled:
            request.finish_reason = "cancelled"
            self._end(request, RequestStatus.CANCELLED)

    def _end(self, request: Request, status: RequestStatus, error: Exception | None = None) -> None:
        """Leave the queue or free the KV row, and tell the caller (the result, or the error)."""
        with self._lock:
            if request.status is RequestStatus.WAITING and request in self.waiting:
                self.waiting.remove(request)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.slots.release(request.kv_row)
        request.status = status
        if request.handle.done:
            return
        if error is not None:
            request.handle.post_error(error)
        else:
            request.handle.post_result(request.result())
