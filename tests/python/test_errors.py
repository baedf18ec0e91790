"""Bad input raises clear Python exceptions within the timeout; the group stays usable."""

import functools

import pytest

import cases_errors
from harness import assert_case_passed, run_cases, run_group


@functools.lru_cache(maxsize=None)
def results(world):
    return run_group(world, run_cases, kwargs={"cases_mod": "cases_errors", "names": cases_errors.CASES},
                     timeout=600, pg_timeout=30)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", cases_errors.CASES)
def test_error_case(world, case):
    assert_case_passed(results(world), case)
