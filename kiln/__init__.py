"""Kiln: a compiler-first runtime for large language models."""
