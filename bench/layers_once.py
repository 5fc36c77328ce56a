"""Decode (tg128) and pp512 of two artifacts of one model, alternated in one run: the full-graph
package against KILN_INDUCTOR_LAYERS=once, and whether their greedy tokens agree.

    flock /tmp/kiln-bench.lock chrt -f 10 .venv/bin/python bench/layers_once.py FULL.kiln ONCE.kiln [RESULT.md]
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kiln
from provenance import write_result

paths = {"full graph": Path(sys.argv[1]), "layers once": Path(sys.argv[2])}
llms = {name: kiln.load(p) for name, p in paths.items()}
torch.set_num_threads(2)
prompt = torch.randint(3, 40000, (1, 512), generator=torch.Generator().manual_seed(0))


def pp512(ex):
    ex.reset()
    t = time.perf_counter()
    ex.run(prompt, torch.arange(512)[None])
    return 512 / (time.perf_counter() - t)


def decode(ex, n=128):
    ex.reset()
    ex.run(prompt[:, :16], torch.arange(16)[None])
    tok = torch.tensor([[5]])
    t = time.perf_counter()
    for i in range(n):
        logits = ex.run(tok, torch.tensor([[16 + i]]))
        tok = logits[:, -1:].argmax(-1)
    return n / (time.perf_counter() - t)


def greedy(ex, n=32):
    ex.reset()
    logits = ex.run(prompt[:, :16], torch.arange(16)[None])
    out = []
    tok = logits[:, -1:].argmax(-1)
    for i in range(n):
        out.append(int(tok))
        logits = ex.run(tok, torch.tensor([[16 + i]]))
        tok = logits[:, -1:].argmax(-1)
    return out


same = greedy(llms["full graph"].executable) == greedy(llms["layers once"].executable)
results = {name: {"pp512": [], "tg128": []} for name in llms}
for llm in llms.values():  # warm-up
    pp512(llm.executable)
    decode(llm.executable, 16)
for _ in range(5):
    for name, llm in llms.items():
        results[name]["pp512"].append(pp512(llm.executable))
        results[name]["tg128"].append(decode(llm.executable))
lines = ["| artifact | pp512 tok/s | tg128 tok/s |", "|---|---|---|"]
for name, r in results.items():
    lines.append(
        f"| {name} | {statistics.mean(r['pp512']):.1f} ± {statistics.stdev(r['pp512']):.1f} | "
        f"{statistics.mean(r['tg128']):.1f} ± {statistics.stdev(r['tg128']):.1f} |"
    )
ratio = {
    k: statistics.mean(results["layers once"][k]) / statistics.mean(results["full graph"][k])
    for k in ("pp512", "tg128")
}
lines.append(
    f"\nlayers once / full graph: pp512 {ratio['pp512']:.3f}, tg128 {ratio['tg128']:.3f}; "
    f"greedy tokens identical: {same}"
)
report = "\n".join(lines)
print(report)
if len(sys.argv) > 3:
    write_result(Path(sys.argv[3]), report, sys.argv)
