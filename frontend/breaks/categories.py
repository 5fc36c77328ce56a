"""What a graph break means: its category, the reason in plain words, and a concrete fix.

Dynamo names each break with a context-free `gb_type` ("Data-dependent branching", ...) and a
message holding an explanation, hints and a developer context. The rules below read those,
and the source line, and say the same thing the way a model author thinks about it. The first
rule that matches wins, so the specific rules (a cache object, a print) come before the generic
ones (an unsupported call).
"""

from __future__ import annotations

import ast
import functools
import linecache
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .recording import SourceFrame


@dataclass(frozen=True)
class Category:
    key: str
    title: str


CATEGORIES = {
    c.key: c
    for c in [
        Category("data_dependent_control_flow", "data-dependent control flow"),
        Category("scalar_escape", ".item() / scalar escape"),
        Category("dynamic_shape", "dynamic shape"),
        Category("python_side_effect", "Python side effect (print, logging, warnings)"),
        Category("cache_object", "cache / container object"),
        Category("unsupported_call", "unsupported builtin or C extension"),
        Category("context_manager", "with/try block Dynamo cannot split"),
        Category("user_requested", "break requested in the code"),
        Category("python_construct", "unsupported Python construct"),
        Category("other", "other"),
    ]
}


@dataclass
class DynamoMessage:
    """The parts of Dynamo's break message."""

    explanation: str = ""
    hints: list[str] = field(default_factory=list)
    context: str = ""
    link: str = ""


@dataclass
class Diagnosis:
    """A break explained: category key, plain words, a code fix, and the Kiln remedy that applies."""

    category: str
    plain: str
    fix: str
    remedy: str | None = None


def parse_message(message: str, gb_type: str = "") -> DynamoMessage:
    """Split Dynamo's message into explanation, hints, context and documentation link.

    A message can chain breaks ("While handling this graph break, another graph break
    occurred"); the part read is the one headed by `gb_type`, else the first."""
    lines = message.splitlines()
    heads = [i for i, line in enumerate(lines) if gb_type and line.strip() == gb_type]
    if heads:
        lines = lines[heads[-1] :]
    parsed = DynamoMessage()
    current = None
    for raw in lines:
        line = raw.strip()
        if line.startswith("*** While handling this graph break"):
            break
        if line.startswith("Explanation:"):
            parsed.explanation, current = line.removeprefix("Explanation:").strip(), "explanation"
        elif line.startswith("Hint:"):
            parsed.hints.append(line.removeprefix("Hint:").strip())
            current = "hint"
        elif line.startswith("Developer debug context:"):
            parsed.context, current = line.removeprefix("Developer debug context:").strip(), "context"
        elif line.startswith("For more details about this graph break"):
            parsed.link = line.rsplit(" ", 1)[-1]
            current = None
        elif line and raw.startswith("    ") and current:
            if current == "explanation":
                parsed.explanation += " " + line
            elif current == "hint":
                parsed.hints[-1] += " " + line
            else:
                parsed.context += " " + line
        elif not line:
            current = None if current == "context" else current
    return parsed


def diagnose(gb_type: str, message: str, stack: list[SourceFrame]) -> Diagnosis:
    """Category, plain words, fix and remedy for one break."""
    parsed = parse_message(message, gb_type)
    where = stack[-1] if stack else None
    for rule in RULES:
        found = rule(gb_type, parsed, stack, where)
        if found:
            return found
    return _other(gb_type, parsed)


# -- the rules, most specific first -------------------------------------------------------------
Rule = Callable[[str, DynamoMessage, list[SourceFrame], SourceFrame | None], Diagnosis | None]


def _cache_object(gb_type, parsed, stack, where) -> Diagnosis | None:
    owner = next((q for q in (qualname(f) for f in reversed(stack)) if _is_cache_class(q)), None)
    if owner is None:
        return None
    inner = diagnose(gb_type, _unparse(parsed), [])  # what broke inside the cache code
    return Diagnosis(
        "cache_object",
        f"Dynamo stopped inside the Python KV-cache object `{owner}`: {_lower_first(inner.plain)} "
        "The cache is Python state that the model mutates on every call, so every step runs "
        "through it.",
        "Call the model without a cache object (`use_cache=False`, no `past_key_values`): Kiln "
        "captures that stateless forward and its `insert_kv_cache` pass adds preallocated KV "
        "buffers written in the graph. In your own code, keep the cache as preallocated tensors "
        "updated in place (`k_cache[:, :, pos] = k`) rather than a Python object.",
        "stateless_capture",
    )


def _logging(gb_type, parsed, stack, where) -> Diagnosis | None:
    function = _called_function(parsed)
    if "logging.Logger" in gb_type:
        call = "a `logging` call"
    elif function == "print":
        call = "`print(...)`"
    elif function in ("warnings.warn", "_warnings.warn"):
        call = "`warnings.warn(...)`"
    else:
        return None
    return Diagnosis(
        "python_side_effect",
        f"{call} writes output while the model runs. A graph holds only tensor operations, so "
        "Dynamo ends the graph, makes the call in Python, and starts a new graph after it.",
        f"Remove {call} from the forward, or guard it with `if not torch.compiler.is_compiling():`; "
        "to keep it, register it so Dynamo moves it after the graph: "
        "`torch._dynamo.config.reorderable_logging_functions.add(print)` (or `warnings.warn`), or "
        "drop logger calls with `torch._dynamo.config.ignore_logging_functions.add(logging.Logger.info)`.",
        "reorder_logging",
    )


