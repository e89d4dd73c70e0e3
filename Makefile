# Two entry points, each doing its own set-up on a fresh machine:
#   make quickstart   start a local Pathways server and run the quickstart against it
#   make test         run the test suite (installs what it needs, including an older JAX client)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
OLD_CLIENT_VENV := .venv-jax072
OLD_CLIENT_JAX := 0.7.2

.PHONY: quickstart test lint install clean

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

test: install $(OLD_CLIENT_VENV)/bin/python
	PATHWAYS_OLD_CLIENT_PYTHON=$(abspath $(OLD_CLIENT_VENV))/bin/python $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(OLD_CLIENT_VENV) *.egg-info
