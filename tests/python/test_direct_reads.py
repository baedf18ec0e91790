"""Groups on one host whose ranks read each other's memory directly (one copy), against the
same ops with that turned off (MOELINK_SHM_PULL=0), with one rank that does not read directly, and
over tcp: every result exact."""

import functools

import pytest

import cases_direct_reads
from harness import assert_case_passed, run_cases, run_group

# Small pieces, so that every op crosses many pulled pieces of odd sizes.
SMALL_PIECES = {"MOELINK_PULL_CHUNK_BYTES": "300000", "MOELINK_PULL_MIN_BYTES": "1000"}
SETUPS = {
    "direct": {"MOELINK_TRANSPORT": "auto", **SMALL_PIECES},
    "direct-default-pieces": {"MOELINK_TRANSPORT": "auto"},
    "slots": {"MOELINK_TRANSPORT": "auto", "MOELINK_SHM_PULL": "0", **SMALL_PIECES},
    # Rank 2 never reads directly: the pairs into it use the slots, the others read directly.
    "mixed": {"MOELINK_TRANSPORT": "auto", **SMALL_PIECES},
    "tcp": {"MOELINK_TRANSPORT": "tcp", **SMALL_PIECES},
}


@functools.lru_cache(maxsize=None)
def results(setup):
    return run_group(4, run_cases_with_report, kwargs={"names": cases_direct_reads.CASES}, env=SETUPS[setup],
                     rank_env={2: {"MOELINK_SHM_PULL": "0"}} if setup == "mixed" else None, timeout=600, pg_timeout=60)


def run_cases_with_report(rank, world, names):
    import cases_direct_reads as c

    return {"reads": c.reads_directly_reported(rank, world),
            "cases": run_cases(rank, world, "cases_direct_reads", names)}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("case", cases_direct_reads.CASES)
def test_copy_ops(setup, case):
    assert_case_passed([res["cases"] for res in results(setup)], case)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_reads_directly_reported(setup):
    reads = [res["reads"] for res in results(setup)]
    seen = {v for r in reads for v in r if v is not None}
    if setup in ("slots", "tcp"):
        assert seen == {False}
        return
    if setup == "mixed" and seen != {False}:
        # Rank p's reads[q] says whether q reads p: true for every q but rank 2.
        assert reads == [[None if q == p else q != 2 for q in range(4)] for p in range(4)], reads
        return
    assert len(seen) == 1, f"some pairs read directly and some not: {[res['reads'] for res in results(setup)]}"
    if seen == {False}:
        pytest.skip("this machine does not let processes read each other's memory (ptrace scope or seccomp): "
                    "the ops above ran through shared-memory slots")
