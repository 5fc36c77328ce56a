"""What a recompile means: which guard failed, on what value, in plain words, and the fix.

Dynamo guards each compiled graph with checks on its inputs (sizes, dtypes, Python values,
object identity); when every cached graph's guards fail, it compiles again. Its guard text reads
`0/1: tensor 'kwargs['input_ids']' size mismatch at index 1. expected 7, actual 1`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_COMPILE_ID = re.compile(r"^\s*\d+/\d+:\s*")
_SIZE = re.compile(
    r"tensor '(?P<source>.+)' (?P<what>size|stride) mismatch at index (?P<dim>\d+)\. "
    r"expected (?P<expected>\S+), actual (?P<actual>\S+)"
)
_TENSOR_PROPERTY = re.compile(
    r"tensor '(?P<source>.+)' (?P<what>dtype|device|requires_grad|dispatch key set) "
    r"mismatch\.?\s*(?P<rest>.*)"
)
_RANGE = re.compile(r"^(?P<expr>-?\d+ <= .+? <= -?\d+|.+? <= -?\d+|-?\d+ <= [^#]+?)\s*(#|$)")
_EQUALS = re.compile(r"^(?P<source>[^=<>!]+?)\s*==\s*(?P<value>[^#]+?)\s*(#|$)")


@dataclass
class GuardDiagnosis:
    category: str  # dynamic_shape | value_specialization | object_identity | tensor_property | other
    guard: str  # the failed guard, without Dynamo's compile id
    source: str  # the input it checks
    value: str  # the value that failed it
    plain: str
    fix: str
    kiln: str | None  # how Kiln's own capture avoids this recompile, if it does


def diagnose_guard(reason: str) -> GuardDiagnosis:
    """Explain one failed guard (the first line of Dynamo's recompile reason)."""
    guard = _COMPILE_ID.sub("", reason.splitlines()[0] if reason else "").strip()
    for rule in (_size_mismatch, _tensor_property, _range, _equals, _identity):
        found = rule(guard)
        if found is not None:
            return found
    return GuardDiagnosis(
        "other",
        guard,
        "",
        "",
        f"A guard failed: `{guard}`.",
        "Keep the inputs that guard checks the same from call to call.",
        None,
    )


def _size_mismatch(guard: str) -> GuardDiagnosis | None:
    match = _SIZE.search(guard)
    if match is None:
        return None
    source, dim, old, new = match["source"], match["dim"], match["expected"], match["actual"]
    value = f"dim {dim}: {old} -> {new}"
    if match["what"] == "stride":
        return GuardDiagnosis(
            "tensor_property",
            guard,
            source,
            f"stride {value}",
            f"`{source}` arrived with a different memory layout (stride of dim {dim} {old} -> {new}).",
            "Pass contiguous tensors (`.contiguous()`) so the layout is the same on every call.",
            None,
        )
    if _is_cache(source):
        plain = (
            f"The KV cache grew: `{source}` has {new} positions in dim {dim} where the graph was "
            f"compiled for {old}. A Python cache object grows by one token per step, and Dynamo "
            "specialized the graph on its length."
        )
        kiln = (
            "Kiln's static KV cache has a fixed shape [max_batch, kv_heads, max_seq_len, head_dim] "
            "and positions are data (`insert_kv_cache`), so nothing recompiles as the sequence grows."
        )
        fix = (
            'Use a static cache (`cache_implementation="static"` / `StaticCache`) so the shapes stay '
            "fixed, or `torch._dynamo.mark_dynamic` the cache length before the first call."
        )
    else:
        plain = (
            f"`{source}` changed size in dim {dim} ({old} -> {new}). Dynamo had specialized the "
            "graph on the old size; on this second size it compiles again with the dim dynamic "
            "(automatic dynamic shapes)."
        )
        kiln = (
            "Kiln captures batch and seq as symbolic dims (torch.export `Dim`), so one graph serves "
            "every length, prefill (T > 1) and decode (T = 1) alike."
        )
        fix = (
            f"Mark the dim dynamic before the first call: `torch._dynamo.mark_dynamic({_tensor_name(source)}, {dim})`, "
            "or compile with `dynamic=True`."
        )
    return GuardDiagnosis("dynamic_shape", guard, source, value, plain, fix, kiln)


def _tensor_property(guard: str) -> GuardDiagnosis | None:
    match = _TENSOR_PROPERTY.search(guard)
    if match is None:
        return None
    source, what = match["source"], match["what"]
    return GuardDiagnosis(
        "tensor_property",
        guard,
        source,
        f"{what} {match['rest']}".strip(),
        f"`{source}` arrived with a different {what} than the graph was compiled for.",
        f"Pass `{source}` with the same {what} on every call (e.g. cast once before the model).",
        None,
    )


def _range(guard: str) -> GuardDiagnosis | None:
    match = _RANGE.match(guard)
    if match is None or "<=" not in guard:
        return None
    expr = match["expr"].strip()
    return GuardDiagnosis(
        "dynamic_shape",
        guard,
        expr,
        "outside the range",
        f"The graph was compiled for sizes with `{expr}`, and this call's size is outside that range "
        "(Dynamo specializes sizes 0 and 1, and bounds it learned while tracing).",
        "Mark the dim with its real range before the first call: "
        "`torch._dynamo.mark_dynamic(t, dim, min=1, max=N)` (or `mark_unbacked` to avoid the 0/1 specialization).",
        "Kiln declares each symbolic dim's range once (1..max_seq_len), so a graph serves the whole range.",
    )


def _equals(guard: str) -> GuardDiagnosis | None:
    match = _EQUALS.match(guard)
    if match is None:
        return None
    source, value = match["source"].strip(), match["value"].strip()
    return GuardDiagnosis(
        "value_specialization",
        guard,
        source,
        f"was {value}",
        f"The graph was compiled for `{source} == {value}`; a Python value (an int, a flag, a "
        "string) that changes between calls is baked into the graph, so each new value compiles again.",
        f"Pass `{source}` as a tensor if it varies, or keep it constant across calls.",
        None,
    )


def _identity(guard: str) -> GuardDiagnosis | None:
    if "___check_obj_id" not in guard and "___check_type_id" not in guard and " is " not in guard:
        return None
    kind = "type" if "type_id" in guard else "object"
    return GuardDiagnosis(
        "object_identity",
        guard,
        guard,
        f"a different {kind}",
        f"The graph was compiled for one specific Python {kind}, and this call passed another.",
        "Pass the same object (module, function, config) on every call, or pass the varying data as tensors.",
        None,
    )


def _is_cache(source: str) -> bool:
    lowered = source.lower()
    return "past_key_values" in lowered or "cache" in lowered or lowered.endswith((".keys", ".values"))


def _tensor_name(source: str) -> str:
    match = re.search(r"\['([^']+)'\]$", source)
    return match.group(1) if match else source
