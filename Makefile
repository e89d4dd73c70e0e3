# Two entry points, each doing its own set-up on a fresh machine:
#   make quickstart   run the quickstart notebook on a local cluster (no cloud account)
#   make test         run the test suite (installs what it needs: packages, the compatibility matrix's JAX
#                     clients and jax 0.12 server on Python 3.12, Chromium)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
OLD_CLIENT_VENV := .venv-jax072
OLD_CLIENT_JAX := 0.7.2
# The compatibility matrix (tests/test_compat.py, docs/compatibility.md): a jax 0.9 client, and
# jax 0.12 on Python 3.12 as both a client and the newest server (pathways-nb installed from here).
JAX09_CLIENT_VENV := .venv-jax09
JAX09_CLIENT_JAX := 0.9.2
PY312_VENV := .venv-py312
PY312_JAX := 0.12.0.1
PYTHON312 ?= $(firstword $(wildcard /root/.pyenv/versions/3.12.1/bin/python) python3.12)

.PHONY: quickstart test lint docs install chromium iproute2 clean compat-venvs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test]"

$(OLD_CLIENT_VENV)/bin/python:
	$(PYTHON) -m venv $(OLD_CLIENT_VENV)
	$(OLD_CLIENT_VENV)/bin/python -m pip install --quiet "jax==$(OLD_CLIENT_JAX)" "jaxlib==$(OLD_CLIENT_JAX)"

$(JAX09_CLIENT_VENV)/bin/python:
	$(PYTHON) -m venv $(JAX09_CLIENT_VENV)
	$(JAX09_CLIENT_VENV)/bin/python -m pip install --quiet "jax==$(JAX09_CLIENT_JAX)" "jaxlib==$(JAX09_CLIENT_JAX)"

# Rebuilt when pyproject.toml changes (its dependencies are installed there too).
$(PY312_VENV)/bin/pathways-nb: pyproject.toml
	$(PYTHON312) -m venv $(PY312_VENV)
	$(PY312_VENV)/bin/python -m pip install --quiet -e . pytest pytest-timeout "jax==$(PY312_JAX)" "jaxlib==$(PY312_JAX)"

compat-venvs: $(OLD_CLIENT_VENV)/bin/python $(JAX09_CLIENT_VENV)/bin/python $(PY312_VENV)/bin/pathways-nb

quickstart: install
	$(BIN)/python -m pathways_nb.notebook.quickstart

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

# tests/test_netns.py puts hosts in network namespaces with `ip` (iproute2), which slim Debian images lack;
# without it (or without root) that test skips and says why, so a failed install does not stop the suite.
iproute2:
	command -v ip >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2) \
		|| echo "could not install iproute2: tests/test_netns.py will skip"

test: install chromium iproute2 compat-venvs
	PATHWAYS_OLD_CLIENT_PYTHON=$(abspath $(OLD_CLIENT_VENV))/bin/python \
	PATHWAYS_JAX09_PYTHON=$(abspath $(JAX09_CLIENT_VENV))/bin/python \
	PATHWAYS_PY312_PYTHON=$(abspath $(PY312_VENV))/bin/python \
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(OLD_CLIENT_VENV) $(JAX09_CLIENT_VENV) $(PY312_VENV) *.egg-info
