"""Graph breaks: what Dynamo meets in a model, explained, and what Kiln removes.

- recording.py runs a callable under Dynamo and records its breaks, fragments and recompiles;
- categories.py, guard_failures.py say what each means and how to fix it; cost.py measures
  what each costs; remedies.py (with branch_to_select.py) removes the ones Kiln can;
- analysis.py puts these together into a report section (report_model.py), rendered by
  report_markdown.py and report_html.py (and JSON: docs/report-schema.md);
- targets.py says what `compile-model explain TARGET` captures; compile_check.py is the check
  every compile runs (GraphBreakError), background_check.py runs it in a child process.

Capture itself (frontend/capture.py) does not depend on any of this.
"""
