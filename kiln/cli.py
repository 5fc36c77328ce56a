"""The command lines: `compile-model` (compile a model into an artifact) and `kiln` (use one).

    compile-model [MODEL] -o model.kiln [--backend inductor|reference] [--max-seq-len N] [--quantize SCHEME] ...
    compile-model explain [TARGET] [--format md|html|json] [-o FILE]   (graph breaks and recompiles)
    kiln generate model.kiln --prompt "Once upon a time" [--max-new-tokens N] [--chat] ...
    torchrun --nproc-per-node N -m kiln generate model.kiln ...   (compiled with --tensor-parallel N)
    kiln chat model.kiln
    kiln ir MODEL|ARTIFACT|FILE.kir [--stateful]   (print a graph's IR)
    kiln serve model.kiln [--host 127.0.0.1] [--port 8000]   (OpenAI-compatible HTTP server)
    kiln quality model.kiln --reference f32.kiln --text FILE   (KL divergence and more against a reference)
    kiln cache info|clear   (the compile cache: where and how big, or empty it)
    kiln train-speculator model.kiln [--kind eagle|mlp|medusa] [--stages N]   (draft heads for speculative="heads")

Every mistake the user can fix prints one line to stderr, naming it and the fix, and exits with
status 2: a Kiln error, a flag argparse refuses, an option out of range. Options are checked
before any slow step (loading a model or an artifact).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kiln.backends.registry import BACKENDS
from kiln.ir.errors import KilnError, OptionError

EXIT_USAGE = 2


class UsageError(OptionError):
    """The command line itself is malformed: an unknown flag, a missing argument, a value argparse cannot parse."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as one-line UsageErrors (not a usage block and SystemExit)."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}. Fix: see `{self.prog} --help`.")


