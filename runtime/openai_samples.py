"""The samples of one server request: `n` (and on completions `best_of`) requests of the same
prompt, submitted to the engine side by side, as `llm.generate(n=..., best_of=...)` runs them.

Sample j is seeded with the request's seed + j (a request without a seed draws one), so sample 0
is what the same request with n=1 gives. The first sample prefills the prompt and the others
copy its keys and values (the engine's prefix sharing, for prompts of 16 tokens or more).
`best_of` draws that many and answers the `n` with the highest cumulative log-probability (as
OpenAI's API does; it cannot be streamed). A single answer is just a group of one. A server
given a reward model (`kiln serve --reward-model`) answers the `n` it rewards most instead, as
`llm.generate(..., reward_model=)` ranks them (runtime/samples.py).
"""

from __future__ import annotations

import asyncio
import dataclasses

from kiln.ir.errors import KilnError
from kiln.runtime.errors import ConstraintError
from kiln.runtime.generate import SEED_LIMIT
from kiln.runtime.openai_errors import APIError, from_kiln_error, invalid
from kiln.runtime.samples import MAX_SAMPLES, cumulative_logprob, prompt_texts


def sample_counts(n: int, best_of: int | None, stream: bool) -> tuple[int, int]:
    """(n, best_of) checked: 400s naming the field; best_of defaults to n."""
    if not 1 <= n <= MAX_SAMPLES:
        raise invalid(f"n must be from 1 to {MAX_SAMPLES}, got {n}. Fix: ask for fewer choices per request.", "n")
    best_of = n if best_of is None else best_of
    if not n <= best_of <= MAX_SAMPLES:
        raise invalid(
            f"best_of must be from n ({n}) to {MAX_SAMPLES}, got {best_of}. Fix: send best_of >= n, or leave it out.",
            "best_of",
        )
    if stream and best_of > n:
        raise invalid(
            "best_of > n cannot be streamed: the best samples are known only once all are done. "
            "Fix: set stream=false, or leave best_of out.",
            "best_of",
        )
    return n, best_of


class Samples:
    """The engine requests (handles) of one answer's samples, index j seeded seed + j."""

    def __init__(self, handles: list):
        self.handles = handles

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()

    async def pieces(self):
        """(index, piece) as each sample's text comes, and (index, None) when that sample ends.
        An error that ended a sample is raised here."""
        if len(self.handles) == 1:  # the common case, without the relay
            async for piece in self.handles[0]:
                yield 0, piece
            yield 0, None
            return
        relay: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, handle) -> None:
            try:
                async for piece in handle:
                    relay.put_nowait((index, piece, None))
            except Exception as error:  # noqa: BLE001 - re-raised in the consumer
                relay.put_nowait((index, None, error))
            else:
                relay.put_nowait((index, None, None))

        pumps = [asyncio.ensure_future(pump(index, handle)) for index, handle in enumerate(self.handles)]
        try:
            running = len(pumps)
            while running:
                index, piece, error = await relay.get()
                if error is not None:
                    raise error
                running -= piece is None
                yield index, piece
        finally:
            for task in pumps:
                task.cancel()

    async def results(self) -> list:
        return [await handle.wait() for handle in self.handles]


async def submit_samples(llm, prompt, prompt_param: str, sampling: dict, count: int, failed) -> Samples:
    """Queue `count` samples of `prompt` (validation and tokenizing run off the event loop); a
    refusal of any cancels those already queued. `failed` maps a ConstraintError."""

    def submit_all() -> list:
        handles = []
        try:
            for j in range(count):
                handles.append(llm.submit(prompt, **{**sampling, "seed": (sampling["seed"] + j) % SEED_LIMIT}))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    try:
        return Samples(await asyncio.to_thread(submit_all))
    except ConstraintError as error:  # a malformed or unsatisfiable constraint, found at compiling
        raise failed(error) from None
    except KilnError as error:
        raise from_kiln_error(error, prompt_param) from None


def ranking_logprobs(logprobs: int | None, n: int, best_of: int) -> int | None:
    """What to ask each sample for: ranking best_of > n needs their log-probabilities."""
    return 0 if logprobs is None and best_of > n else logprobs


def best_results(results: list, n: int, logprobs: int | None, rewards: list[float] | None = None) -> list:
    """The `n` results to answer: the likeliest when more were drawn (the most rewarded, given
    `rewards`, one per result), their log-probabilities left out when the request asked for none
    (`logprobs` None)."""
    if len(results) > n:
        if rewards is None:
            results = sorted(results, key=cumulative_logprob, reverse=True)[:n]
        else:
            order = sorted(range(len(results)), key=rewards.__getitem__, reverse=True)
            results = [results[i] for i in order[:n]]
        if logprobs is None:
            results = [dataclasses.replace(result, logprobs=None) for result in results]
    return results


async def sample_rewards(reward_model, llm, prompt, results: list, n: int) -> list[float] | None:
    """Each result's reward of prompt + sample text by `reward_model`, when it ranks them (more
    drawn than answered); None otherwise. Runs off the event loop; a text the reward model
    cannot take (too long for its context) is a 400 naming best_of."""
    if reward_model is None or len(results) <= n:
        return None
    (text,) = prompt_texts(llm, [prompt], [results[0].prompt_token_ids])
    try:
        return await asyncio.to_thread(reward_model.reward, [text + result.text for result in results])
    except KilnError as error:
        raise invalid(f"The reward model cannot rank these samples: {error}", "best_of") from None


async def collect(samples: Samples, timer, request, failed) -> list:
    """The finished results of a non-streamed answer; cancels its samples if the client goes away
    first. An exception that ended a sample becomes `failed(exception)`."""

    async def drain():
        async for _, piece in samples.pieces():
            if piece is not None:
                timer.piece()
        return await samples.results()

    async def client_gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    generation, watch = asyncio.ensure_future(drain()), asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({generation, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not generation.done():
            samples.cancel()
            generation.cancel()
    if not generation.done() or generation.cancelled():
        raise APIError(499, "The client closed the connection.", "client_closed_request")
    try:
        results = generation.result()
    except Exception as error:  # noqa: BLE001 - the request's failure, answered as its error
        raise failed(error) from None
    finished(timer, results)
    return results


def finished(timer, results: list) -> None:
    """The metrics of a finished answer: its prompt once, every sample's tokens."""
    timer.finished(len(results[0].prompt_token_ids), sum(len(result.token_ids) for result in results))
