"""Command line (filled in below)."""


def main() -> None:
    raise SystemExit("not yet")
