"""`kiln quality ARTIFACT --reference REF`: its flags, their checks, and the measures printed."""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.cli import check_positive
from kiln.ir.errors import OptionError


def add_arguments(commands) -> None:
    quality = commands.add_parser(
        "quality",
        help="compare an artifact's next-token distributions with a reference's "
        "(KL divergence, delta p, same top token, perplexity ratio)",
    )
    quality.add_argument("artifact")
    quality.add_argument(
        "--reference",
        required=True,
        help="the reference artifact (e.g. compiled without "
        "--quantize), or a reference-logits file written by --save-reference",
    )
    quality.add_argument("--text", help="text file to score (needed with a reference artifact)")
    quality.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    quality.add_argument("--windows", type=int, help="how many windows (default: all the text holds)")
    quality.add_argument(
        "--first", type=int, help="first scored position of a window (default: window // 2, as llama-perplexity)"
    )
    quality.add_argument("--top-k", type=int, default=256, help="reference tokens kept per position (default 256)")
    quality.add_argument("--save-reference", metavar="FILE", help="also write the reference's logits to FILE")
    quality.add_argument("--json", action="store_true", help="print the measures as JSON")


def run_command(args: argparse.Namespace) -> int:
    import json

    from kiln.runtime.quality import quality

    check_positive(args, "window", "top_k", *(["windows"] if args.windows is not None else []))
    if args.first is not None and args.first < 0:
        raise OptionError(
            f"--first must be 0 or more, got {args.first}. Fix: a position in the window, or leave it out."
        )
    result = quality(
        args.artifact,
        args.reference,
        Path(args.text) if args.text else None,
        length=args.window,
        windows=args.windows,
        first=args.first,
        top_k=args.top_k,
        save_reference=args.save_reference,
    )
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.summary())
    return 0
