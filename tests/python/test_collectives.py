"""Every op of backend "ep", in groups of 2, 3 and 4 processes (shm between them), of 2 processes
forced onto tcp (one stream per peer) and of 3 forced onto tcp with 3 streams per peer and writes
from 128 KiB striped over them; each case checks against a locally computed reference."""

import functools

import pytest

import cases_collectives
from harness import assert_case_passed, run_cases, run_group

GROUPS = [(2, "auto"), (3, "auto"), (4, "auto"), (2, "tcp"), (3, "tcp-striped")]
ENV = {
    "auto": {"MOELINK_TRANSPORT": "auto"},
    "tcp": {"MOELINK_TRANSPORT": "tcp", "MOELINK_TCP_STREAMS": "1"},
    "tcp-striped": {"MOELINK_TRANSPORT": "tcp", "MOELINK_TCP_STREAMS": "3", "MOELINK_TCP_STRIPE_BYTES": "131072"},
}


@functools.lru_cache(maxsize=None)
def group_results(world, transport):
    per_rank = run_group(
        world,
        run_cases,
        kwargs={"cases_mod": "cases_collectives", "names": cases_collectives.CASES},
        env=ENV[transport],
        timeout=900,
    )
    return per_rank


@pytest.mark.parametrize("world,transport", GROUPS, ids=[f"{w}ranks-{t}" for w, t in GROUPS])
@pytest.mark.parametrize("case", cases_collectives.CASES)
def test_collective(world, transport, case):
    assert_case_passed(group_results(world, transport), case)
