"""The README's SDK example, run as written (against a test server's port) twice: the
second run prints only what was sent since, because the first committed what it read."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT, Server


def readme_sdk_example() -> str:
    text = (ROOT / "README.md").read_text()
    after = text.split("Server applications use the same messages through the SDK:", 1)[1]
    block = re.search(r"```python\n(.*?)```", after, re.S)
    assert block, "no Python block after the SDK sentence"
    return block.group(1)


def test_the_readme_example_reads_each_message_once_over_two_runs(server: Server) -> None:
    code = readme_sdk_example().replace("127.0.0.1:10911", server.native)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.splitlines())
    line = "home/bath/cmd b'{\"cmd\":\"heat\"}'"
    assert runs == [[line], [line]], runs  # each run its own message: none read again
