"""Kiln's frontend: a local checkpoint captured into Kiln's IR.

checkpoint.py and default_model.py find and load the model; capture.py exports its stateless
forward and fx_to_ir.py converts it through the ATen table (aten_table.py). Graph-break analysis
and its reports live in the `breaks` subpackage; their former module paths
(`kiln.frontend.break_analysis`, ...) still import, as the same module objects.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {  # former module -> where it lives now
    "background_break_check": "breaks.background_check",
    "branch_to_select": "breaks.branch_to_select",
    "break_analysis": "breaks.analysis",
    "break_categories": "breaks.categories",
    "break_cost": "breaks.cost",
    "break_remedies": "breaks.remedies",
    "compile_breaks": "breaks.compile_check",
    "explain_targets": "breaks.targets",
    "graph_breaks": "breaks.recording",
    "guard_failures": "breaks.guard_failures",
    "report_html": "breaks.report_html",
    "report_markdown": "breaks.report_markdown",
    "report_model": "breaks.report_model",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `kiln.frontend.<former>` as the module it moved to (one module object, two names)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import machinery puts the alias's spec on the module next
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


sys.meta_path.append(_MovedModules())
