"""Speculative decoding on SmolLM2-135M: plain greedy vs prompt lookup vs a quantized self-draft.

    .venv/bin/python bench/speculative.py [--backend inductor] [--draft-quantize int4-g64] [--tokens 96]

Two prompts: a code-editing one (the answer repeats most of the prompt: prompt lookup's case)
and free prose. For each, it prints decode tokens/s, the acceptance rate and the tokens per
target step, checks that greedy output is identical to plain decoding, and writes
bench/results/speculative.md. The draft is the same checkpoint compiled with a low-bit scheme
(skipped with a note if that scheme does not compile on the chosen backend).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import CpuMeter  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CODE_PROMPT = '''Rename the variable `total` to `running_sum` in this function and return the code.

```python
def mean(values):
    total = 0
    count = 0
    for value in values:
        total += value
        count += 1
    if count == 0:
        return 0.0
    return total / count
```
'''
PROSE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def compiled(out: Path, backend: str, quantize: str | None):
    import kiln

    if not (out / "manifest.json").exists():
        kwargs = {"quantize": quantize} if quantize else {}
        kiln.compile(None, out=out, backend=backend, max_seq_len=512, max_batch=1, **kwargs)
    return kiln.load(out)


def run(llm, prompt: list[int], tokens: int, speculative) -> tuple[object, float, bool]:
    with CpuMeter() as meter:
        start = time.perf_counter()
        result = llm.generate(prompt, max_new_tokens=tokens, speculative=speculative)
        seconds = time.perf_counter() - start
    return result, seconds, meter.result.contended


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--draft-quantize", default="int4-g64")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = compiled(Path(f"out/bench-spec-{args.backend}.kiln"), args.backend, None)
    drafts = {"prompt lookup": "prompt_lookup"}
    try:
        drafts[f"{args.draft_quantize} self-draft"] = compiled(
            Path(f"out/bench-spec-{args.backend}-{args.draft_quantize}.kiln"), args.backend, args.draft_quantize)
    except Exception as error:  # a scheme this backend cannot lower yet: report, keep going
        print(f"note: no {args.draft_quantize} draft on {args.backend}: {error}", file=sys.stderr)
    lines = ["| prompt | method | tok/s | acceptance | tokens/target step | same as plain |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for name, text in (("code edit", CODE_PROMPT), ("prose", PROSE_PROMPT)):
        prompt = target.encode_chat([{"role": "user", "content": text}])
        run(target, prompt, 8, None)  # warm-up
        plain, seconds, contended = run(target, prompt, args.tokens, None)
        flag = " *" if contended else ""
        lines.append(f"| {name} | plain greedy | {len(plain.token_ids) / seconds:.1f}{flag} | | 1.00 | |")
        for method, speculative in drafts.items():
            result, seconds, contended = run(target, prompt, args.tokens, speculative)
            flag = " *" if contended else ""
            same = "yes" if result.token_ids == plain.token_ids else "NO"
            lines.append(f"| {name} | {method} | {len(result.token_ids) / seconds:.1f}{flag} | "
                         f"{result.stats.acceptance_rate:.0%} | {result.stats.tokens_per_target_step:.2f} | {same} |")
    report = "\n".join(lines) + "\n\n`*`: other processes took CPU time during the run (contended)."
    print(report)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speculative.md").write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
