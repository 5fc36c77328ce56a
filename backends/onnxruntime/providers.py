"""Which execution provider runs the model, with which session options, and whether it can.

`device` "cpu" (the default) is ORT's CPUExecutionProvider; "cuda" is CUDAExecutionProvider,
present when the `gpu` extra (onnxruntime-gpu) is installed. `check_supported` looks every node
up in ORT's kernel registry for that provider (op, domain, opset version and the element types
the node is fed), so a model the provider cannot run fails at compile time, naming the op and
the provider, instead of at the first generate.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import warnings
from typing import NamedTuple

import onnx
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from kiln.backends.executable import BackendOptions

from .contrib_patterns import SEQLENS_K
from .errors import ProviderError
from .onnx_builder import MS_DOMAIN

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "gpu": "CUDAExecutionProvider"}


def target_provider(device: str) -> str:
    """The execution provider for a device name ("cpu", "cuda", "cuda:1"), installed or not."""
    kind = device.split(":")[0]
    if kind not in PROVIDERS:
        raise ProviderError(
            f"device {device!r} has no ONNX Runtime execution provider here. "
            f"Fix: use one of {', '.join(sorted(PROVIDERS))}."
        )
    return PROVIDERS[kind]


def choose_provider(device: str) -> str:
    """The execution provider for a device name ("cpu", "cuda", "cuda:1"); it must be installed."""
    provider = target_provider(device)
    if provider not in ort.get_available_providers():
        raise ProviderError(
            f"{provider} is not available in this onnxruntime {ort.__version__} (it has "
            f"{', '.join(ort.get_available_providers())}). Fix: install the gpu extra "
            "(pip install 'kiln[gpu]', i.e. onnxruntime-gpu), or use device='cpu'."
        )
    return provider


def device_binding(device: str) -> tuple[str, int]:
    """(device type, device id) for IOBinding: ("cpu", 0) or ("cuda", N)."""
    kind, _, index = device.partition(":")
    return ("cpu", 0) if kind == "cpu" else ("cuda", int(index or 0))


def session_options(options: BackendOptions) -> ort.SessionOptions:
    """All graph optimizations, sequential execution, `threads` intra-op threads."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.inter_op_num_threads = 1
    if options.threads:
        so.intra_op_num_threads = options.threads
    so.log_severity_level = 3  # errors only: ORT warns about routine things (e.g. nodes kept on CPU)
    return so


def provider_list(provider: str, device: str) -> list:
    if provider == "CUDAExecutionProvider":
        # use_tf32 off: an f32 model computes in f32, as the Hugging Face oracle does (TF32 MatMuls
        # flip greedy tokens of small random models)
        return [(provider, {"device_id": device_binding(device)[1], "use_tf32": "0"}), "CPUExecutionProvider"]
    return [provider]


class KernelDef(NamedTuple):
    """What the check needs of one registered kernel."""

    version_range: tuple[int, int]
    type_constraints: dict[str, list[str]]


_KERNELS_SCRIPT = """
import json, sys
from onnxruntime.capi import onnxruntime_pybind11_state as s
print(json.dumps([[k.domain, k.op_name, list(k.version_range), {n: list(t) for n, t in k.type_constraints.items()}]
                  for k in s.get_all_opkernel_def() if k.provider == sys.argv[1]]))
"""


_CPU_BUILD = {"CPUExecutionProvider", "AzureExecutionProvider"}  # the onnxruntime wheel's providers