def _scalar_escape(gb_type, parsed, stack, where) -> Diagnosis | None:
    text = f"{gb_type} {parsed.context}"
    if "tolist()" in gb_type:
        return Diagnosis(
            "scalar_escape",
            "`.tolist()` turns a floating-point tensor into Python numbers; Dynamo can follow "
            "only integer ones, so the values leave the graph.",
            f"Keep the values as a tensor and use tensor operations on them{_at(where)}; "
            "if you need Python numbers, compute them outside the model.",
        )
    if "item()" not in text and "_local_scalar_dense" not in text and "Data dependent operator" not in gb_type:
        return None
    return Diagnosis(
        "scalar_escape",
        f"A tensor's value becomes a Python number or bool here (`.item()`, `bool(t)`, `int(t)`, "
        f"`if t.any()`){_at(where)}. By default Dynamo does not follow values computed from tensor "
        "data, so the graph ends and the rest runs in Python.",
        "Keep the value as a 0-d tensor (`x.sum()` instead of `x.sum().item()`) and continue with "
        "tensor ops (`torch.where`, broadcasting, `torch.clamp`); or let Dynamo capture it as a "
        "symbol: `torch._dynamo.config.capture_scalar_outputs = True`.",
        "symbolic_scalars",
    )


def _dynamic_shape(gb_type, parsed, stack, where) -> Diagnosis | None:
    if gb_type != "Dynamic shape operator":
        return None
    op = re.search(r"`aten\.(\w+)", parsed.explanation)
    name = op.group(1) if op else "this operator"
    return Diagnosis(
        "dynamic_shape",
        f"The output size of `{name}` depends on the values in a tensor (e.g. `nonzero` or "
        f"indexing with a boolean mask `x[mask]`){_at(where)}, so the shapes after it are not "
        "known when the graph is built.",
        "Keep shapes static: replace `x[mask]` by `torch.where(mask, x, 0)` (or multiply by the "
        "mask) and reduce over the full tensor; or let Dynamo capture the size as a symbol: "
        "`torch._dynamo.config.capture_dynamic_output_shape_ops = True`.",
        "symbolic_shapes",
    )


def _control_flow(gb_type, parsed, stack, where) -> Diagnosis | None:
    if not (gb_type.startswith("Data-dependent") or gb_type.startswith("generic_jump")):
        return None
    line = statement_at(where) if where else ""
    loop = line.startswith("while ")
    statement = f"`{line}`" if line else "a branch"
    return Diagnosis(
        "data_dependent_control_flow",
        f"{statement} decides on the value of a tensor. A graph has one fixed path, so Dynamo "
        f"ends the graph, computes the condition, and starts a new graph for the path taken"
        f"{' on every iteration' if loop else ''}.",
        "Compute both branches and select with `torch.where(cond, a, b)` when both are cheap and "
        "have no side effects, or use `torch.cond(cond, true_fn, false_fn, (x,))`. For a loop, "
        "iterate a fixed (Python int) number of times and mask finished elements."
        if loop
        else "Compute both branches and select with `torch.where(cond, a, b)` when both are cheap and "
        "have no side effects, or use `torch.cond(cond, true_fn, false_fn, (x,))`. If the condition "
        "only guards an error, check it outside the model. For Python `and`/`or` between tensors, "
        "use `&`/`|`.",
        None if loop else "branch_to_select",
    )


def _context_manager(gb_type, parsed, stack, where) -> Diagnosis | None:
    if not (
        gb_type.startswith("Unsupported context manager")
        or "GenericContextWrappingVariable" in gb_type
        or gb_type == "step_unsupported"
    ):
        return None
    manager = re.search(r"enter a `([^`]+)` context manager", parsed.explanation)
    if manager:
        plain = (
            f"Dynamo cannot enter the `{manager.group(1)}` context manager{_at(where)}, so it compiles "
            "the graph up to the `with` and runs the block, and the rest of the function, in Python."
        )
    else:
        plain = (
            f"A break{_at(where)} happens while a context manager (or `try` block) Dynamo cannot split "
            "is open, so Dynamo cannot resume right after it: it compiles the graph up to the last safe "
            "point before the block and runs the rest of the function in Python."
        )
    return Diagnosis(
        "context_manager",
        plain,
        "Move the `with` block (or the call that breaks inside it) out of the compiled code, "
        "or fix the break inside it; the earlier break is usually the real cause.",
    )


