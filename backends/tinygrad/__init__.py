"""The tinygrad backend (being built): IR -> tinygrad tensors under TinyJit."""
