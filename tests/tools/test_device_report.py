"""scripts/device/e2e_report.py: how the gputests phase reads pytest's JUnit report and renders it."""

from __future__ import annotations



import e2e_report as report


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.connectors.test_connectors_cuda" name="test_gloo_stages" time="3.1"/>
<testcase classname="tests.connectors.test_connectors_cuda"
          name="test_nccl_refuses"><failure message="x">tb</failure></testcase>
<testcase classname="tests.unit.test_cuda_path" name="test_key"><skipped message="cpu only"/></testcase>
<testcase classname="tests.unit.test_cuda_path" name="test_modes"><error message="setup">tb</error></testcase>
</testsuite></testsuites>"""


def test_gputests_phase_reads_pytest_junit_and_renders_each_test():
    cases = report.junit_cases(JUNIT)

    assert cases[0] == {"test": "tests/connectors/test_connectors_cuda.py::test_gloo_stages", "outcome": "passed"}
    assert report.junit_counts(JUNIT) == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    text = report.render_markdown({"phases": {"gputests": {"status": "failed", "tests": cases}}})
    assert "| tests/connectors/test_connectors_cuda.py::test_nccl_refuses | failed |" in text
