# Two entry points, each doing its own set-up on a fresh machine:
#   make quickstart   run the quickstart notebook on a local cluster (no cloud account)
#   make test         run the test suite (installs what it needs: packages, an older JAX client, Chromium)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
OLD_CLIENT_VENV := .venv-jax072
OLD_CLIENT_JAX := 0.7.2

.PHONY: quickstart test lint docs install chromium clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test]"

$(OLD_CLIENT_VENV)/bin/python:
	$(PYTHON) -m venv $(OLD_CLIENT_VENV)
	$(OLD_CLIENT_VENV)/bin/python -m pip install --quiet "jax==$(OLD_CLIENT_JAX)" "jaxlib==$(OLD_CLIENT_JAX)"

quickstart: install
	$(BIN)/python -m pathways_nb.quickstart

lint: install
	$(BIN)/ruff check pathways_nb tests benchmarks
	$(BIN)/ruff format --check pathways_nb tests benchmarks

# The docs site (mkdocs, Material theme, API reference from docstrings) into build/site; warnings fail it.
docs: install
	$(BIN)/python -m pip install --quiet -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The browser tests drive Debian's Chromium (Playwright's own browser download is not used).
chromium:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

test: install chromium $(OLD_CLIENT_VENV)/bin/python
	PATHWAYS_OLD_CLIENT_PYTHON=$(abspath $(OLD_CLIENT_VENV))/bin/python $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(OLD_CLIENT_VENV) *.egg-info
