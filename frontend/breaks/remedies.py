"""The graph breaks Kiln removes by itself, and how.

- `stateless_capture`: a Python KV-cache object (HF `DynamicCache`, a custom cache class) is
  not passed at all: Kiln captures the forward with `use_cache=False` and its `insert_kv_cache`
  pass adds static KV buffers to the graph.
- `symbolic_scalars`: `.item()` and friends are captured as symbols (`capture_scalar_outputs`).
- `symbolic_shapes`: data-dependent output sizes (`nonzero`, `x[mask]`) are captured as symbols
  (`capture_dynamic_output_shape_ops`).
- `reorder_logging`: `warnings.warn` runs after the graph instead of splitting it; `print` and
  logger calls (`logger.info`, ...) are dropped from the compiled graph.
- `branch_to_select`: a tensor-dependent `if` with pure arms becomes a select over both arms
  (`branch_to_select.py`).
The first four are Dynamo settings (`dynamo_config`); the last rewrites module methods.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from .branch_to_select import BranchRewrite, rewrite_branch
from .recording import SourceFrame


@dataclass(frozen=True)
class Remedy:
    name: str
    how: str  # what Kiln does, in one sentence, for the report


REMEDIES = {
    r.name: r
    for r in [
        Remedy(
            "stateless_capture",
            "Kiln captures the forward without a cache object (`use_cache=False`); the "
            "`insert_kv_cache` pass adds static KV buffers to the graph instead.",
        ),
        Remedy(
            "symbolic_scalars",
            "captured as a symbolic scalar (`capture_scalar_outputs`): the value stays in the graph.",
        ),
        Remedy(
            "symbolic_shapes", "the data-dependent size is captured as a symbol (`capture_dynamic_output_shape_ops`)."
        ),
        Remedy(
            "reorder_logging",
            "`warnings.warn` is moved after the graph; `print` and logger calls are dropped "
            "from the compiled graph, so they no longer split it.",
        ),
        Remedy(
            "branch_to_select",
            "the `if` was rewritten to compute both pure arms and select with `torch.where` "
            "(the IR's `where`): no branch is left in the graph.",
        ),
    ]
}

LOGGER_METHODS = [
    logging.Logger.debug,
    logging.Logger.info,
    logging.Logger.warning,
    logging.Logger.error,
    logging.Logger.critical,
    logging.Logger.exception,
    logging.Logger.log,
]


def dynamo_config(remedies: set[str]) -> dict:
    """The `torch._dynamo.config` patch that applies the Dynamo-setting remedies among `remedies`."""
    config: dict = {}
    if "symbolic_scalars" in remedies:
        config["capture_scalar_outputs"] = True
    if "symbolic_shapes" in remedies:
        config["capture_dynamic_output_shape_ops"] = True
        config["capture_scalar_outputs"] = True  # sizes of dynamic outputs are unbacked scalars too
    if "reorder_logging" in remedies:
        config["reorderable_logging_functions"] = {warnings.warn}
        # print takes shapes and other objects that Dynamo cannot reorder: a compiled model drops it
        config["ignore_logging_functions"] = {print, *LOGGER_METHODS}
    return config


def rewrite_branches(module: torch.nn.Module, locations: list[SourceFrame]) -> dict[SourceFrame, BranchRewrite]:
    """Rewrite each tensor-dependent `if` at `locations` that Kiln can turn into a select."""
    rewrites = {}
    for where in dict.fromkeys(locations):
        rewrite = rewrite_branch(module, where)
        if rewrite is not None:
            rewrites[where] = rewrite
    return rewrites
