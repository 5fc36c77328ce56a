"""Batch invariance on Inductor with quantized weights and an int8 KV cache: a row's logits in a
decode step over several rows equal, bit for bit, its logits in a step over it alone, and the
engine's greedy tokens for each request in a batch equal those of the request run alone.

The kernels' own tests check each op row by row, int8 and int4 weights alike (test_int4_panels.py,
test_int8_kernel.py, test_kv_cache_int8.py); here the whole compiled step of a tiny Llama.
"""

from __future__ import annotations

import random

import pytest
import torch

from kiln.backends.executable import BackendOptions
from kiln.frontend.checkpoint import load_model

ROWS, MAX_SEQ_LEN = 4, 64


def compiled(model_dir, options: BackendOptions):
    from kiln.backends.inductor import lower
    from kiln.frontend.capture import capture_causal_lm
    from kiln.passes.pipeline import run_pipeline

    graph = capture_causal_lm(load_model(model_dir).model, options.max_batch, options.max_seq_len)
    return lower(run_pipeline(graph, options), options)


@pytest.mark.slow
def test_a_row_decodes_alike_alone_and_among_others(tiny_model_dirs):
    """int4-g32 weights (the lm_head and embedding too) and an int8 KV cache: the one-row and
    many-row int4 kernels and attention's few-queries kernel. Only one-token steps run (prompts fed
    a token at a step), so only the decode graphs compile (~20 s)."""
    from kiln.backends.inductor.quantized_linear import int4_kernel_available
    from kiln.runtime.generate import LLM

    if not int4_kernel_available():
        pytest.skip("Kiln's int4 kernel does not run here")
    options = BackendOptions(ROWS, MAX_SEQ_LEN, quantize="int4-g32", quantize_embeddings=True, kv_cache="int8")
    executable = compiled(tiny_model_dirs("llama"), options)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 9))] for _ in range(ROWS)]

    # one decode step at each row's next position: every row alone, then all rows in one call
    executable.reset()
    for row, prompt in enumerate(prompts):
        for position, token in enumerate(prompt):
            executable.run(torch.tensor([[token]]), torch.tensor([[position]]), first_row=row)
    tokens = torch.tensor([[7 + row] for row in range(ROWS)])
    positions = torch.tensor([[len(p)] for p in prompts])
    alone = [executable.run(tokens[row : row + 1], positions[row : row + 1], first_row=row) for row in range(ROWS)]
    together = executable.run(tokens, positions)
    for row in range(ROWS):
        assert torch.equal(together[row], alone[row][0]), row

    # the engine: one-token prompts are fed by the decode calls, which span 1..4 rows
    llm = LLM(executable)
    starts = [[p[0]] for p in prompts]
    batched = llm.generate(starts, max_new_tokens=16)
    assert [r.token_ids for r in batched] == [llm.generate(p, max_new_tokens=16).token_ids for p in starts]
    assert len({tuple(r.token_ids) for r in batched}) == ROWS
