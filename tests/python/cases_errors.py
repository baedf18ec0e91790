"""Bad input: every case checks that the op raises a clear error on the ranks concerned,
within the timeout, and that the group works correctly afterwards."""

import os

import pytest
import torch
import torch.distributed as dist

import moelink


def _group_still_works(world):
    x = torch.ones(1000)
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((1000,), float(world))), "group broken after the error"


def sizes_differ_across_ranks(rank, world):
    x = torch.ones(1024 if rank == 0 else 2048)
    with pytest.raises(RuntimeError, match=r"allreduce #\d+: rank \d+ sent \d+ bytes, this rank expects \d+"):
        dist.all_reduce(x)
    _group_still_works(world)


def chunk_bytes_differ_across_ranks(rank, world):
    """Ranks whose mailbox slots differ (MOELINK_CHUNK_BYTES) cannot lay out each other's
    segments alike: the new group fails to form on every rank with both sizes named, and the
    groups that exist go on."""
    os.environ["MOELINK_CHUNK_BYTES"] = str(65536 if rank == 0 else 131072)
    try:
        with pytest.raises(RuntimeError, match=r"uses mailbox slots of \d+ bytes and this rank \d+ "
                                               r"\(MOELINK_CHUNK_BYTES must be the same on every rank"):
            dist.new_group()
    finally:
        del os.environ["MOELINK_CHUNK_BYTES"]
    _group_still_works(world)


def dtypes_differ_across_ranks(rank, world):
    x = torch.ones(256, dtype=torch.float32 if rank == 0 else torch.int32)  # same byte count
    with pytest.raises(RuntimeError, match=r"sent dtype (float32|int32), this rank expects (int32|float32)"):
        dist.all_reduce(x)
    _group_still_works(world)


def broadcast_sizes_differ(rank, world):
    """Every rank raises: the receivers on the root's data, the root on their roll calls."""
    x = torch.ones(100 if rank == 0 else 200)
    with pytest.raises(RuntimeError, match="broadcast #.*bytes"):
        dist.broadcast(x, 0)
    _group_still_works(world)


def invalid_root(rank, world):
    x = torch.ones(10)
    with pytest.raises((ValueError, RuntimeError), match=r"(?i)rank|root"):
        dist.broadcast(x, src=world + 3)
    with pytest.raises((ValueError, RuntimeError), match=r"(?i)rank|root"):
        dist.reduce(x, dst=-5)
    _group_still_works(world)


def wrong_output_sizes(rank, world):
    with pytest.raises(ValueError, match="all_gather_into_tensor: output has"):
        dist.all_gather_into_tensor(torch.empty(world * 10 + 1), torch.ones(10))
    with pytest.raises(ValueError, match="one tensor per rank"):
        dist.all_gather([torch.empty(3)] * (world + 1), torch.ones(3))
    with pytest.raises((ValueError, TypeError, RuntimeError), match="dtype"):
        dist.all_gather_into_tensor(torch.empty(world * 4, dtype=torch.float64), torch.ones(4))
    with pytest.raises(ValueError, match="split sizes sum"):
        dist.all_to_all_single(torch.empty(world), torch.ones(world), [1] * world, [2] * world)
    _group_still_works(world)


def unsupported_reduction(rank, world):
    with pytest.raises((TypeError, RuntimeError), match="BAND is only defined for integer"):
        dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND)
    with pytest.raises((TypeError, RuntimeError), match="AVG needs a floating-point"):
        dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG)
    _group_still_works(world)


def late_rank_after_a_timeout(rank, world):
    """The last rank arrives after the others timed out: it gets an error, not a result built
    on their failed op, and the group's next op is exact."""
    import time
    from datetime import timedelta

    g = dist.new_group(timeout=timedelta(seconds=1))
    x = torch.full((8,), 100.0 if rank == 0 else 1.0)
    if rank == world - 1:
        time.sleep(3)
    with pytest.raises(RuntimeError, match="Timed out|gave up"):
        dist.all_reduce(x, group=g)
    dist.barrier()  # every rank past the failed op
    y = torch.full((8,), float(rank + 1))
    dist.all_reduce(y, group=g)
    assert torch.all(y == world * (world + 1) / 2), y
    dist.destroy_process_group(g)


def root_disagreement(rank, world):
    """Every rank broadcasts as the root: each receives the others' data where it expects their
    roll call, and raises naming both roots."""
    with pytest.raises(RuntimeError, match="used root"):
        dist.broadcast(torch.full((8,), float(rank)), src=rank)
    _group_still_works(world)


def non_cpu_tensor(rank, world):
    """A device the backend does not serve (CUDA tensors are served: cases_cuda.py)."""
    t = torch.ones(4, device="meta")
    with pytest.raises((ValueError, RuntimeError), match="CPU and CUDA tensors"):
        dist.all_reduce(t)
        raise ValueError("CPU and CUDA tensors")  # some torch versions route meta elsewhere
    _group_still_works(world)


