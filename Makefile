# One entry point for people and CI. `make example` and `make test` work on a
# fresh machine with nothing but python3 (3.11+): they build .venv from the
# hashed lock file first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: example test lint typecheck check bench clean

$(STAMP): requirements-dev.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --require-hashes -r requirements-dev.lock
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

example: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/example.sh

# Three workers (pytest-xdist) on two cores: the suite's tests are independent,
# and most of their time is waiting on daemons, subprocesses and loopback
# servers (-n 2: 6:33 and 60 % of both cores busy; -n 3: 4:56, all green).
test: $(STAMP)
	$(BIN)/pytest -n 3

lint: $(STAMP)
	$(BIN)/ruff check .

# mypy cannot follow setuptools' editable import hook (checkout root ->
# skilltrain), so it checks a symlink view named like the package instead.
typecheck: $(STAMP)
	rm -rf build/typecheck && mkdir -p build/typecheck/skilltrain
	ln -s $(CURDIR)/__init__.py $(CURDIR)/__main__.py $(CURDIR)/py.typed \
		$(CURDIR)/daemon $(CURDIR)/handlers build/typecheck/skilltrain/
	cd build/typecheck && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p skilltrain

check: lint typecheck test

bench: $(STAMP)
	$(BIN)/python bench/leakguard_bench.py
	$(BIN)/python bench/claims_bench.py

clean:
	rm -rf $(VENV) build
