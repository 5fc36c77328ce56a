"""lm-eval through Kiln's adapter vs lm-eval's own `hf` model, on the same checkpoint and tasks.

    python bench/lm_eval_compare.py [--artifact smollm2.kiln] [--limit N] [--tasks kiln_moby_dick,kiln_basic_mc]

The tasks live in bench/lm_eval_tasks (local data only: Moby-Dick's held-out chapters as rolling
perplexity, and a 32-question multiple-choice set). The artifact is compiled from the bundled
SmolLM2-135M-Instruct when missing; the `hf` model reads the same checkpoint (the GGUF converted
to an f32 Hugging Face directory) with max_length set to the artifact's max_seq_len, so both
score the same rolling windows. Runs the `lm_eval` command, or `python -m kiln.lm_eval_plugin`
(the same CLI with the kiln model registered) when this installation lacks kiln_lm_eval.pth.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")
METRICS = ("word_perplexity", "bits_per_byte", "acc", "acc_norm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default=str(Path(tempfile.gettempdir()) / "kiln-lm-eval-smollm2.kiln"))
    parser.add_argument("--tasks", default="kiln_moby_dick,kiln_basic_mc")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="when compiling the artifact")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per model call, for both models")
    args = parser.parse_args()

    artifact = ensure_artifact(Path(args.artifact), args.max_seq_len)
    max_length = json.loads((artifact / "manifest.json").read_text())["options"]["max_seq_len"]
    from kiln.frontend.default_model import default_model_dir

    hf_dir = default_model_dir()
    runs = {
        "kiln": ["--model", "kiln", "--model_args", f"path={artifact}", "--batch_size", str(args.batch_size)],
        "hf": [
            "--model",
            "hf",
            "--model_args",
            f"pretrained={hf_dir},dtype=float32,max_length={max_length}",
            "--device",
            "cpu",
            "--batch_size",
            str(args.batch_size),
        ],
    }
    scores, seconds = {}, {}
    for name, model_args in runs.items():
        started = time.perf_counter()
        scores[name] = run_lm_eval(model_args, args.tasks, args.limit)
        seconds[name] = time.perf_counter() - started
    print_table(scores, seconds, args)


def ensure_artifact(path: Path, max_seq_len: int) -> Path:
    if (path / "manifest.json").is_file():
        return path
    import kiln

    print(f"compiling SmolLM2-135M-Instruct into {path} (max_seq_len={max_seq_len}, max_batch=4) ...", flush=True)
    return Path(kiln.compile(None, out=path, max_seq_len=max_seq_len, max_batch=4))


def lm_eval_command() -> list[str]:
    """`lm_eval` when it knows the kiln model here, else the same CLI through kiln.lm_eval_plugin."""
    probe = "from lm_eval.api.registry import get_model; get_model('kiln')"
    lm_eval = shutil.which("lm_eval") or str(Path(sys.executable).with_name("lm_eval"))
    if Path(lm_eval).exists() and subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        return [lm_eval]
    return [sys.executable, "-m", "kiln.lm_eval_plugin"]


def run_lm_eval(model_args: list[str], tasks: str, limit: int | None) -> dict:
    """{task: {metric: value}} from one lm_eval run."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            *lm_eval_command(),
            "run",
            *model_args,
            "--tasks",
            tasks,
            "--include_path",
            str(TASKS_DIR),
            "--output_path",
            out,
            *(["--limit", str(limit)] if limit else []),
        ]
        print("$", " ".join(command), flush=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        subprocess.run(command, check=True, env=env)
        results = json.loads(max(Path(out).rglob("results*.json"), key=lambda p: p.stat().st_mtime).read_text())
    return {
        task: {
            key.split(",")[0]: value
            for key, value in metrics.items()
            if key.split(",")[0] in METRICS and isinstance(value, float)
        }
        for task, metrics in results["results"].items()
    }


def print_table(scores: dict, seconds: dict, args) -> None:
    print(f"\nlm-eval {args.tasks} (limit {args.limit or 'all'}): Kiln adapter vs lm-eval hf, same checkpoint")
    print(f"| {'task':<16} | {'metric':<16} | {'kiln':>10} | {'hf':>10} | {'difference':>10} |")
    print(f"|{'-' * 18}|{'-' * 18}|{'-' * 12}|{'-' * 12}|{'-' * 12}|")
    for task, metrics in scores["kiln"].items():
        for metric, ours in metrics.items():
            theirs = scores["hf"].get(task, {}).get(metric, float("nan"))
            print(f"| {task:<16} | {metric:<16} | {ours:>10.4f} | {theirs:>10.4f} | {ours - theirs:>+10.4f} |")
    print(f"wall time: kiln {seconds['kiln']:.0f} s, hf {seconds['hf']:.0f} s (each includes loading)")


if __name__ == "__main__":
    main()
