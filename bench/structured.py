"""Structured generation on SmolLM2-135M: what fast-forward saves on a schema-heavy answer.

    .venv/bin/python bench/structured.py [--backend inductor] [--reps 3] [--tokens 256]

One chat prompt asks for an order record under a JSON schema with many keys, nested objects,
enums, an array and bounded numbers. Three greedy runs of it:
- unconstrained: the same prompt, no schema (plain decoding's speed, for reference);
- mask only: the schema, forced tokens taken without sampling but fed one decode step each
  (`fast_forward=False`);
- fast-forward: forced tokens fed several to a model call.
It prints model steps per output token, the forced share of the tokens and decode tokens/s
(median of --reps runs), checks that both constrained runs give the same tokens and valid JSON,
and writes bench/results/structured.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import CpuMeter
from provenance import write_result

RESULTS = Path(__file__).parent / "results"
PROMPT = (
    "Create the JSON record of an order: customer Alice Martin (alice@example.com, gold tier) ordered "
    "two blue mugs at 12.5 each and one red teapot at 30; it ships express to 5 Rue Verte, Lyon, France."
)
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "first_name": {"type": "string", "maxLength": 20},
                "last_name": {"type": "string", "maxLength": 20},
                "email": {"type": "string", "maxLength": 40},
                "loyalty_tier": {"enum": ["none", "silver", "gold", "platinum"]},
            },
            "required": ["first_name", "last_name", "email", "loyalty_tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "product_name": {"type": "string", "maxLength": 20},
                    "product_color": {"enum": ["red", "green", "blue", "black", "white"]},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                    "unit_price_eur": {"type": "number", "minimum": 0, "maximum": 1000},
                },
                "required": ["product_name", "product_color", "quantity", "unit_price_eur"],
                "additionalProperties": False,
            },
        },
        "shipping_address": {
            "type": "object",
            "properties": {
                "street_address": {"type": "string", "maxLength": 30},
                "city": {"type": "string", "maxLength": 20},
                "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
            },
            "required": ["street_address", "city", "country_code"],
            "additionalProperties": False,
        },
        "shipping_method": {"enum": ["standard", "express", "overnight"]},
        "gift_wrapped": {"type": "boolean"},
    },
    "required": ["order_id", "status", "customer", "items", "shipping_address", "shipping_method", "gift_wrapped"],
    "additionalProperties": False,
}


def compiled(out: Path, backend: str):
    import kiln

    if not (out / "manifest.json").exists():
        kiln.compile(None, out=out, backend=backend, max_seq_len=512, max_batch=1)
    return kiln.load(out)


def timed(llm, prompt: list[int], tokens: int, reps: int, **constraint):
    """(last result, median seconds per decoded token, whether another process took CPU time)."""
    per_token, contended, result = [], False, None
    for _ in range(reps):
        with CpuMeter() as meter:
            start = time.perf_counter()
            result = llm.generate(prompt, max_new_tokens=tokens, **constraint)
            seconds = time.perf_counter() - start
        per_token.append(seconds / max(1, len(result.token_ids)))
        contended = contended or meter.result.contended
    return result, statistics.median(per_token), contended


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = compiled(Path(f"out/bench-structured-{args.backend}.kiln"), args.backend)
    prompt = llm.encode_chat([{"role": "user", "content": PROMPT}])
    llm.generate(prompt, max_new_tokens=8)  # warm-up (first calls compile and allocate)
    runs = {
        "unconstrained": {},
        "mask only (fast_forward=False)": {"json_schema": ORDER_SCHEMA, "fast_forward": False},
        "fast-forward": {"json_schema": ORDER_SCHEMA},
    }
    lines = [
        f"SmolLM2-135M-Instruct, {args.backend}, greedy, median of {args.reps}",
        "",
        "| run | tokens | model steps | steps/token | forced | tok/s | valid JSON |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    results = {}
    for name, constraint in runs.items():
        result, seconds_per_token, contended = timed(llm, prompt, args.tokens, args.reps, **constraint)
        results[name] = result
        stats = result.stats
        valid = _valid(result.text) if constraint else ""
        lines.append(
            f"| {name} | {stats.tokens_out} | {stats.model_steps} | {stats.steps_per_token:.2f} | "
            f"{stats.forced_tokens} | {1 / seconds_per_token:.1f}{' *' if contended else ''} | {valid} |"
        )
    same = results["fast-forward"].token_ids == results["mask only (fast_forward=False)"].token_ids
    lines += [
        "",
        f"Fast-forward output identical to mask-only: {'yes' if same else 'NO'}.",
        "tok/s: new tokens over the whole call (prefill included); `*`: other processes took CPU time.",
    ]
    report = "\n".join(lines)
    print(report)
    print("\nfast-forward output:", results["fast-forward"].text)
    write_result(RESULTS / "structured.md", report)
    return 0


def _valid(text: str) -> str:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), ORDER_SCHEMA)
        return "yes"
    except (ValueError, jsonschema.ValidationError):
        return "NO"


if __name__ == "__main__":
    sys.exit(main())
