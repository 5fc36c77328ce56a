"""Kiln's passes: the pass manager, the default pipeline, and one pass per file."""

from .canonicalize import canonicalize
from .constant_fold import fold_constants
from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .manager import Pass, PassError, PassManager, PassRecord
from .pipeline import default_pipeline, kv_cache_insertion, run_pipeline

__all__ = [
    "Pass",
    "PassError",
    "PassManager",
    "PassRecord",
    "canonicalize",
    "default_pipeline",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "fold_constants",
    "kv_cache_insertion",
    "run_pipeline",
]
