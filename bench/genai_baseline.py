"""The onnxruntime-genai baseline: its model builder's ONNX model of the same checkpoint, run by
its own generator loop (the `bench` extra: pip install 'kiln[bench]').

The builder reads the local Hugging Face directory (never a hub) and writes model.onnx,
model.onnx.data and genai_config.json; `precision` is the builder's `-p` (fp32, int4) for
`-e cpu`. It does not support GPT-2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def build_genai_model(model_dir: Path, out_dir: Path, precision: str = "fp32") -> Path:
    """Run the genai model builder once; later calls reuse `out_dir`."""
    if (out_dir / "genai_config.json").is_file():
        return out_dir
    command = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(model_dir),
        "-o",
        str(out_dir),
        "-p",
        precision,
        "-e",
        "cpu",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the onnxruntime-genai builder failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
    return out_dir


class GenaiRunner:
    """prefill(n) / generate(n) callables over an onnxruntime-genai model, like bench.py's runners."""

    def __init__(self, genai_dir: Path, threads: int, precision: str):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(genai_dir))
        config.overlay(
            json.dumps(
                {
                    "model": {
                        "decoder": {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}
                    }
                }
            )
        )
        self.model = og.Model(config)
        self.name = f"ort-genai-{precision}"
        # what a decode step reads: the model's weights (the external-data file(s), or the model itself)
        self.weight_bytes = sum(f.stat().st_size for f in Path(genai_dir).iterdir() if f.suffix in (".onnx", ".data"))

    def _generator(self, prompt: list[int], new_tokens: int):
        import numpy as np

        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.array(prompt, dtype=np.int32))  # runs the prompt (prefill)
        return generator

    def prefill(self, n: int):
        prompt = list(range(100, 100 + n))
        return lambda: self._generator(prompt, 1)

    def generate(self, n: int):
        """Decode n tokens into text, as its users stream it (Kiln's tg rows detokenize too)."""
        tokenizer = self.og.Tokenizer(self.model)

        def run():
            generator = self._generator([1], n)
            stream = tokenizer.create_stream()
            text = []
            while not generator.is_done():
                generator.generate_next_token()
                text.append(stream.decode(generator.get_next_tokens()[0]))
            return "".join(text)

        return run
