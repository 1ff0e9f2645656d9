# Every target bootstraps .venv from nothing, so a fresh clone needs only `make`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: serve test soak lint bench bench-full clean redis chromium

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/lightgate serve

# Debian packages the tests drive for real: Redis (notify) and Chromium (the dashboard).
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null)

chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

test: $(STAMP) redis chromium
	$(BIN)/ruff check .
	$(BIN)/pytest -q

# The long forms: 1M fuzz inputs, 1M messages past a stuck subscriber, 30 min soak.
soak: $(STAMP) redis
	LIGHTGATE_FUZZ_RUNS=1000000 LIGHTGATE_SLOW_CONSUMER_MESSAGES=1000000 \
	LIGHTGATE_SOAK_SECONDS=1800 LIGHTGATE_STORM_CLIENTS=10000 \
	$(BIN)/pytest -q -p no:cacheprovider -o addopts='' -o timeout=7200 tests/fuzz tests/faults tests/soak

lint: $(STAMP)
	$(BIN)/ruff check .

# Benchmarks print JSON and write bench/results/ (a PNG per MQTT scenario beside it).
bench: $(STAMP) redis
	$(BIN)/python bench/mqtt_bench.py --quick

bench-full: $(STAMP) redis
	$(BIN)/python bench/mqtt_bench.py
	$(BIN)/python bench/store_bench.py
	$(BIN)/python bench/native_bench.py

clean:
	rm -rf $(VENV) data .pytest_cache