def _unsupported_call(gb_type, parsed, stack, where) -> Diagnosis | None:
    if gb_type not in (
        "Attempted to call function marked as skipped",
        "Failed to trace builtin operator",
        "Attempted to copy.deepcopy a tensor",
        "Unsupported function call",
        "Unsupported method call",
        "unimplemented builtin op on tensor arguments",
    ):
        return None
    function = "copy.deepcopy" if gb_type.startswith("Attempted to copy.deepcopy") else _called_function(parsed)
    kind = "a Python builtin or C extension" if function else "code"
    function = function or "a function"
    return Diagnosis(
        "unsupported_call",
        f"`{function}` is {kind} that Dynamo cannot look inside{_at(where)}, so the graph ends "
        "before the call and a new one starts after it.",
        f"Compute `{function}` outside the model and pass the result in; or, if it must stay, "
        'wrap it as a custom op (`@torch.library.custom_op("mylib::op", mutates_args=())` with a '
        "`register_fake` for its shapes) so that Dynamo keeps it in the graph as one opaque node.",
    )


def _user_requested(gb_type, parsed, stack, where) -> Diagnosis | None:
    if "graph_break()" in gb_type:
        what, fix = (
            "`torch._dynamo.graph_break()` asks for a break here.",
            "Remove the `torch._dynamo.graph_break()` call.",
        )
    elif "torch.compiler.disable" in gb_type:
        what = "The function called here is marked `@torch.compiler.disable`, so Dynamo runs it in Python."
        fix = "Remove the `torch.compiler.disable` decorator (or call) if the function is traceable."
    else:
        return None
    return Diagnosis("user_requested", what, fix)


def _python_construct(gb_type, parsed, stack, where) -> Diagnosis | None:
    if gb_type.startswith("Missing tp_") or gb_type.startswith("Unsupported next() call"):
        return Diagnosis(
            "python_construct",
            f"Dynamo cannot step this Python iterator{_at(where)}: {parsed.explanation or gb_type} This often "
            "happens while Dynamo resumes after an earlier break, in code it would otherwise trace.",
            "Fix the earlier break first; otherwise iterate over a list (`list(d.keys())`) instead of a live iterator.",
        )
    if "generator" not in gb_type.lower():
        return None
    return Diagnosis(
        "python_construct",
        "A generator function is called here; Dynamo cannot compile a generator frame, so it runs in Python.",
        "Return a list or tuple instead of yielding, or call the generator outside the compiled code.",
    )


def _other(gb_type: str, parsed: DynamoMessage) -> Diagnosis:
    fix = " ".join(h for h in parsed.hints if "file an issue" not in h.lower()) or "See Dynamo's explanation."
    return Diagnosis("other", parsed.explanation or gb_type, fix)


RULES: list[Rule] = [
    _cache_object,
    _logging,
    _scalar_escape,
    _dynamic_shape,
    _control_flow,
    _context_manager,
    _unsupported_call,
    _user_requested,
    _python_construct,
]


# -- helpers ------------------------------------------------------------------------------------
def qualname(frame: SourceFrame) -> str:
    """`Class.method` for a frame inside a class body, else the function name."""
    return _qualnames(frame.filename).get((frame.function, frame.lineno), frame.function)


@functools.lru_cache(maxsize=64)
def _qualnames(filename: str) -> dict[tuple[str, int], str]:
    """{(function, line): qualified name} for every line of every function in a source file."""
    try:
        with open(filename, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return {}
    names: dict[tuple[str, int], str] = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for line in range(child.lineno, (child.end_lineno or child.lineno) + 1):
                    names.setdefault((child.name, line), f"{prefix}{child.name}")
                visit(child, f"{prefix}{child.name}.<locals>.")

    visit(tree, "")
    return names


def _is_cache_class(name: str) -> bool:
    """Whether a qualified name is a method of a class named like a KV cache (`DynamicCache.update`)."""
    return any("Cache" in part for part in name.split(".")[:-1])


def _called_function(parsed: DynamoMessage) -> str | None:
    """The builtin or C function a break names (`zlib.crc32`, `print`, `_warnings.warn`), if any."""
    name = re.search(r"(?:builtin|operator) `([^`]+?)\.?`", parsed.explanation)
    return name.group(1) if name else None


def _at(where: SourceFrame | None) -> str:
    return f" (`{_code_only(where.line)}`)" if where and where.line else ""


def statement_at(where: SourceFrame, limit: int = 160) -> str:
    """The statement starting at `where`, joined over its lines while brackets are open."""
    text, depth = "", 0
    for lineno in range(where.lineno, where.lineno + 8):
        line = _code_only(linecache.getline(where.filename, lineno).strip())
        text += (" " if text and not text.endswith(("(", "[")) else "") + line
        depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")
        if depth <= 0:
            break
    text = text.replace("( ", "(").replace(" )", ")")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _code_only(line: str) -> str:
    """A source line without its trailing comment (a `#` inside a string is rare enough here)."""
    return line.split("  #")[0].rstrip()


def _lower_first(text: str) -> str:
    """A sentence continued after a colon: lowercase its first letter unless it starts a name."""
    return text if text.startswith(("Dynamo", "Kiln", "`")) else text[:1].lower() + text[1:]


def _unparse(parsed: DynamoMessage) -> str:
    hints = "\n".join(f"  Hint: {h}" for h in parsed.hints)
    return f"  Explanation: {parsed.explanation}\n{hints}\n\n  Developer debug context: {parsed.context}"
