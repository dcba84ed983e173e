# The README's two commands: `make demo` (set up, then run the actor-learner demo) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint demo stress bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[test,bench,lint]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .

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
	rm -rf build *.egg-info .pytest_cache .hypothesis bench-out
