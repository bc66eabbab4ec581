# Two commands for a new user: `make demo` (the whole story on the embedded target) and `make test`.
# Both create .venv themselves. Where there is no NVIDIA GPU, torch is the CPU build.
VENV    ?= .venv
PYTHON  ?= python3
BIN     := $(VENV)/bin
RUNS    ?= runs
# Where no local CPU wheel is available, the CPU build comes from PyTorch's own index.
TORCH_CPU_VERSION ?= 2.13.0
TORCH_CPU_INDEX   ?= https://download.pytorch.org/whl/cpu

.PHONY: setup demo test bench clean-runs

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: installing the default (CUDA) torch build"; \
		$(BIN)/python -m pip install -q torch; \
	else \
		echo "no NVIDIA GPU: installing the CPU build of torch $(TORCH_CPU_VERSION)"; \
		$(BIN)/python -m pip install -q --no-index torch==$(TORCH_CPU_VERSION) 2>/dev/null \
		|| $(BIN)/python -m pip install -q torch==$(TORCH_CPU_VERSION) --index-url $(TORCH_CPU_INDEX); \
	fi
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $@

# Builds the embedded target, trains the seed's history (v3, v5, v6, fixed), diagnoses v5 and prints the
# report's summary. Completed runs are kept; a killed demo resumes where it stopped.
demo: setup
	@RUNS=$(RUNS) BIN=$(BIN) bash examples/demo.sh

test: setup
	$(BIN)/python -m pytest -q -n 2

bench: setup
	$(BIN)/python bench/train_step.py

clean-runs:
	rm -rf $(RUNS)