@functools.cache
def _kernels(provider: str) -> dict[tuple[str, str], list[KernelDef]] | None:
    """(domain, op) -> the provider's kernels; None when the registry cannot be read.

    onnxruntime-gpu's `get_all_opkernel_def` crashes the process (segfault, whichever provider is
    asked for; seen with 1.31.1 on an H100 machine), so a build with more than the CPU provider
    reads the registry in a child process, where a crash costs only the check. The CPU wheel
    (with its Azure provider) reads it here: a child costs a Python start and an ORT import."""
    if set(ort.get_available_providers()) <= _CPU_BUILD:
        listed = [
            (k.domain, k.op_name, k.version_range, k.type_constraints)
            for k in ort_state.get_all_opkernel_def()
            if k.provider == provider
        ]
    else:
        done = subprocess.run(
            [sys.executable, "-c", _KERNELS_SCRIPT, provider], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            warnings.warn(
                f"could not read ONNX Runtime's kernel registry for {provider} (exit status "
                f"{done.returncode}: {done.stderr.strip()[-300:]}); the model's ops are not checked "
                "against that provider before the first run",
                stacklevel=3,
            )
            return None
        listed = json.loads(done.stdout)
    index: dict[tuple[str, str], list[KernelDef]] = {}
    for domain, op, versions, constraints in listed:
        index.setdefault((domain, op), []).append(KernelDef(tuple(versions), dict(constraints)))
    return index


@functools.cache
def _schemas() -> dict[tuple[str, str], list]:
    index: dict[tuple[str, str], list] = {}
    for schema in ort_state.get_all_operator_schema():
        index.setdefault((schema.domain, schema.name), []).append(schema)
    return index


def _schema(domain: str, op_type: str, opset: int):
    """The schema version a node of this opset uses (the newest since_version <= opset)."""
    versions = [s for s in _schemas().get((domain, op_type), []) if s.since_version <= opset]
    return max(versions, key=lambda s: s.since_version) if versions else None


def _param_types(schema, node: onnx.NodeProto, types: dict[str, str]) -> dict[str, set[str]]:
    """Type-constraint name -> the element types the node binds to it."""
    bound: dict[str, set[str]] = {}
    for formals, actuals in ((schema.inputs, node.input), (schema.outputs, node.output)):
        for i, name in enumerate(actuals):
            if not name or not formals:
                continue
            formal = formals[min(i, len(formals) - 1)]  # the last formal may be variadic
            if name in types:
                bound.setdefault(formal.typeStr, set()).add(types[name])
    return bound


def _type_string(elem_type: int) -> str:
    """ORT's spelling of an element type: FLOAT -> 'tensor(float)'."""
    return f"tensor({onnx.helper.tensor_dtype_to_string(elem_type).split('.')[-1].lower()})"


def _value_types(model: onnx.ModelProto) -> dict[str, str]:
    """The type of every value shape inference can type, and of every initializer."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {}
    for info in [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]:
        if info.type.HasField("tensor_type"):
            types[info.name] = _type_string(info.type.tensor_type.elem_type)
    for init in model.graph.initializer:
        types[init.name] = _type_string(init.data_type)
    return types


# What is known without the registry (used when it cannot be read): (domain, op) -> the element
# types the provider's kernel takes. ORT places any other node on the CPU, and a GroupQueryAttention
# moved there breaks the KV buffers bound in place on the device (seen on an H100: the prompt's
# logits right, every decode step wrong).
KNOWN_TYPES = {"CUDAExecutionProvider": {(MS_DOMAIN, "GroupQueryAttention"): {"tensor(float16)", "tensor(bfloat16)"}}}


# The dtypes in which GroupQueryAttention, as Kiln feeds it (packed QKV, KV buffers shared in
# place, sequence lengths fed from the host), was checked against Hugging Face on each provider;
# other dtypes and providers get attention in plain ONNX ops. CUDA's kernel takes no f32.
GQA_CHECKED = {"CPUExecutionProvider": frozenset({"f32", "f16"}), "CUDAExecutionProvider": frozenset({"f16"})}


def attention_dtypes(provider: str) -> frozenset[str]:
    """The IR dtypes whose attention goes to GroupQueryAttention on `provider` (others: plain ops)."""
    return GQA_CHECKED.get(provider, frozenset())


def unsupported_nodes(model: onnx.ModelProto, provider: str) -> list[str]:
    """A description of each node `provider` has no kernel for (empty when it runs them all)."""
    # a provider this build lacks has no registry here (compiling for CUDA on a CPU machine)
    registry = _kernels(provider) if provider in ort.get_available_providers() else None
    if registry is None:  # unreadable (warned) or absent: only what is known without it
        return _known_unsupported(model, provider)
    opsets = {o.domain: o.version for o in model.opset_import}
    types = _value_types(model)
    problems = []
    for node in model.graph.node:
        schema = _schema(node.domain, node.op_type, opsets.get(node.domain, 1))
        kernels = registry.get((node.domain, node.op_type), [])
        if schema is None or not kernels:
            problems.append(f"{node.op_type} ({node.domain or 'ai.onnx'}) in node {node.name}")
            continue
        bound = _param_types(schema, node, types)
        version = schema.since_version
        if not any(
            k.version_range[0] <= version <= k.version_range[1]
            and all(bound.get(param, set()) <= set(allowed) for param, allowed in k.type_constraints.items())
            for k in kernels
        ):
            fed = ", ".join(f"{p}={'/'.join(sorted(t))}" for p, t in sorted(bound.items()))
            problems.append(f"{node.op_type} ({node.domain or 'ai.onnx'} opset {version}, {fed}) in node {node.name}")
    return problems


def _known_unsupported(model: onnx.ModelProto, provider: str) -> list[str]:
    known = KNOWN_TYPES.get(provider, {})
    if not known:
        return []
    types = _value_types(model)
    problems = []
    for node in model.graph.node:
        allowed = known.get((node.domain, node.op_type))
        fed = {types[name] for name in node.input[:1] if name in types}
        if allowed is not None and fed - allowed:
            problems.append(
                f"{node.op_type} ({node.domain}, {'/'.join(sorted(fed))}; the provider takes "
                f"{'/'.join(sorted(allowed))}) in node {node.name}"
            )
    return problems


def check_supported(model: onnx.ModelProto, provider: str) -> None:
    """Raise ProviderError naming every op of `model` that `provider` cannot run."""
    problems = unsupported_nodes(model, provider)
    if problems:
        listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ProviderError(
            f"ONNX Runtime {ort.__version__}'s {provider} cannot run: {listed}. Fix: use another "
            "device (e.g. device='cpu'), another dtype (f16 or bf16 for CUDA), or the inductor "
            "backend."
        )


def check_lengths_fed(model: onnx.ModelProto, info: dict, provider: str) -> None:
    """Refuse, off the CPU, a model whose GroupQueryAttention computes its sequence lengths in the
    graph (artifacts compiled before they became inputs): CUDA's kernel attends wrongly then."""
    if provider == "CPUExecutionProvider" or SEQLENS_K in info["inputs"]:
        return
    if any(n.op_type == "GroupQueryAttention" for n in model.graph.node):
        raise ProviderError(
            f"this model computes GroupQueryAttention's sequence lengths in the graph, which "
            f"{provider} gets wrong (an artifact compiled by an older Kiln). Fix: compile it "
            "again with this version."
        )