def _run(main, argv) -> int:
    """Run a command, turning Kiln errors into one line on stderr and exit status 2."""
    try:
        return main(argv)
    except KilnError as e:
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        print(
            "error: out of memory. Fix: a smaller --max-seq-len or --max-batch (or a smaller model).", file=sys.stderr
        )
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def check_positive(args, *names: str) -> None:
    """Flags that count something (tokens, rows, requests, bytes) must be at least 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise OptionError(f"{flag} must be at least 1, got {value}. Fix: pass a positive number ({flag} N).")


# -- compile-model -----------------------------------------------------------------------------
def compile_model_main(argv: list[str] | None = None) -> int:
    """Entry point of `compile-model`."""
    return _run(_compile_model, argv)


def compile_parser() -> argparse.ArgumentParser:
    """The parser of `compile-model` (not of `compile-model explain`: explain_parser)."""
    parser = Parser(
        prog="compile-model",
        description="Compile a causal LM into a Kiln artifact. "
        "`compile-model explain --help`: explain its graph breaks.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        help="local Hugging Face directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
    parser.add_argument("-o", "--out", required=True, help="artifact directory to write")
    parser.add_argument("--backend", default="inductor", choices=sorted(BACKENDS))
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=1)
    parser.add_argument(
        "--dtype",
        default="f32",
        choices=["f32", "f16", "bf16"],
        help="compute dtype: f32 (the CPU path; smaller weights: --quantize), or f16/bf16 for GPUs "
        "(--device cuda: --backend inductor, with --quantize too; f16 with --backend onnxruntime)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the artifact runs: cpu (default) or cuda[:N] (it compiles on a machine without one)",
    )
    parser.add_argument("--dump-ir", metavar="DIR", help="write the IR after each pass phase into DIR")
    from kiln.passes.quant_schemes import scheme_names

    parser.add_argument(
        "--quantize",
        metavar="SCHEME",
        default="none",
        help=f"weight quantization: none (default), {', '.join(scheme_names())}",
    )
    parser.add_argument(
        "--quantize-embeddings",
        action="store_true",
        help="also quantize the lm_head and the token embedding (kept f32 by default)",
    )
    parser.add_argument(
        "--kv-cache",
        default="f32",
        help="what the KV cache holds: f32 (default), or int8 (a scale per token and head; "
        "--backend inductor or reference)",
    )
    parser.add_argument(
        "--kv-layout",
        default="static",
        help="how the KV cache is laid out: static (a row of max_seq_len per request, default), or paged "
        "(blocks of a shared pool, addressed through a block table; --backend inductor, onnxruntime or reference)",
    )
    parser.add_argument("--kv-block-size", type=int, default=32, metavar="N", help="tokens per block (paged)")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        metavar="N",
        help="blocks in the pool (paged; default: as many tokens as max_batch full rows, plus a scratch block)",
    )
    parser.add_argument(
        "--calibration", metavar="FILE", help="text the -awq schemes calibrate on (default: bundled Moby-Dick chapters)"
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="shard over N ranks (run with torchrun --nproc-per-node N -m kiln generate ...)",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="compile afresh, not from the compile cache (`kiln cache clear` empties it)",
    )
    return parser


def _compile_model(argv) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["explain"]:  # a model directory named "explain" is passed as ./explain
        return _explain(argv[1:])
    args = compile_parser().parse_args(argv)

    import json

    import kiln
    from kiln.compile_progress import for_stream

    started = time.perf_counter()
    progress = for_stream(sys.stderr)  # bars on a terminal, a line per phase otherwise
    path = kiln.compile(
        args.model,
        out=args.out,
        backend=args.backend,
        max_seq_len=args.max_seq_len,
        max_batch=args.max_batch,
        dtype=args.dtype,
        dump_ir=args.dump_ir,
        quantize=args.quantize,
        quantize_embeddings=args.quantize_embeddings,
        calibration=args.calibration,
        tensor_parallel=args.tensor_parallel,
        device=args.device,
        cache=not args.no_cache,
        progress=progress,
        kv_cache=args.kv_cache,
        kv_layout=args.kv_layout,
        kv_block_size=args.kv_block_size,
        kv_blocks=args.kv_blocks,
    )
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    stats = manifest.get("graph_stats", {})
    top_ops = ", ".join(f"{op} {n}" for op, n in list(stats.get("ops", {}).items())[:6])
    print(f"artifact   {path}")
    print(f"backend    {manifest['backend']} {manifest.get('backend_version', '')}".rstrip())
    print(f"graph      {stats.get('nodes', '?')} nodes ({top_ops})")
    print(f"params     {stats.get('params', '?')} tensors, {stats.get('param_bytes', 0) / 1e6:.1f} MB")
    if "graph_breaks" in manifest:
        from kiln.frontend.breaks.report_model import summary_line

        print(f"breaks     {summary_line(manifest['graph_breaks'])} (report.md in the artifact)")
    print(
        f"options    max_seq_len={args.max_seq_len} max_batch={args.max_batch} dtype={args.dtype} device={args.device} "
        f"quantize={args.quantize}{' (with embeddings)' if args.quantize_embeddings else ''} "
        f"kv_cache={args.kv_cache} kv_layout={args.kv_layout}"
    )
    print(f"time       {time.perf_counter() - started:.1f}s")
    return 0


def explain_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="compile-model explain",
        description="Capture a model with Dynamo and explain every graph break and recompile it meets: where, "
        "why in plain words, what it costs, whether Kiln removes it, and how to fix it.",
    )
    parser.add_argument(
        "target",
        nargs="?",
        help="local Hugging Face directory, .gguf file, or "
        "path/to/file.py:callable returning (module, inputs) (default: the bundled SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--format", choices=["md", "html", "json"], default="md")
    parser.add_argument("-o", "--out", metavar="FILE", help="write the report to FILE (default: standard output)")
    parser.add_argument(
        "--sections",
        default="forward,stateless,generate",
        help="for a model, what to capture, comma-separated: forward (with a DynamicCache, prefill "
        "and decode), stateless (what Kiln compiles), generate (model.generate)",
    )
    return parser


def _explain(argv) -> int:
    from kiln.frontend.breaks.targets import SECTIONS

    args = explain_parser().parse_args(argv)
    if args.out:
        _check_output_file(Path(args.out))
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        raise OptionError(
            f"--sections {args.sections!r} names no section or unknown ones {unknown}. "
            f"Fix: a comma-separated list of {', '.join(SECTIONS)}."
        )

    import json

    from kiln.frontend.breaks.analysis import analyze
    from kiln.frontend.breaks.report_html import render_html
    from kiln.frontend.breaks.report_markdown import render_markdown
    from kiln.frontend.breaks.report_model import make_report
    from kiln.frontend.breaks.targets import load_target

    target = args.target
    if target is None:
        from kiln.frontend.default_model import default_model_dir

        target = str(default_model_dir())
    analyzed = []
    for subject in load_target(target, sections):
        started = time.perf_counter()
        print(f"[compile-model explain] capture {subject.name} ...", file=sys.stderr, flush=True)
        analyzed.append(analyze(subject))
        print(
            f"[compile-model explain] {subject.name}: {analyzed[-1].summary_line()}, "
            f"{analyzed[-1].counts['recompiles']} recompile(s) ({time.perf_counter() - started:.1f}s)",
            file=sys.stderr,
            flush=True,
        )
    report = make_report(target, analyzed)
    render = {"md": render_markdown, "html": render_html, "json": lambda r: json.dumps(r.to_json(), indent=2) + "\n"}[
        args.format
    ]
    text = render(report)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"[compile-model explain] wrote {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    print(report.summary_line(), file=sys.stderr)
    return 0


def _check_output_file(path: Path) -> None:
    """A report file can be written at `path` (checked before the minutes of analysis)."""
    try:
        fits = not path.is_dir() and path.parent.is_dir()
    except OSError as error:
        raise OptionError(
            f"-o {str(path)[:80]!r} cannot be used: {error.strerror or error}. Fix: choose another path."
        ) from None
    if not fits:
        raise OptionError(
            f"-o {path}: {'is a directory' if path.is_dir() else f'{path.parent} is not a directory'}. "
            "Fix: give a file path in an existing directory."
        )


# -- kiln generate / kiln chat -----------------------------------------------------------------
def kiln_main(argv: list[str] | None = None) -> int:
    """Entry point of `kiln` (and `python -m kiln`)."""
    return _run(_kiln, argv)


def _sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--typical-p", type=float, default=1.0)
    parser.add_argument("--eta", type=float, default=0.0, help="eta sampling's epsilon (0 = off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)


def kiln_parser() -> argparse.ArgumentParser:
    """The parser of `kiln` and its commands."""
    parser = Parser(prog="kiln", description="Run a compiled Kiln artifact.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("artifact")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    pin_argument(gen)
    _sampling_arguments(gen)
    chat = commands.add_parser("chat", help="interactive chat over stdin (/reset clears, /exit quits)")
    chat.add_argument("artifact")
    chat.add_argument("--system", help="a system message to start the conversation with")
    pin_argument(chat)
    _sampling_arguments(chat)
    show = commands.add_parser("ir", help="print the IR of a model (captured), an artifact or a .kir file")
    show.add_argument(
        "target",
        nargs="?",
        help="HF directory, .gguf, artifact directory or .kir file (default: the bundled SmolLM2-135M-Instruct)",
    )
    show.add_argument("--stateful", action="store_true", help="for a model: run the pass pipeline first")
    show.add_argument("--max-seq-len", type=int, default=1024)
    show.add_argument("--max-batch", type=int, default=1)
    from kiln.serve_command import add_arguments as serve_arguments

    serve_arguments(commands)
    from kiln.quality_command import add_arguments as quality_arguments

    quality_arguments(commands)
    from kiln.train_speculator import add_arguments as train_speculator_arguments

    train_speculator_arguments(commands)
    from kiln.cache_command import add_arguments as cache_arguments

    cache_arguments(commands)
    return parser


def _kiln(argv) -> int:
    args = kiln_parser().parse_args(argv)
    if args.command == "serve":
        from kiln.serve_command import run_command as serve_command

        return serve_command(args)
    if args.command == "quality":
        from kiln.quality_command import run_command as quality_command

        return quality_command(args)
    if args.command == "train-speculator":
        from kiln.train_speculator import run_command

        return run_command(args)
    if args.command == "cache":
        from kiln.cache_command import run_command as cache_command

        return cache_command(args)
    if args.command == "ir":
        from kiln.ir_listing import show_ir

        check_positive(args, "max_seq_len", "max_batch")
        print(show_ir(args.target, stateful=args.stateful, max_batch=args.max_batch, max_seq_len=args.max_seq_len))
        return 0

    import kiln

    sampling = _checked_sampling(args)
    llm = kiln.load(args.artifact, expected_sha256=args.expect_sha256)
    from kiln.runtime.distributed import is_main_rank

    if args.command == "generate":
        prompt = llm.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        if not is_main_rank():  # tensor parallel: every rank generates in lockstep, rank 0 prints
            llm.generate(prompt, **sampling)
            return 0
        result = _print_stream(llm.stream(prompt, **sampling))
        print(f"[{result.stats.summary()}]", file=sys.stderr)
        return 0
    if llm.manifest.get("tensor_parallel", 1) > 1:
        print(
            "error: kiln chat does not run a tensor-parallel artifact yet; use kiln generate under torchrun",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return _chat_loop(llm, args.system, sampling)


def _checked_sampling(args) -> dict:
    """generate's keyword arguments from the sampling flags, refused before the artifact loads."""
    from kiln.runtime.generate import SEED_LIMIT
    from kiln.runtime.sampler import SamplingParams

    sampling = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        typical_p=args.typical_p,
        eta=args.eta,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    SamplingParams(**sampling)  # GenerationError naming the setting and its range
    if args.max_new_tokens < 0:
        raise OptionError(
            f"--max-new-tokens must be 0 or more, got {args.max_new_tokens}. Fix: e.g. --max-new-tokens 128."
        )
    if not 0 <= args.seed < SEED_LIMIT:
        raise OptionError(f"--seed must be in [0, 2**63), got {args.seed}. Fix: e.g. --seed 0.")
    return dict(max_new_tokens=args.max_new_tokens, seed=args.seed, **sampling)


def pin_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--expect-sha256",
        metavar="HEX",
        help="refuse the artifact unless its manifest.json has this sha256 (sha256sum "
        "ARTIFACT/manifest.json): an artifact is code, pin any you did not compile",
    )


def _print_stream(stream):
    for piece in stream:
        print(piece, end="", flush=True)
    print(flush=True)  # the stats line goes to stderr: end the text first
    return stream.results


def _chat_loop(llm, system: str | None, sampling: dict) -> int:
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            history = list(start)
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        try:
            result = _print_stream(llm.stream_chat(history, **sampling))
        except KilnError as e:  # e.g. the history outgrew the context: say so and keep going
            history.pop()
            print(f"error: {e} (type /reset to start over)", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": result.text})
        if interactive:
            print(f"[{result.stats.summary()}]", file=sys.stderr)
