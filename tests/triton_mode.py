"""Imported by conftest.py before anything loads Triton (Inductor's config imports it where it is
installed): on a machine without a GPU, Triton's kernels then run in its interpreter, on CPU
tensors (tests/test_cuda_decode_attention.py). Triton reads TRITON_INTERPRET when it loads."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
