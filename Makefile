# Every target bootstraps .venv from nothing, so a fresh clone needs only `make`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUM := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# One stamp per set of extras, so `make serve` installs the runtime dependencies alone
# and `make test` after it still adds the test tools (a larger set marks the smaller ones
# done too: `make serve` after `make test` installs nothing).
RUN_STAMP := $(VENV)/.installed-$(SUM)-run
STAMP := $(VENV)/.installed-$(SUM)-test
# `make docs` needs only mkdocs and its theme (the `docs` extra); the test extra has them too.
DOCS_STAMP := $(VENV)/.installed-$(SUM)-docs
# `make wheel` needs only the build tools (the `build` extra, tools/wheel.py), not the
# package itself.
BUILD_STAMP := $(VENV)/.installed-$(SUM)-build
# `make test` also installs the spark extra (pyspark, pyarrow, pandas: ~700 MB) so that CI
# runs the Spark end-to-end tests; the other targets do not need it.
SPARK_STAMP := $(VENV)/.installed-$(SUM)-spark

.PHONY: serve test docs soak lint bench bench-full clean redis chromium java mosquitto netfaults \
	native-check native-check-macos bench-peers wheel

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The native data plane (native/, Rust) is built by the install: its sources count too.
NATIVE_SRC := native/Cargo.toml native/Cargo.lock $(wildcard native/src/*.rs native/src/*/*.rs)

$(RUN_STAMP): $(BIN)/python pyproject.toml $(NATIVE_SRC)
	$(BIN)/pip install -q -e .
	touch $(RUN_STAMP)

$(STAMP): $(BIN)/python pyproject.toml $(NATIVE_SRC)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP) $(RUN_STAMP) $(DOCS_STAMP) $(BUILD_STAMP)

$(BUILD_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python tools/wheel.py --requirements > $(VENV)/build-requirements.txt
	$(BIN)/pip install -q -r $(VENV)/build-requirements.txt
	touch $(BUILD_STAMP)

$(DOCS_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[docs]'
	touch $(DOCS_STAMP) $(RUN_STAMP)

$(SPARK_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test,bench,spark]'
	touch $(SPARK_STAMP)

serve: $(RUN_STAMP)
	$(BIN)/lightgate serve

# The distributions into dist/: the sdist, and built from it a wheel with the native data
# plane, on CPython's stable ABI (3.11 and later) and tagged manylinux2014 (linked by zig
# against glibc 2.17, checked by auditwheel). Without cargo: a pure-Python wheel, and a
# line that says so.
wheel: $(BUILD_STAMP)
	$(BIN)/python tools/wheel.py --out dist

# The documentation site (mkdocs.yml, docs/) at http://127.0.0.1:8000/, rebuilt on every
# change; the configuration page is generated from lightgate/settings.py as it builds.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# Debian packages the tests drive for real: Redis (notify), Chromium (the dashboard),
# Mosquitto (an edge broker bridging to Lightgate, tests/mqtt/test_bridge.py), iproute2
# (network namespaces the store-group tests partition) and libfaketime (skewed clocks).
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null)

mosquitto:
	@command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null)

netfaults:
	@(command -v ip >/dev/null && [ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ]) || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 libfaketime >/dev/null)

chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# Java 17+ for Spark (local[2] in tests/spark), unless JAVA_HOME or PATH has one.
java:
	@[ -x "$$JAVA_HOME/bin/java" ] || command -v java >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null)

# Three pytest workers, a test file each at a time: most of the long tests wait (for an
# election, a lease, an idle minute, a Spark batch) rather than compute, so three overlap
# well on two cores: about 8 minutes instead of 20. `make test TEST_WORKERS=` runs them
# one by one. The 25 longest tests are listed at the end, to see what keeps it long.
TEST_WORKERS ?= -n 3 --dist loadfile

