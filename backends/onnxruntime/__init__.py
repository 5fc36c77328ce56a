"""The onnxruntime backend: Kiln IR -> ONNX ModelProto (written directly) -> InferenceSession.

- to_onnx.py drives the lowering: op_lowerings.py holds the one table from IR op to plain ONNX
  nodes (`ONNX_LOWERINGS`), contrib_patterns.py hands groups to ORT's com.microsoft kernels
  (GroupQueryAttention, SkipSimplifiedLayerNormalization, ...), plain_attention.py is the
  attention/kv_write fallback in standard ops, paged_attention.py a paged cache's kv_write and
  kv_pages (ScatterND into and GatherND out of the pools through the block table);
- model_files.py writes `model.onnx` with its weights as external data (`model.onnx.data`);
- executable.py runs it with IOBinding over KV buffers updated in place; providers.py picks the
  execution provider and checks at compile time that it can run every node.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

from kiln.backends.executable import BackendOptions
from kiln.ir import Graph, verify

from .errors import ArtifactError, FeedError, OnnxLoweringError, ProviderError
from .executable import OrtExecutable, OrtModelForAnotherMachine
from .model_files import DATA_FILE, MODEL_FILE, check_model, write_model
from .op_lowerings import ONNX_LOWERINGS, check_lowering_table
from .providers import check_supported, target_provider
from .to_onnx import OnnxProgram, graph_to_onnx

NAME = "onnxruntime"


def backend_version() -> str:
    """What actually runs the model: the onnxruntime package's version."""
    return ort.__version__


def lower(graph: Graph, options: BackendOptions, contrib_ops: bool = True) -> OrtExecutable:
    """Lower a stateful graph (weights attached) to ONNX and open an InferenceSession on it.

    `contrib_ops=False` keeps to standard ONNX ops (slower; for comparison and testing).
    A device whose provider this onnxruntime lacks (compiling here for CUDA, say) gets the model
    checked against what is known of that provider and an `OrtModelForAnotherMachine`, which
    only saves: the artifact runs where `kiln.load` finds the provider."""
    verify(graph)
    provider = target_provider(options.device)
    program = graph_to_onnx(graph, contrib_ops=contrib_ops, provider=provider)
    workdir = tempfile.TemporaryDirectory(prefix="kiln-onnx-")
    write_model(program, Path(workdir.name))
    path = Path(workdir.name) / MODEL_FILE
    if provider not in ort.get_available_providers():
        check_supported(onnx.load(str(path), load_external_data=False), provider)
        return OrtModelForAnotherMachine(path, options, provider, workdir)
    return OrtExecutable(path, options, workdir)


def load(directory: Path, graph: Graph, weights: dict[str, torch.Tensor], options: BackendOptions) -> OrtExecutable:
    """Open an artifact's model.onnx (no lowering: graph and weights are not needed to run it)."""
    path = Path(directory) / MODEL_FILE
    if not path.is_file():
        raise ArtifactError(
            f"{path} is missing: the artifact was not compiled with --backend onnxruntime. "
            "Fix: recompile it with --backend onnxruntime."
        )
    return OrtExecutable(path, options)


__all__ = [
    "DATA_FILE",
    "MODEL_FILE",
    "NAME",
    "ONNX_LOWERINGS",
    "FeedError",
    "OnnxLoweringError",
    "OnnxProgram",
    "OrtExecutable",
    "ProviderError",
    "backend_version",
    "check_lowering_table",
    "check_model",
    "check_supported",
    "graph_to_onnx",
    "load",
    "lower",
    "write_model",
]
