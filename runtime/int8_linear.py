"""`Int8Linear`: a linear layer with int8 weights for the draft heads' matrix-vector products.

A draft reads its weights once per stage for one row (or a few tree rows), so its time is the
bytes it reads: int8 weights are a quarter of fp32's. The product is fbgemm's dynamic quantized
linear (torch.ops.quantized.linear_dynamic, AVX2 and wider): weights quantized per output row,
symmetric; each input row quantized on the fly to 8 bits. On SmolLM2's 8192-row draft readout it
takes about a third of the fp32 product's time on one thread, and its logits stay within about 1%
of fp32's (bench/results/draft_readout.md measures what that costs in acceptance).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        weight = weight.detach().float()
        scale = (weight.abs().amax(dim=1).clamp_min(1e-12) / 127).double()
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; the kernel is current
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_channel(weight, scale, zeros, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.detach().float())
        self.out_features = weight.shape[0]

    @classmethod
    def of(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        # reduce_range False: the full 8 bits for the input rows (1% error against 2% with 7 bits)
        out = torch.ops.quantized.linear_dynamic(rows, self.packed, False)
        return out.reshape(*x.shape[:-1], self.out_features)
