"""A bounded load test of `kiln serve`: N streamed greedy completions over C concurrent clients.

    python bench/serve_load.py [--artifact smollm2-b8.kiln] [--requests 200] [--concurrency 32]

Starts `kiln serve` on a free loopback port (the artifact is compiled from the bundled
SmolLM2-135M-Instruct with max_batch 8 when missing), sends every request through the official
`openai` client with stream=True, then sends each again alone, one at a time, and checks that the
texts are identical (greedy decoding must not depend on what shares the batch). Reports
requests/s and generated tokens/s under load, p50/p99 time to first token and inter-token latency
as the clients see them, failed requests and mismatches; exits 1 if any request failed or differed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai

TOPICS = [
    "the sea",
    "a lighthouse",
    "winter mornings",
    "a compiler",
    "bread",
    "the moon",
    "a library",
    "trains",
    "a garden",
    "mountains",
    "rain",
    "a violin",
    "chess",
    "a market",
    "the desert",
    "bees",
]
FORMS = [
    "Write one sentence about {}.",
    "Describe {} in a few words.",
    "Tell me a short fact about {}.",
    "What comes to mind when you think of {}?",
    "Once upon a time, {}",
]


@dataclass
class Outcome:
    text: str = ""
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    error: str | None = None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default=str(Path(tempfile.gettempdir()) / "kiln-serve-smollm2-b8.kiln"))
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32, help="upper bound; each request draws 8..this")
    parser.add_argument("--max-batch", type=int, default=8, help="when compiling the artifact")
    args = parser.parse_args()

    artifact = ensure_artifact(Path(args.artifact), args.max_batch)
    requests = make_requests(args.requests, args.max_tokens)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kiln",
            "serve",
            str(artifact),
            "--port",
            str(port),
            "--model-name",
            "smollm2",
            "--max-queue",
            str(args.requests),
            "--log-level",
            "warning",
        ]
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, server)
        started = time.perf_counter()
        loaded = asyncio.run(run_all(base, requests, args.concurrency))
        wall = time.perf_counter() - started
        alone = asyncio.run(run_all(base, requests, 1))
        slots = health(base)["slots_in_use"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    return report(requests, loaded, alone, wall, slots, args)


def ensure_artifact(path: Path, max_batch: int) -> Path:
    if (path / "manifest.json").is_file():
        return path
    import kiln

    print(f"compiling SmolLM2-135M-Instruct into {path} (max_batch={max_batch}, max_seq_len=512) ...", flush=True)
    return Path(kiln.compile(None, out=path, max_seq_len=512, max_batch=max_batch))


def make_requests(n: int, max_tokens: int) -> list[tuple[str, int]]:
    rng = random.Random(0)
    return [(rng.choice(FORMS).format(rng.choice(TOPICS)), rng.randint(8, max_tokens)) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"kiln serve exited with status {server.returncode}")
        try:
            health(base)
            return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("kiln serve did not become healthy")


def health(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
        return json.loads(response.read())


async def run_all(base: str, requests: list[tuple[str, int]], concurrency: int) -> list[Outcome]:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    outcomes = [Outcome() for _ in requests]
    pending = iter(range(len(requests)))

    async def worker():
        for i in pending:
            outcomes[i] = await one(client, *requests[i])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return outcomes


async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> Outcome:
    outcome, pieces = Outcome(), []
    started = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        async for chunk in stream:
            if not chunk.choices or not chunk.choices[0].text:
                continue
            now = time.perf_counter()
            if pieces:
                outcome.gaps_s.append(now - last)
            else:
                outcome.ttft_s = now - started
            pieces.append(chunk.choices[0].text)
            last = now
    except openai.APIError as error:
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.text = "".join(pieces)
    return outcome


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def report(requests, loaded: list[Outcome], alone: list[Outcome], wall: float, slots_after: int, args) -> int:
    failed = [o.error for o in loaded + alone if o.error]
    mismatched = sum(a.text != b.text for a, b in zip(loaded, alone))
    ttfts = [o.ttft_s * 1000 for o in loaded if not o.error]
    gaps = [g * 1000 for o in loaded if not o.error for g in o.gaps_s]
    pieces = sum(len(o.gaps_s) + 1 for o in loaded if not o.error and o.text)
    alone_gaps = [g * 1000 for o in alone if not o.error for g in o.gaps_s]
    print(
        f"\n{args.requests} streamed greedy completions, {args.concurrency} concurrent clients, "
        f"max_tokens 8..{args.max_tokens}, artifact {args.artifact}"
    )
    print(f"| {'metric':<34} | {'value':>12} |")
    print(f"|{'-' * 36}|{'-' * 14}|")
    rows = [
        ("requests/s", f"{len(loaded) / wall:.2f}"),
        ("streamed pieces/s", f"{pieces / wall:.1f}"),
        ("TTFT p50 / p99 (ms)", f"{percentile(ttfts, 50):.0f} / {percentile(ttfts, 99):.0f}"),
        ("inter-token p50 / p99 (ms)", f"{percentile(gaps, 50):.1f} / {percentile(gaps, 99):.1f}"),
        ("inter-token p50 alone (ms)", f"{percentile(alone_gaps, 50):.1f}"),
        ("failed requests", str(len(failed))),
        ("texts differing from alone", f"{mismatched} of {len(loaded)}"),
        ("KV slots in use afterwards", str(slots_after)),
        ("wall time under load (s)", f"{wall:.1f}"),
    ]
    for name, value in rows:
        print(f"| {name:<34} | {value:>12} |")
    for error in failed[:5]:
        print("failed:", error)
    return 1 if failed or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
