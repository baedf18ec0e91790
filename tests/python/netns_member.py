"""A rank of the two-host partition test (test_elastic.py), run inside a network namespace:

    python netns_member.py RANK WORLD STORE_IP PORT OUT_DIR

Ranks on host A keep running all_reduce; once the link to host B is cut they must report
ranks of B inactive (agreed), then readmit them. Ranks on host B must find themselves out of
the group, then join again as extensions once the link is back, and run with A."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "integration"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import moelink  # noqa: E402


def join(rank, world, ip, port, extension):
    store = dist.TCPStore(ip, port, world, is_master=False, timeout=timedelta(seconds=90))
    dist.init_process_group("ep", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60),
                            pg_options=moelink.EpOptions(is_extension=extension))


def step(rank, world, i):
    """One all_reduce; returns the mask it ran over (the mask before it, less the ranks it lost)."""
    x = torch.full((256,), float(rank + 1 + i))
    mask = moelink.get_active_ranks().tolist()
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    for r in moelink.failed_ranks(work):
        mask[r] = 0
    want = sum(r + 1 + i for r in range(world) if mask[r])
    assert torch.all(x == want), f"op {i}: {x[0].item()} != {want} over mask {mask}"
    return mask


def main():
    rank, world, ip, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    host_a = rank < world // 2
    res = {"rank": rank}

    def mark(name):
        with open(os.path.join(out, f"{name}.{rank}"), "w") as f:
            f.write(repr(time.time()))

    try:
        join(rank, world, ip, port, False)
        i = 0
        if host_a:
            while True:
                try:
                    mask = step(rank, world, i)
                except Exception as e:  # noqa: BLE001
                    # A message of the cut side may have reached one survivor and not the other:
                    # then the op completed on one and fails on the other, by design (see
                    # membership.h); at most once, at the cut.
                    assert "cannot be completed over the remaining ranks" in str(e) and "torn" not in res, e
                    res["torn"] = str(e)
                    i += 1
                    continue  # the next op is where both survivors run over the new mask
                i += 1
                if i == 50:
                    mark("running")
                if not all(mask[r] for r in range(world // 2, world)):
                    res["mask_after_cut"] = mask
                    mark("evicted")
                    break
                time.sleep(0.002)
            for _ in range(20):
                step(rank, world, i)
                i += 1
            others = list(range(world // 2, world))
            while not all(moelink.get_peer_state(others)):
                step(rank, world, i)
                i += 1
                time.sleep(0.05)
            moelink.recover_ranks(others)
        else:
            try:
                while True:
                    step(rank, world, i)
                    i += 1
                    if i == 50:
                        mark("running")
                    time.sleep(0.002)
            except Exception as e:  # noqa: BLE001
                res["out_error"] = str(e)
            dist.destroy_process_group()
            mark("out")
            join(rank, world, ip, port, True)
        masks = [step(rank, world, 10**6 + k) for k in range(20)]
        res["final_masks"] = masks
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    with open(os.path.join(out, f"result.{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
