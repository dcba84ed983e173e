# The README's two commands: `make demo` (set up, then run the actor-learner demo) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install install-ray test test-ray lint demo demo-ray stress bench bench-ray clean conformance

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard shmbuf/*.c shmbuf/sampling/*.c workers/*.c)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[test,bench,lint]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

# The Ray cluster (workers.cluster): the ray extra, its tests, its demo and its benchmark.
install-ray: install
	$(BIN)/python -m pip install -q -e '.[ray]'

test-ray: install-ray
	$(BIN)/python -m pytest -q -m ray

demo-ray: install-ray
	$(BIN)/shmbuf demo --ray-nodes 3

bench-ray: install-ray
	$(BIN)/python scripts/bench_cluster.py

# SB3's own buffer and off-policy algorithm tests, run with SB3's replay buffers and with
# shmbuf's (tests/conformance/sb3_suite.py; downloads SB3's sdist into build/conformance).
conformance: install
	$(BIN)/python -m pip install -q -e '.[sb3]'
	$(BIN)/python -m tests.conformance.sb3_suite

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy shmbuf workers

demo: install
	$(BIN)/shmbuf demo

stress: install
	$(BIN)/python scripts/stress.py

bench: install
	$(BIN)/python scripts/bench_storage.py
	$(BIN)/python scripts/bench_pool.py
	$(BIN)/python scripts/bench_sequences.py
	$(BIN)/python scripts/bench_prioritized.py
	$(BIN)/python scripts/bench_per.py
	$(BIN)/python scripts/bench_gpu.py

clean:
	-test -x $(BIN)/shmbuf && $(BIN)/shmbuf gc
	rm -rf build *.egg-info .pytest_cache .hypothesis bench-out shmbuf/*.so shmbuf/sampling/*.so
