"""`kiln ir TARGET`: the IR of a model, an artifact or a .kir file, as a readable listing.

The listing is the IR's own text form (one node per line, types inline) followed by a
summary: node counts per op and parameter bytes, so a reader sees the graph's shape at a glance.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from kiln.ir import Graph, parse_graph, print_graph


def load_graph(target: str | None, stateful: bool, max_batch: int, max_seq_len: int) -> Graph:
    """Read a .kir file or an artifact's graph.kir, or capture a model (optionally + passes)."""
    path = Path(target) if target else None
    if path is not None and path.suffix == ".kir":
        return parse_graph(path.read_text())
    if path is not None and (path / "manifest.json").is_file():
        from kiln.runtime.artifact import read_artifact

        return read_artifact(path).graph
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.frontend.default_model import default_model_dir

    graph = capture_causal_lm(load_model(target or default_model_dir()).model, max_batch, max_seq_len)
    if stateful:
        from kiln.backends.executable import BackendOptions
        from kiln.passes.pipeline import run_pipeline

        graph = run_pipeline(graph, BackendOptions(max_batch=max_batch, max_seq_len=max_seq_len))
    return graph


def summary(graph: Graph) -> str:
    ops = Counter(n.op for n in graph.nodes)
    weights = sum(t.numel() * t.element_size() for t in graph.weights.values())
    lines = [
        f"# {len(graph.nodes)} nodes, {len(graph.params)} params ({weights / 1e6:.1f} MB)",
        "# ops: " + ", ".join(f"{op} {n}" for op, n in ops.most_common()),
    ]
    return "\n".join(lines)


def show_ir(target: str | None, stateful: bool = False, max_batch: int = 1, max_seq_len: int = 1024) -> str:
    graph = load_graph(target, stateful, max_batch, max_seq_len)
    return print_graph(graph) + summary(graph)