def alltoall_splits_disagree(rank, world):
    """Rank 0 sends everyone 2 rows; they expect 1. The receivers of the wrong-sized pieces
    raise; rank 0, whose own receives are as expected, completes, or raises too when their
    ABORTs reach it before it has finished."""
    send = [2 if rank == 0 else 1] * world
    send[rank] = 1
    recv = [1] * world
    x = torch.ones(sum(send), 3)
    out = torch.empty(sum(recv), 3)
    if rank == 0:
        try:
            dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
        except RuntimeError as e:
            assert "gave up on this op" in str(e) or "aborted this op" in str(e), e
    else:
        with pytest.raises(RuntimeError, match=r"alltoall #\d+: rank 0 sent 24 bytes to this rank, this rank expects 12"):
            dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
    _group_still_works(world)


def recv_size_mismatch(rank, world):
    if rank == 0:
        dist.send(torch.ones(10), 1)
    elif rank == 1:
        with pytest.raises(RuntimeError, match="rank 0 sent 40 bytes, this rank expects 80"):
            dist.recv(torch.empty(20), 0)
    _group_still_works(world)


def missing_peer_times_out(rank, world):
    """A rank that skips a collective: the others fail within the (short) timeout."""
    from datetime import timedelta
    import time

    g = dist.new_group(list(range(world)), timeout=timedelta(seconds=2))
    if rank != world - 1:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=" Timed out "):
            dist.all_reduce(torch.ones(4), group=g)
        assert time.monotonic() - t0 < 20
    dist.destroy_process_group(g)
    _group_still_works(world)


def set_timeout_applies_to_later_ops(rank, world):
    """torch.distributed.set_timeout, as gloo's and NCCL's groups take it: the ops issued after it
    time out at the new value (the group was made with 10 minutes); a non-positive timeout is
    refused by name and changes nothing."""
    from datetime import timedelta
    import time

    if not hasattr(dist, "set_timeout"):
        return  # this torch has no public set_timeout
    g = dist.new_group(list(range(world)), timeout=timedelta(minutes=10))
    backend = moelink.get_backend(g)
    assert backend.timeout == timedelta(minutes=10), backend.timeout
    dist.set_timeout(timedelta(seconds=2), group=g)
    assert backend.timeout == timedelta(seconds=2), backend.timeout
    with pytest.raises(ValueError, match="moelink set_timeout: the timeout must be positive, got 0 ms"):
        dist.set_timeout(timedelta(0), group=g)
    assert backend.timeout == timedelta(seconds=2), backend.timeout
    x = torch.full((4,), float(rank))
    dist.all_reduce(x, group=g)  # still a working group
    assert torch.all(x == sum(range(world))), x
    if rank != world - 1:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=" Timed out after 2000 ms"):
            dist.all_reduce(torch.ones(4), group=g)
        assert time.monotonic() - t0 < 20
    dist.barrier()  # (the last rank stays in the group meanwhile: a rank that left is masked out)
    dist.destroy_process_group(g)
    _group_still_works(world)


def work_result_futures(rank, world):
    """Work.get_future_result() (as NCCL's works have it): SUCCESS, COMM_ERROR for a disagreement,
    TIMEOUT for a peer that never came; asked before or after the op completed."""
    from datetime import timedelta

    from torch._C._distributed_c10d import WorkResult

    w = dist.all_reduce(torch.ones(8), async_op=True)
    early = w.get_future_result()
    w.wait()
    assert WorkResult(early.wait()) == WorkResult.SUCCESS
    assert WorkResult(w.get_future_result().wait()) == WorkResult.SUCCESS
    w = dist.all_reduce(torch.ones(1024 if rank == 0 else 2048), async_op=True)
    with pytest.raises(RuntimeError, match="expects"):
        w.wait()
    assert WorkResult(w.get_future_result().wait()) == WorkResult.COMM_ERROR
    g = dist.new_group(list(range(world)), timeout=timedelta(seconds=2))
    if rank != world - 1:
        w = dist.all_reduce(torch.ones(4), group=g, async_op=True)
        assert WorkResult(w.get_future_result().wait()) == WorkResult.TIMEOUT
        with pytest.raises(RuntimeError, match=" Timed out "):
            w.wait()
    dist.destroy_process_group(g)
    _group_still_works(world)


def transport_is_reported(rank, world):
    for r in range(world):
        kind = moelink.transport_of(r)
        assert kind == ("local" if r == rank else "shm"), kind
    assert moelink.get_backend().active_ranks() == list(range(world))


CASES = [n for n, f in list(globals().items()) if callable(f) and getattr(f, "__module__", None) == __name__
         and not n.startswith("_")]
