# Two entry points, each doing its own set-up on a fresh machine:
#   make quickstart   run the quickstart notebook on a local cluster (no cloud account)
#   make test         run the test suite (installs what it needs: packages, the compatibility matrix's JAX
#                     clients and jax 0.12 server on Python 3.12, Chromium, Slurm)
# What pip cannot install (Python 3.12, Chromium and Slurm from apt as root) is made where it can be; where it cannot, make says
# in one line what to install and the tests that need it skip, saying the same. REQUIRE_ALL=1 (CI's .ci/run) makes a
# missing part an error instead.

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
HAVE_PY312 := $(shell $(PYTHON312) -c 'import sys; print(sys.version_info[:2] == (3, 12))' 2>/dev/null)
PY312_PART := $(if $(filter True,$(HAVE_PY312)),$(PY312_VENV)/bin/pathways-nb,no-python312)
REQUIRE_ALL ?=
# $(call unavailable,MESSAGE): says what is missing and what to install; an error only under REQUIRE_ALL.
unavailable = { echo "make: $(1)$(if $(REQUIRE_ALL), (an error: REQUIRE_ALL is set))" >&2; test -z "$(REQUIRE_ALL)"; }
# Installs Debian packages where that is possible (root and apt-get); fails otherwise.
apt_install = test "$$(id -u)" = 0 && command -v apt-get >/dev/null && apt-get update -qq && \
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1)

.PHONY: quickstart test lint docs install chromium iproute2 slurm clean compat-venvs no-python312

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

no-python312:
	@$(call unavailable,no Python 3.12 at PYTHON312=$(PYTHON312): the jax 0.12 parts of tests/test_compat.py will skip; \
install python3.12 or pass PYTHON312=/path/to/python3.12)

compat-venvs: $(OLD_CLIENT_VENV)/bin/python $(JAX09_CLIENT_VENV)/bin/python $(PY312_PART)

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
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || ($(call apt_install,chromium)) || \
		$(call unavailable,no Chromium: tests/test_browser.py will skip; install it (as root: apt-get install chromium))

# tests/test_netns.py puts hosts in network namespaces with `ip` (iproute2), which slim Debian images lack;
# without it (or without root) that test skips and says why, so a failed install does not stop the suite.
iproute2:
	@command -v ip >/dev/null || ($(call apt_install,iproute2)) || \
		echo "make: no iproute2: tests/test_netns.py will skip; install it (as root: apt-get install iproute2)" >&2

# tests/test_slurm.py runs a real Slurm (Debian's slurmctld, slurmd and munge, 22.05) with three emulated nodes on
# this machine, started and stopped by the tests themselves (pathways_nb/testing/slurm.py); no daemon is left running.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
slurm:
	@(command -v slurmctld && command -v slurmd && command -v srun && command -v munged) >/dev/null || \
		($(call apt_install,--no-install-recommends $(SLURM_PACKAGES))) || \
		$(call unavailable,no Slurm: tests/test_slurm.py will skip; install it (as root: apt-get install \
--no-install-recommends $(SLURM_PACKAGES)))

test: install chromium iproute2 slurm compat-venvs
	PATHWAYS_OLD_CLIENT_PYTHON=$(abspath $(OLD_CLIENT_VENV))/bin/python \
	PATHWAYS_JAX09_PYTHON=$(abspath $(JAX09_CLIENT_VENV))/bin/python \
	PATHWAYS_PY312_PYTHON=$(if $(filter True,$(HAVE_PY312)),$(abspath $(PY312_VENV))/bin/python) \
	$(BIN)/python -m pytest -q --durations=25

clean:
	rm -rf $(VENV) $(OLD_CLIENT_VENV) $(JAX09_CLIENT_VENV) $(PY312_VENV) *.egg-info
