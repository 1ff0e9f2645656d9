# Every target bootstraps .venv from nothing, so a fresh clone needs only `make`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: serve test soak lint bench clean redis

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/lightgate serve

redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null)

test: $(STAMP) redis
	$(BIN)/ruff check .
	$(BIN)/pytest -q

soak: $(STAMP) redis
	$(BIN)/pytest -q -m slow -p no:cacheprovider -o addopts=''

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/store_bench.py --quick

clean:
	rm -rf $(VENV) data .pytest_cache
