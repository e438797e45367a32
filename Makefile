VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# test processes: as many as cores and memory allow (tests/conftest.py); -n 0 for one
PYTEST_PARALLEL ?= -n auto --dist worksteal

.PHONY: setup run test lint proto clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt scripts/setup.sh
	VENV=$(VENV) scripts/setup.sh

run: setup
	$(VENV)/bin/pdserve up

test: setup
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

proto: setup
	$(PY) -m scripts.gen_proto

clean:
	rm -rf $(VENV) .pytest_cache
