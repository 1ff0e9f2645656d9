"""The MQTT benchmarks' entry point, as `make bench` and the READMEs run it:
`python bench/mqtt_bench.py [--quick] ...`. The harness is the package bench/mqtt/
(`python -m bench.mqtt` runs the same); see bench/mqtt/cli.py for the usage.
"""

import sys
from pathlib import Path

# Run as a script, only bench/ is on sys.path: the package and gateway sit at the root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.mqtt.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
