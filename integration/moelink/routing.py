"""The EP buffer's routes and membership (methods of moelink.Buffer, a mixin): which route a
normal-mode call takes (the NVLink kernels, the two-hop route across hosts, or the group path;
decided in C++, src/ep/routes.cpp, from facts the binding gathers), agreed with the other ranks
where it must be (a collective over the group, so here); the group's membership applied to the GPU buffer
(a masked-out rank masked out of it at its next call, ``update_members`` after a readmission).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from . import _C, two_hop


def mask_out_inactive(backend, mask: torch.Tensor) -> None:
    """Zeroes, in a GPU mask tensor (int32 per rank), the ranks the group has masked out;
    stream-ordered before the kernels launched after it."""
    group = torch.tensor(backend.active_mask(), dtype=torch.int32, device="cpu").to(mask.device, non_blocking=True)
    mask.mul_(group)


class Routing:
    """See the module docstring."""

    def _kernels_usable(self, device: torch.device) -> bool:
        return device.type == "cuda" and self._impl is not None and hasattr(_C, "NormalBuffer")

    def _route_facts(self, device: torch.device) -> tuple:
        """(route, ranks per host) as this rank sees the group, decided in C++ (moelink/ep/routes.h):
        route 'nvlink' when the kernels can serve the call (CUDA tensors, every rank of the group
        on NVLink and active, the GPU buffer connected at the group's epoch), 'group' when they
        cannot and a rank is masked out or the buffer awaits update_members, else 'ask'."""
        kernels = self._kernels_usable(device)
        return _C.normal_route(self._backend, self._impl if kernels else None,
                               self._backend.epoch == self._connected_epoch)

    def _normal_path(self, device: torch.device) -> str:
        """'nvlink', 'two_hop' (two_hop.py: the group spans hosts of several ranks each, agreed
        with the other ranks once per membership epoch) or 'group' (torch ops + all_to_all_single
        over the group). A non-cached dispatch is where every rank asks, so the agreement is a
        collective there."""
        route, _ = self._route_facts(device)
        if route != "ask":
            return route
        return "two_hop" if self._agreed_hosts(device) else "group"

    def _hosts_seen_here(self, device: torch.device) -> int:
        """Ranks per host for the two-hop route as this rank sees the group (0: not applicable)."""
        return self._route_facts(device)[1]

    def _agreed_hosts(self, device: torch.device) -> int:
        key = (device.type, self._backend.epoch)
        if key not in self._hosts:
            mine = self._hosts_seen_here(device)
            both = torch.tensor([mine, -mine], dtype=torch.int64, device="cpu")
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
            self._hosts[key] = _C.agreed_ranks_per_host(int(both[0].item()), -int(both[1].item()))
        return self._hosts[key]

    def _route(self, device: torch.device) -> "two_hop.TwoHop":
        """The two-hop route for tensors on ``device``'s type (after _normal_path chose it)."""
        route = self._two_hop.get(device.type)
        if route is None:
            route = self._two_hop[device.type] = two_hop.TwoHop(self, self._agreed_hosts(device))
        return route

    def _follow_group(self) -> None:
        """Masks ranks the group has masked out (after a membership change) out of the GPU buffer."""
        epoch = self._backend.epoch
        if epoch == self._epoch or self._impl is None:
            return
        self._epoch = epoch
        mask_out_inactive(self._backend, self._impl.active_ranks())

    def update_members(self) -> None:
        """Collective over the group's active ranks: brings the GPU buffer up to the group's
        membership after ``moelink.recover_ranks`` (or ``extend_group_size_to``) without
        rebuilding it. Survivors call it after readmitting; the readmitted rank's new process
        calls it after creating its Buffer (with the same arguments, as the group's same
        Buffer). It waits for this rank's kernels and for what its CPU proxy and NIC still
        carry, connects the readmitted ranks' new processes whatever the path (maps their
        buffers over CUDA IPC, opens their CPU-proxy inboxes, connects new IBGDA queue pairs),
        clears every signal, and unmasks every rank the group has active, also one this buffer
        masked out after a ``timeout_us`` expired; the normal mode's buffer is rebuilt at its
        next use. No dispatch or combine may be in flight on any rank (their handles from
        before the call are void). A replacement must reach the others the way its predecessor
        did (the same host, or one with the same paths: NVLink, proxy, IBGDA); otherwise the
        call raises ValueError on every rank, changing nothing, and a new Buffer on every rank
        is the way on."""
        backend = self._backend
        if self._impl is None:  # no GPU buffer: the host path follows the group's mask by itself
            self._epoch = self._connected_epoch = backend.epoch
            return
        torch.cuda.synchronize(self._impl.active_ranks().device)  # this rank's rounds are over
        serial = next(self._normal_serial)
        self._updates += 1
        mine = torch.tensor([self._impl.nonce(), self._key_index + 1, serial, self._impl.pairs_hash(), self._updates],
                            dtype=torch.int64, device="cpu")
        cols = mine.numel()
        every = torch.zeros(self.num_ranks * cols, dtype=torch.int64, device="cpu")
        dist.all_gather_into_tensor(every, mine, group=self.group)  # inactive ranks' slots: zeros
        mask = list(backend.active_mask())
        every = every.view(self.num_ranks, cols).tolist()
        active = [r for r in range(self.num_ranks) if mask[r]]
        keys = {every[r][1] - 1 for r in active}
        if len(keys) != 1:
            raise ValueError(f"moelink Buffer.update_members: the active ranks call it on different Buffers "
                             f"(creation indices {sorted(keys)}); a replacement process must create the same "
                             "Buffers in the same order as the others")
        paths = {every[r][3] for r in active}
        if len(paths) != 1:
            raise ValueError("moelink Buffer.update_members: the ranks reach each other differently in their "
                             "Buffers (a replacement process on another host than its predecessor, or with "
                             "another NIC, or a rank that was inactive when the others created it): create a new "
                             "Buffer on every rank instead")
        self._updates = generation = max(every[r][4] for r in active)
        self._normal = None  # the next normal-mode call creates it anew, over the new mappings
        self._two_hop = {}  # and the two-hop route's NVLink buffer with it
        self._normal_serial = itertools.count(max(row[2] for row in every) + 1)
        error = None
        for step in (self._impl.settle,  # then no rank's traffic is on its way anywhere
                     lambda: self._impl.update_members(mask, [every[r][0] if mask[r] else 0
                                                              for r in range(self.num_ranks)], generation)):
            try:
                if error is None:
                    step()
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                error = e
            ok = torch.tensor([0 if error is not None else 1], dtype=torch.int32, device="cpu")
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)  # nobody goes on before all are ready
            if error is not None:
                raise error
            if not ok.item():
                raise RuntimeError("moelink Buffer.update_members failed on another rank (see its error); this "
                                   "rank's buffer may be left with that rank masked out")
        self._epoch = self._connected_epoch = backend.epoch
