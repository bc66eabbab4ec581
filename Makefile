# Two commands for a new user: `make demo` (the whole story on the embedded target) and `make test`.
# Both create .venv themselves; tools/install_torch.sh picks the CPU build of torch where there is no
# NVIDIA GPU and the default CUDA build where there is one.
VENV      ?= .venv
SPEC_VENV ?= .venv-speculators
PYTHON    ?= python3
BIN       := $(VENV)/bin
RUNS      ?= runs

LOCK      := requirements/lock.txt

.PHONY: setup demo test test-latest lock docs parity parity-catalog bench clean-runs

setup: $(VENV)/.installed

# The locked set: every package at the version in requirements/lock.txt (the one the suite passed on), torch's
# build chosen by tools/install_torch.sh at the lock's torch version. The lock is a constraints file, so a CUDA
# machine's extra packages (nvidia-*) follow torch's own requirements.
$(VENV)/.installed: pyproject.toml $(LOCK) tools/install_torch.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	tools/install_torch.sh $(BIN)/python
	$(BIN)/python -m pip install -q -c $(LOCK) -e '.[test]'
	@touch $@

# Upstream drift, seen by us first: a fresh venv with the newest release of every dependency (not the lock, not
# pyproject's caps), then the suite; prints which packages moved against the lock and what broke. Not part of CI.
# TEST_LATEST_ARGS='-- -k recurrent' runs a subset; TEST_LATEST_ARGS='--torch latest' takes the newest torch too.
test-latest:
	$(PYTHON) tools/test_latest.py --venv .venv-latest $(TEST_LATEST_ARGS)

# Refresh the lock from pyproject.toml after `make test-latest` passed (README, Development).
lock: setup
	$(BIN)/python -m pip install -q uv
	$(BIN)/python tools/lock.py

# Builds the embedded target, trains the seed's history (v3, v5, v6, fixed), diagnoses v5 and prints the
# report's summary. Completed runs are kept; a killed demo resumes where it stopped.
demo: setup
	@RUNS=$(RUNS) BIN=$(BIN) bash examples/demo.sh

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

# The documentation site: checks that the generated reference pages are current (tools/gen_docs.py), then
# `mkdocs build --strict` into site/ (a broken link or anchor, or a page missing from the nav, fails).
# The docs extra is installed into the venv once.
docs: $(VENV)/.docs-installed
	$(BIN)/python tools/gen_docs.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict -d site

$(VENV)/.docs-installed: $(VENV)/.installed pyproject.toml
	$(BIN)/python -m pip install -q -c $(LOCK) -e '.[docs]'
	@touch $@

$(SPEC_VENV)/.installed: bench/setup_speculators_env.sh tools/install_torch.sh
	SPECULATORS_VENV=$(SPEC_VENV) bash bench/setup_speculators_env.sh

# Parity with speculators 0.9.0 in its own environment (it pins transformers <= 5.19); never skipped here.
# Two workers (each at one torch thread, tests/conftest.py): serially it took ~10 min. Whole files per worker
# (loadfile): a parity module's expensive module fixture then runs once; with worksteal a stolen or interleaved
# test set up test_speculators_hidden_states' fixture three times.
parity: $(SPEC_VENV)/.installed
	SPECULATORS_PARITY_REQUIRED=1 PYTHONPATH=$(CURDIR) $(SPEC_VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not catalog" tests/parity

# The long probe benchmarks (pytest marker `catalog`): the probes catalog (bench/upstream_defects/
# defects_probes.yaml) against its measured bar, ~8 min on 2 cores, and the probe mutation suites on
# speculators and SpecForge, ~2 min each; not part of `parity`, so CI stays well under 15 minutes.
parity-catalog: $(SPEC_VENV)/.installed
	SPECULATORS_PARITY_REQUIRED=1 PYTHONPATH=$(CURDIR) $(SPEC_VENV)/bin/python -m pytest -q -p no:cacheprovider -m catalog tests/parity

# A training step against speculators in one process (CPU), at the sizes' own vocabularies and at Qwen3.5's
# 248320; docs/benchmarks.md has every number and command.
bench: $(SPEC_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(SPEC_VENV)/bin/python bench/train_step.py --sizes tiny,small,medium --repeats 11 --warmup 2 --threads 1
	PYTHONPATH=$(CURDIR) $(SPEC_VENV)/bin/python bench/train_step.py --sizes tiny,small,medium --vocab 248320 --repeats 5 --warmup 1 --threads 1

clean-runs:
	rm -rf $(RUNS)
