"""The conformance matrix cannot go stale: every statement has its test or a reason, and
docs/conformance.md is what report.py makes of them now."""

from __future__ import annotations

from tests.conformance import report


def test_every_statement_has_a_test_or_a_reason() -> None:
    assert report.problems(report.collect_tests()) == []


def test_the_doc_is_up_to_date() -> None:
    assert report.DOC.exists(), "run: python -m tests.conformance.report"
    assert report.DOC.read_text() == report.render(), \
        "docs/conformance.md is stale: python -m tests.conformance.report"