# The suite runs on the native data plane (the default where it is built), then the
# MQTT-facing tests again on the pure-Python one (LIGHTGATE_NATIVE=0), the reference.
# LIGHTGATE_REQUIRE_SPARK / _NETNS: the Spark and partition tests fail, not skip, if
# pyspark, Java, network namespaces or libfaketime are missing. The docs site is built
# first, strictly: a broken link, a page left out of the nav or a setting the generated
# configuration page cannot render fails the run (into site/, which git ignores; no
# --quiet: it would hide the warnings --strict counts).
test: $(SPARK_STAMP) redis chromium java mosquitto netfaults
	$(BIN)/ruff check .
	$(MAKE) native-check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
	LIGHTGATE_REQUIRE_SPARK=1 LIGHTGATE_REQUIRE_NETNS=1 $(BIN)/pytest -q $(TEST_WORKERS) \
		--durations=25
	LIGHTGATE_NATIVE=0 $(BIN)/pytest -q $(TEST_WORKERS) tests/mqtt tests/conformance

# The long forms: 1M inputs to each fuzzer (codec, connection), 1M messages past a stuck
# subscriber, a 10k-connection storm, a 30 min soak, 30 kill -9s of a store group's
# master (10 more under an idempotent producer), 30 rounds of partitions, pauses and
# kills (some after an idle minute), and 10 kill -9s of the Spark driver running the
# alerts and aggregates jobs: about two and a half hours.
soak: $(SPARK_STAMP) redis netfaults java
	LIGHTGATE_FUZZ_RUNS=1000000 LIGHTGATE_SLOW_CONSUMER_MESSAGES=1000000 \
	LIGHTGATE_SOAK_SECONDS=1800 LIGHTGATE_STORM_CLIENTS=10000 LIGHTGATE_HA_ROUNDS=30 \
	LIGHTGATE_PARTITION_ROUNDS=30 LIGHTGATE_BUDGET_SESSIONS=100000 LIGHTGATE_SPARK_KILLS=10 \
	LIGHTGATE_REQUIRE_SPARK=1 \
	$(BIN)/pytest -q -s -p no:cacheprovider -o addopts='' -o timeout=7200 tests/fuzz tests/faults tests/soak \
	tests/ha tests/spark/test_crash.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(MAKE) native-check

# The native crate on its own: clippy with warnings as errors (with and without the
# Python crossing) and its tests (unit and property tests; no interpreter needed).
native-check:
	cd native && cargo clippy --quiet --all-targets -- -D warnings
	cd native && cargo clippy --quiet --all-targets --features python -- -D warnings
	cd native && cargo test --quiet

# The native crate on macOS, type-checked from here (with and without the Python crossing;
# not linked: that needs Apple's SDK). Adds the target's standard library with rustup.
native-check-macos:
	rustup target add x86_64-apple-darwin
	cd native && cargo check --quiet --all-targets --target x86_64-apple-darwin
	cd native && PYO3_CROSS_PYTHON_VERSION=3.11 cargo check --quiet --target x86_64-apple-darwin \
		--features python

# The MQTT benchmark's peers, before it starts (so that no row waits for a build):
# Debian's mosquitto and rabbitmq-server (apt-get) and rumqttd built from its crate into
# bench/.peers (a few minutes the first time, and a minute more for the build that asks
# clients for certificates); each only if missing.
bench-peers: $(STAMP)
	$(BIN)/python -m bench.mqtt.installs mosquitto rabbitmq rumqttd rumqttd-mtls

# Benchmarks print JSON and write bench/results/ (a PNG per MQTT scenario beside it).
bench: $(STAMP) redis bench-peers
	$(BIN)/python bench/mqtt_bench.py --quick
	$(BIN)/python bench/mqtt_bench.py --quick --scenarios fanout_1to1000 \
		--brokers mosquitto,lightgate-native-io1,lightgate-native-io2 --out bench/results/scaling
	$(BIN)/python bench/mqtt_bench.py --quick --tls \
		--brokers mosquitto,lightgate-native,lightgate-async,rumqttd --out bench/results/tls
	$(BIN)/python bench/mqtt_bench.py --quick --scenarios qos0_1to1,device_fanin,device_fleet \
		--brokers mosquitto,lightgate-native,lightgate-separated,lightgate-group,lightgate-group-2gw \
		--out bench/results/production
	$(BIN)/python bench/replay_bench.py
	$(BIN)/python bench/replay_bench.py --mqtt

bench-full: $(STAMP) redis bench-peers
	$(BIN)/python bench/mqtt_bench.py
	$(BIN)/python bench/store_bench.py
	$(BIN)/python bench/native_bench.py

clean:
	rm -rf $(VENV) data .pytest_cache site native/target serving/lightgate_native.*.so bench/.peers \
		build dist
