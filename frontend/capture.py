"""Capture a causal LM's stateless forward `(tokens, positions) -> logits` into Kiln IR.

A reward model (a `*ForSequenceClassification` with one label) is captured the same way, its
score head in place of the lm_head: the graph's output is every position's score
f32[batch, seq, 1] where a causal LM's logits would be, so the passes, backends and KV cache
serve it unchanged; the runtime picks the position Hugging Face pools (runtime/rewards.py).

The model runs with `use_cache=False`: the KV cache is the compiler's job (the
`insert_kv_cache` pass), so no Python cache object ever enters the trace. torch.export traces
with `batch` and `seq` symbolic; the program is decomposed to core ATen except for
`scaled_dot_product_attention` and `linear`, which Kiln keeps whole (they map to IR ops its
backends have fast kernels for).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

from kiln.ir import Graph

from .errors import UnsupportedOpError
from .fx_to_ir import FxToIr, _clean_param_name
from .layer_templates import plan_layers, repeat_layers, templates_only

KEEP_WHOLE = (torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.linear.default)
EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 17  # not 0/1: torch.export would specialize those sizes


class StatelessForward(torch.nn.Module):
    """`(tokens, positions) -> logits` (f32) around a Hugging Face causal LM, no KV cache; for a
    reward model, every position's score (Hugging Face pools one of them after the head)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        self.reward = is_reward_model(lm)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # f32 logits whatever the model's dtype (the runtime's contract; exact for f16/bf16)
        if self.reward:
            base = getattr(self.lm, self.lm.base_model_prefix)
            hidden = base(input_ids=tokens, position_ids=positions, use_cache=False).last_hidden_state
            return self.lm.score(hidden).float()
        return self.lm(input_ids=tokens, position_ids=positions, use_cache=False).logits.float()


def is_reward_model(lm: torch.nn.Module) -> bool:
    """A Hugging Face sequence classifier: a base model and a linear `score` head."""
    return type(lm).__name__.endswith("ForSequenceClassification") and isinstance(
        getattr(lm, "score", None), torch.nn.Linear
    )


def decompositions() -> dict:
    table = torch._decomp.core_aten_decompositions()
    for op in KEEP_WHOLE:
        table.pop(op, None)
    return table


def export_module(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    dynamic_dims: dict[tuple[int, int], tuple[str, int, int]],
) -> torch.export.ExportedProgram:
    """torch.export (non-strict) with named dynamic dims: {(input, axis): (name, min, max)}.
    The program is in training IR: not yet decomposed to core ATen."""
    dims = {}
    for (i, axis), (name, lo, hi) in dynamic_dims.items():
        dims.setdefault(i, {})[axis] = torch.export.Dim(name, min=lo, max=hi)
    spec = tuple(dims.get(i) for i in range(len(example_inputs)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export = functools.partial(
            torch.export.export, module, tuple(example_inputs), dynamic_shapes=spec, strict=False
        )
        try:
            return export()
        except ConstraintViolationError:
            # torch 2.11 (the GPU machines' torch) cannot prove guards such as
            # min(16*seq, 32*seq) == 16*seq that hold for every seq >= 1; deferred, they become
            # run-time asserts, which the IR drops as it drops every assert.
            return export(prefer_deferred_runtime_asserts_over_guards=True)


def capture_module(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
    dynamic_dims: dict | None = None,
    layers=None,
) -> Graph:
    """Capture any module into IR. Raises UnsupportedOpError for an ATen op Kiln cannot map.

    The training IR is converted directly when the ATen table covers all of its ops (the common
    case: it saves a second trace, about half of capture time); otherwise the program is
    decomposed to core ATen first, where every op is one the table knows or an error names it.
    `layers` (a layer_templates.LayerPlan) gets each IR node's decoder layer.
    """
    dynamic_dims = dynamic_dims or {}
    program = export_module(module.eval(), example_inputs, dynamic_dims)
    dim_names = {k: v[0] for k, v in dynamic_dims.items()}
    try:
        graph = FxToIr(program, input_names, dim_names, layers).convert(output_names)
    except UnsupportedOpError:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = program.run_decompositions(decompositions())
        graph = FxToIr(program, input_names, dim_names, layers).convert(output_names)
    for name, lo, hi in dict.fromkeys(dynamic_dims.values()):
        graph.add_symbol(name, lo, hi)
    return graph


def capture_causal_lm(
    lm: torch.nn.Module,
    max_batch: int = 8,
    max_seq_len: int = 2048,
    dtype: torch.dtype = torch.float32,
    note: Callable[[str], None] | None = None,
) -> Graph:
    """The stateless forward of a causal LM: tokens i64[batch, seq], positions -> logits, with
    the model's floating-point weights in `dtype` (converted in place). The trace runs on fake
    tensors, so an f16/bf16 capture costs no slow CPU half-precision math; it records the casts
    the model itself makes (norms and softmax in f32), as Hugging Face runs it in that dtype.
    Each kind of decoder layer is traced once where the layers allow (layer_templates.py);
    `note` hears how the layers were captured."""
    lm = lm.eval().to(dtype)
    tokens = torch.randint(0, lm.config.vocab_size, (EXAMPLE_BATCH, EXAMPLE_SEQ))
    positions = torch.arange(EXAMPLE_SEQ).expand(EXAMPLE_BATCH, EXAMPLE_SEQ).contiguous()
    batch = ("batch", 1, max(max_batch, EXAMPLE_BATCH))
    seq = ("seq", 1, max(max_seq_len, EXAMPLE_SEQ))
    dynamic = {(0, 0): batch, (0, 1): seq, (1, 0): batch, (1, 1): seq}
    args = (StatelessForward(lm), (tokens, positions), ["tokens", "positions"], ["logits"], dynamic)
    with gathered_experts(lm), alibi_table_past(lm, seq[2]):
        graph, how = capture_layers_once(lm, args)
        if graph is None:
            graph = capture_module(*args)
    if note is not None:
        note(f"capture: {how}")
    graph.meta["model"] = model_meta(lm)
    return graph


def capture_layers_once(lm: torch.nn.Module, args) -> tuple[Graph | None, str]:
    """(the graph traced from one layer per kind, how), or (None, why every layer is traced)."""
    plan = plan_layers(lm)
    if isinstance(plan, str):
        return None, f"every decoder layer traced ({plan})"
    with templates_only(lm, plan):
        graph = capture_module(*args, layers=plan)
    weights = {_clean_param_name(f"lm.{n}"): t for n, t in _named_tensors(lm)}
    repeated = repeat_layers(graph, plan, weights)
    if isinstance(repeated, str):
        return None, f"every decoder layer traced ({repeated})"
    return repeated, plan.summary()


def _named_tensors(lm: torch.nn.Module):
    for name, tensor in [*lm.named_parameters(remove_duplicate=False), *lm.named_buffers(remove_duplicate=False)]:
        yield name, tensor.detach().contiguous()


@contextlib.contextmanager
def gathered_experts(lm: torch.nn.Module):
    """A mixture-of-experts model traced with transformers' "batched_mm" experts: each token
    gathers its top-k experts' weights (`index` of the stacked weights by the router's `topk`
    ids) and multiplies by them, which exports as plain ops. The default "grouped_mm" sorts
    tokens by expert into data-dependent groups that torch.export cannot keep symbolic."""
    implementation = getattr(lm.config, "_experts_implementation", None)
    if implementation is None or implementation == "batched_mm" or not hasattr(lm, "set_experts_implementation"):
        yield
        return
    lm.set_experts_implementation("batched_mm")
    try:
        yield
    finally:
        lm.set_experts_implementation(implementation)


@contextlib.contextmanager
def alibi_table_past(lm: torch.nn.Module, longest: int):
    """MPT builds its ALiBi bias as a table of `config.max_seq_len` keys and slices off the last
    `seq`; a capture whose `seq` reaches the table's length makes torch.export specialize that
    slice (a start of 0) and fail with a constraint violation on `seq`. The sliced values,
    `slope * (key - last key)`, do not depend on the table's length, so the capture sees a table
    one key longer than its `longest` sequence: the same bias at every length MPT itself runs,
    and the same slopes continued past it (as BLOOM's ALiBi, which has no table)."""
    config = lm.config
    table = getattr(config, "max_seq_len", None)
    if getattr(config, "model_type", None) != "mpt" or not isinstance(table, int) or table > longest:
        yield
        return
    config.max_seq_len = longest + 1
    try:
        yield
    finally:
        config.max_seq_len = table


def _kv_heads(text, heads: int) -> int:
    """Key/value heads: GQA's num_key_value_heads, Falcon's multi-query one, else one per head."""
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        return 1
    return getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None) or heads


def model_meta(lm) -> dict:
    """What later passes need to know about the architecture, as plain JSON data."""
    config = lm.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    window = getattr(text, "sliding_window", None) or 0
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        windows = [window if t == "sliding_attention" else 0 for t in layer_types]
    else:
        windows = [window if getattr(text, "use_sliding_window", True) else 0] * layers
    reward = {"task": "reward", "pad_token_id": text.pad_token_id} if is_reward_model(lm) else {}
    return {
        **reward,
        "architecture": (getattr(config, "architectures", None) or [type(lm).__name__])[0],
        "model_type": config.model_type,
        "vocab_size": text.vocab_size,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": _kv_heads(text, heads),
        "head_dim": head_dim,
        "layer_windows": windows,
    }
