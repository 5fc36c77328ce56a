"""Move a compiled artifact to another machine without its weights, and rebuild them there.

    python bench/rebuild_weights.py strip ART OUT --checkpoint HF_DIR   # here: OUT is a few MB
    python bench/rebuild_weights.py rebuild OUT --checkpoint HF_DIR     # there: OUT is loadable again

An artifact's two weight files (weights.safetensors, model.onnx.data for the onnxruntime backend)
are hundreds of MB, while the checkpoint they come from may travel in a smaller form (the default
model is a 98 MB GGUF, converted on each machine). `strip` drops the weight files and keeps what
rebuilding needs: the safetensors header, a recipe naming the checkpoint tensors each parameter
is made of (fused projections are `a-b-c` concatenations along dim 0; a tied lm_head is the
embedding), and the parameters no recipe reproduces (RoPE tables). `rebuild` writes every tensor at
the offsets its file records, so the rebuilt files are byte-identical or the manifest's sha256 says
otherwise: the check is the artifact's own.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

WEIGHTS, ONNX_DATA, HEADER, RECIPE, EXTRAS = (
    "weights.safetensors",
    "model.onnx.data",
    "weights.header",
    "recipe.json",
    "extras.safetensors",
)
SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}


def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def parts_of(name: str, checkpoint: dict[str, torch.Tensor]) -> list[str] | None:
    """The checkpoint tensors `name` concatenates (dim 0), or None when it is not made of them."""
    match = re.fullmatch(r"(.*\.)(\w+(?:-\w+)+)(\.\w+)", name)
    parts = [match[1] + p + match[3] for p in match[2].split("-")] if match else [name]
    if parts == ["lm_head.weight"] and "lm_head.weight" not in checkpoint:
        parts = ["model.embed_tokens.weight"]  # tied
    return parts if all(p in checkpoint for p in parts) else None


def assemble(parts: list[str], checkpoint: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([checkpoint[p].to(dtype) for p in parts]) if len(parts) > 1 else checkpoint[parts[0]].to(dtype)


def strip(artifact: Path, out: Path, checkpoint_dir: Path) -> None:
    checkpoint = checkpoint_tensors(checkpoint_dir)
    out.mkdir(parents=True, exist_ok=True)
    for file in artifact.iterdir():
        if file.name not in (WEIGHTS, ONNX_DATA):
            shutil.copy(file, out / file.name)
    raw = (artifact / WEIGHTS).read_bytes()
    header_bytes = 8 + int.from_bytes(raw[:8], "little")
    (out / HEADER).write_bytes(raw[:header_bytes])
    recipe, extras = {}, {}
    with safe_open(str(artifact / WEIGHTS), "pt") as weights:
        for name in weights.keys():
            tensor = weights.get_tensor(name)
            parts = parts_of(name, checkpoint)
            if parts is not None and torch.equal(assemble(parts, checkpoint, tensor.dtype), tensor):
                recipe[name] = parts
            else:
                extras[name] = tensor.contiguous()
    (out / RECIPE).write_text(json.dumps(recipe, indent=1))
    save_file(extras, str(out / EXTRAS))
    print(
        f"stripped {artifact} -> {out}: {len(recipe)} parameters by recipe, {len(extras)} carried "
        f"({(out / EXTRAS).stat().st_size / 1e6:.1f} MB)"
    )


def parameters(stripped: Path, checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = checkpoint_tensors(checkpoint_dir)
    header = json.loads((stripped / HEADER).read_bytes()[8:])
    params = load_file(str(stripped / EXTRAS))
    for name, parts in json.loads((stripped / RECIPE).read_text()).items():
        params[name] = assemble(parts, checkpoint, SAFETENSORS_DTYPES[header[name]["dtype"]])
    return params


def write_weights(stripped: Path, params: dict[str, torch.Tensor], out: Path) -> None:
    head = (stripped / HEADER).read_bytes()
    header = json.loads(head[8:])
    with open(out, "wb") as file:
        file.write(head)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            file.seek(len(head) + entry["data_offsets"][0])
            raw = params[name].contiguous().reshape(-1).view(torch.uint8)  # as bytes: bf16 has no numpy dtype
            file.write(raw.numpy().tobytes())


def write_onnx_data(stripped: Path, params: dict[str, torch.Tensor], out: Path) -> None:
    """Each external initializer is `param`, `param.T` or `param[a:b].T` (the lowering's names)."""
    import onnx

    model = onnx.load(str(stripped / "model.onnx"), load_external_data=False)
    with open(out, "wb") as file:
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            match = re.fullmatch(r"(.*?)(?:\[(\d+):(\d+)\])?(\.T)?", tensor.name)
            if match[1] not in params:
                raise KeyError(f"{tensor.name}: no parameter {match[1]} to rebuild it from")
            value = params[match[1]]
            if match[2] is not None:
                value = value[int(match[2]) : int(match[3])]
            if match[4]:
                value = value.t()
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            where = {e.key: e.value for e in tensor.external_data}
            data = np.ascontiguousarray(value.numpy()).astype(dtype, copy=False).tobytes()
            if len(data) != int(where["length"]):
                raise ValueError(f"{tensor.name}: rebuilt {len(data)} bytes, the model records {where['length']}")
            file.seek(int(where["offset"]))
            file.write(data)


def rebuild(stripped: Path, checkpoint_dir: Path) -> None:
    from kiln.runtime.artifact import file_sha256

    params = parameters(stripped, checkpoint_dir)
    manifest = json.loads((stripped / "manifest.json").read_text())["files"]
    write_weights(stripped, params, stripped / WEIGHTS)
    if ONNX_DATA in manifest:
        write_onnx_data(stripped, params, stripped / ONNX_DATA)
    for name in (WEIGHTS, ONNX_DATA):
        if name in manifest and file_sha256(stripped / name) != manifest[name]["sha256"]:
            raise SystemExit(
                f"{stripped / name}: rebuilt, but its sha256 differs from the manifest's "
                f"(the checkpoint at {checkpoint_dir} is not the one compiled)"
            )
    print(f"rebuilt {stripped}: {', '.join(n for n in (WEIGHTS, ONNX_DATA) if n in manifest)} match the manifest")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["strip", "rebuild"])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--checkpoint", type=Path, required=True, help="the Hugging Face directory compiled")
    args = parser.parse_args(argv)
    if args.action == "strip":
        strip(args.artifact, args.out, args.checkpoint)
    else:
        rebuild(args.artifact, args.checkpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
