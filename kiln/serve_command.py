"""`kiln serve ARTIFACT`: its flags, their checks, and the server started on the loaded artifact."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.cli import check_positive, pin_argument
from kiln.ir.errors import KilnError, OptionError


def add_arguments(commands) -> None:
    serve = commands.add_parser("serve", help="serve the artifact over an OpenAI-compatible HTTP API")
    serve.add_argument("artifact")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests that may wait for a KV slot; more are answered 429 (default 256)",
    )
    serve.add_argument("--model-name", help="the model id clients send (default: the artifact's directory name)")
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="largest request body accepted; larger ones are answered 413 (default 4 MiB)",
    )
    serve.add_argument(
        "--allowed-hosts",
        type=lambda text: [h for h in text.split(",") if h.strip()],
        help="comma-separated Host header names the server answers, others get a 400 "
        "(default: the --host address, localhost, 127.0.0.1, [::1]; '*': any)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="uvicorn's log level (info logs every request)",
    )
    serve.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on every endpoint but /health "
        "(default: $KILN_API_KEY; unset: no key)",
    )
    serve.add_argument(
        "--speculative",
        choices=["prompt_lookup", "heads", "heads+lookup"],
        help="draft every request's tokens inside the engine, by prompt lookup (n-grams of its own "
        "context), by the artifact's draft heads (`kiln train-speculator`) or by both merged into one "
        "tree (heads+lookup), verified in the decode "
        "step: greedy output unchanged",
    )
    serve.add_argument(
        "--reward-model",
        metavar="ARTIFACT",
        help="a reward model's artifact: completions' best_of answers the samples it rewards most "
        "(instead of the likeliest)",
    )
    pin_argument(serve)


def run_command(args: argparse.Namespace) -> int:
    check_positive(args, "max_queue", "max_body_bytes")
    if not 0 < args.port < 65536:
        raise OptionError(f"--port must be in [1, 65535], got {args.port}. Fix: e.g. --port 8000.")
    if args.allowed_hosts is not None and not args.allowed_hosts:
        raise OptionError(
            "--allowed-hosts names no host. Fix: a comma-separated list (e.g. localhost,127.0.0.1), "
            "'*' for any, or leave it out for the default."
        )
    if args.model_name is not None and not args.model_name.strip():
        raise OptionError(
            "--model-name is empty. Fix: give the id clients send, or leave it out for the artifact's directory name."
        )
    api_key = _api_key(args)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise KilnError(
            f"`kiln serve` needs FastAPI, uvicorn and prometheus-client ({error}). Fix: pip install 'kiln[serve]'."
        ) from None
    import json

    import kiln
    from kiln.runtime.server import check_served_models, serve

    try:
        ranks = json.loads((Path(args.artifact) / "manifest.json").read_text()).get("tensor_parallel", 1)
    except (OSError, ValueError):
        ranks = 1  # kiln.load says what is wrong with the artifact
    if ranks > 1:
        raise KilnError(
            f"{args.artifact} is sharded over {ranks} ranks, and kiln serve runs one process. "
            "Fix: serve an unsharded artifact (compile without --tensor-parallel)."
        )
    llm = kiln.load(args.artifact, expected_sha256=args.expect_sha256)
    reward_model = kiln.load(args.reward_model) if args.reward_model else None
    check_served_models(llm, reward_model)
    if args.speculative in ("heads", "heads+lookup"):
        llm.engine_drafter(args.speculative)  # an artifact without heads: one line now, not an error per request
    llm.engine.max_queue = args.max_queue
    name = args.model_name or Path(args.artifact).resolve().name.removesuffix(".kiln")
    print(
        f"[kiln serve] {name} on http://{args.host}:{args.port}/v1 (max_batch={llm.max_batch}, "
        f"max_seq_len={llm.max_seq_len})",
        file=sys.stderr,
        flush=True,
    )
    serve(
        llm,
        args.host,
        args.port,
        name,
        args.max_body_bytes,
        args.log_level,
        args.allowed_hosts,
        api_key,
        args.speculative,
        reward_model,
    )
    return 0


def _api_key(args) -> str | None:
    """--api-key, else $KILN_API_KEY; None when neither is set (the server asks for no key)."""
    import os

    from kiln.runtime.api_key import API_KEY_ENV, check_api_key

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is None:
        return None
    try:
        return check_api_key(key)
    except KilnError as error:
        source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        raise OptionError(f"{source}: {error}") from None
