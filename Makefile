# The two commands a newcomer needs: `make up` and `make test`. Both install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Every gateway, dispatcher and CLI a run starts compiles the project's modules again when
# an environment forbids byte-code caches (PYTHONDONTWRITEBYTECODE): a tenth of each start.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install services migrate up test lint chaos bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { \
	  echo "python3-venv missing: installing"; bash scripts/ensure-services.sh apt python3-venv; $(PYTHON) -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

services:
	@bash scripts/ensure-services.sh

migrate: install services
	$(BIN)/conveyor db upgrade

## Runs the whole platform locally: gateway, dispatcher, sleeper function. Ctrl-C stops it.
up: install services
	$(BIN)/python -m scripts.up

## The test suite: unit, integration (real PostgreSQL + RabbitMQ) and end-to-end (real processes),
## three test files at a time: most of a test's time waits on processes, brokers and deadlines,
## so three keep two cores busy (four were 2 minutes faster, and twice as many tests met a
## machine too loaded for their deadlines; pytest-xdist; PYTEST_ARGS='-n 0' runs one at a time).
test: install services
	@command -v node >/dev/null || bash scripts/ensure-services.sh apt nodejs || true
	@command -v chromium >/dev/null || bash scripts/ensure-services.sh apt chromium
	@command -v pgbouncer >/dev/null || test -x /usr/sbin/pgbouncer || bash scripts/ensure-services.sh apt pgbouncer
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 3 --dist loadfile --durations=25 $(PYTEST_ARGS)

## ruff, the type checker and the import rules (gateway and dispatcher never import each other)
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

## Long fault-injection runs: 10,000 tasks on one node, then 1,000 on a 3-node RabbitMQ cluster
## and a PostgreSQL pair, both ways; write bench/results/chaos-*.json and chaos-cluster-*.json
chaos: install services
	$(BIN)/python -m bench.chaos --tasks $${CHAOS_TASKS:-10000}
	$(BIN)/python -m bench.chaos.cluster --tasks $${CHAOS_CLUSTER_TASKS:-1000}

## Benchmarks against Celery and a bare aio-pika consumer; writes bench/results/*.json
bench: install services
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
