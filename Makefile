# One target per habit. `make demo` and `make test` are the two set-up commands of the README.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH := $(PY) -m pytest -q -m bench -s

.PHONY: venv demo test test-under-load test-fast test-netns bench bench-migration bench-planner bench-round bench-scale bench-shm bench-datapath \
	bench-metrics bench-training bench-cost-model soak lint format proto proto-check clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/odbd demo

test: $(STAMP)
	$(PY) -m pytest -q

test-under-load: $(STAMP)  # `make test` with a CPU hog per core (HOGS=N), timed (issue 11)
	$(PY) tests/under_load.py $(if $(HOGS),--hogs $(HOGS)) -- $(PY) -m pytest -q

test-fast: $(STAMP)  # unit tests only (seconds)
	$(PY) -m pytest -q tests/unit

test-netns: $(STAMP)  # daemons in network namespaces behind a fault proxy (root; issue 25)
	$(PY) -m pytest -q -m netns tests/integration/test_netns_faults.py

bench: $(STAMP)  # every benchmark; results land in docs/bench/
	$(BENCH) tests/bench

bench-migration: $(STAMP)  # --migrate auto vs the offline oracles (W=1024 alone ~40 min: ODBD_BENCH_ORACLE_WORLDS=16,128 for a quick run); docs/bench/migration.md
	$(BENCH) tests/bench/test_bench_migration.py

bench-planner: $(STAMP)
	$(BENCH) tests/bench/test_bench_planner.py tests/bench/test_bench_packed.py

bench-round: $(STAMP)
	$(BENCH) tests/bench/test_bench_round.py

bench-scale: $(STAMP)  # live daemons at 2, 8, 32 nodes (ODBD_BENCH_SCALE_NODES) vs Gloo; docs/bench/scale.md
	$(BENCH) tests/bench/test_bench_scale.py

bench-shm: $(STAMP)
	$(BENCH) tests/bench/test_bench_shm.py

bench-datapath: $(STAMP)
	$(BENCH) tests/bench/test_bench_datapath.py

bench-metrics: $(STAMP)
	$(BENCH) tests/bench/test_bench_metrics.py

bench-training: $(STAMP)
	$(BENCH) tests/bench/test_bench_training.py

bench-cost-model: $(STAMP)  # --cost-model fixed vs auto on DDP with a quadratic step cost
	$(BENCH) tests/bench/test_bench_cost_model.py

soak: $(STAMP)  # long fault and load runs (marker `soak`)
	$(PY) -m pytest -q -m soak -s tests

lint: $(STAMP)
	$(VENV)/bin/ruff check server client tests proto
	$(VENV)/bin/ruff format --check server client tests proto
	$(VENV)/bin/mypy server/odbd client/odbclient

format: $(STAMP)
	$(VENV)/bin/ruff format server client tests proto
	$(VENV)/bin/ruff check --fix server client tests proto

proto: $(STAMP)
	$(PY) proto/gen.py

proto-check: $(STAMP)
	$(PY) proto/gen.py --check

clean:
	rm -rf $(VENV) build *.egg-info
