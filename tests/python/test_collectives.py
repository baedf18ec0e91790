"""Every op of backend "ep", in groups of 2, 3 and 4 processes (shm between them) and of 3
processes forced onto tcp; each case checks against a locally computed reference."""

import functools

import pytest

import cases_collectives
from harness import assert_case_passed, run_cases, run_group

GROUPS = [(2, "auto"), (3, "auto"), (4, "auto"), (3, "tcp")]


@functools.lru_cache(maxsize=None)
def group_results(world, transport):
    per_rank = run_group(
        world,
        run_cases,
        kwargs={"cases_mod": "cases_collectives", "names": cases_collectives.CASES},
        env={"MOELINK_TRANSPORT": transport},
        timeout=900,
    )
    return per_rank


@pytest.mark.parametrize("world,transport", GROUPS, ids=[f"{w}ranks-{t}" for w, t in GROUPS])
@pytest.mark.parametrize("case", cases_collectives.CASES)
def test_collective(world, transport, case):
    assert_case_passed(group_results(world, transport), case)
