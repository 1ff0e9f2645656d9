"""`python -m bench.mqtt`: the same as `python bench/mqtt_bench.py`."""

from .cli import main

main()
