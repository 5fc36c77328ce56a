"""Writing and reading the backend's files: `model.onnx` and its weights in `model.onnx.data`.

Initializers of 1 KiB or more go to the data file as ONNX external data, each at a 4 KiB
aligned offset (ORT can then map them instead of copying); smaller ones stay inline. How to
run the model (which caches update in place, ...) rides along in the model's metadata under
`kiln.program`, so a loaded artifact needs nothing but these two files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx

from .errors import ArtifactError
from .to_onnx import INFO_KEY, OnnxProgram

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
INLINE_BYTES = 1024
ALIGNMENT = 4096


def write_model(program: OnnxProgram, directory: Path) -> list[str]:
    """Write model.onnx and model.onnx.data into `directory`; returns their names."""
    directory.mkdir(parents=True, exist_ok=True)
    model = onnx.ModelProto()
    model.CopyFrom(program.model)
    tensors = []
    with open(directory / DATA_FILE, "wb") as data:
        for name, array in program.initializers.items():
            tensor = onnx.TensorProto(
                name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape
            )
            if array.nbytes < INLINE_BYTES:
                tensor.raw_data = array.tobytes()
            else:
                data.write(b"\0" * (-data.tell() % ALIGNMENT))
                offset = data.tell()
                data.write(memoryview(np.ascontiguousarray(array)).cast("B"))
                tensor.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", DATA_FILE), ("offset", str(offset)), ("length", str(array.nbytes))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, value
            tensors.append(tensor)
    model.graph.initializer.extend(tensors)
    onnx.helper.set_model_props(model, {INFO_KEY: json.dumps(program.info, sort_keys=True)})
    (directory / MODEL_FILE).write_bytes(model.SerializeToString())
    return [MODEL_FILE, DATA_FILE]


def read_info(model_path: Path) -> dict:
    """The `kiln.program` metadata of a written model (without loading its weights)."""
    model = onnx.load(str(model_path), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == INFO_KEY:
            return json.loads(prop.value)
    raise ArtifactError(
        f"{model_path} has no {INFO_KEY} metadata: it was not written by Kiln's "
        "onnxruntime backend. Fix: recompile the model with --backend onnxruntime."
    )


def check_model(model_path: Path) -> None:
    """onnx.checker's full check (types and shapes inferred and checked) of a written model."""
    onnx.checker.check_model(str(model_path), full_check=True)
