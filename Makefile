# One target per habit. `make demo` and `make test` are the two set-up commands of the README.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench lint format clean

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

bench: $(STAMP)
	$(PY) -m pytest -q -m bench -s tests/bench

lint: $(STAMP)
	$(VENV)/bin/ruff check server client tests
	$(VENV)/bin/ruff format --check server client tests
	$(VENV)/bin/mypy server/odbd client/odbclient

format: $(STAMP)
	$(VENV)/bin/ruff format server client tests
	$(VENV)/bin/ruff check --fix server client tests

clean:
	rm -rf $(VENV) build *.egg-info
