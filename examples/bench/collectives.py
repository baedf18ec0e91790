"""Backend "ep" side by side with an anchor: median latency and bus bandwidth per op and size.

    python examples/bench/collectives.py [--nproc 4] [--iters 20] [--out collectives.png]
    python examples/bench/collectives.py --device cuda --gpus 2 [--max-bytes 1073741824]

Spawns `nproc` processes on this machine (with --device cuda: one per GPU, or several per GPU when
--gpus exceeds the GPUs, which NCCL accepts only from different hosts: use --no-anchor, or
--nccl-socket with MOELINK_RANKS_PER_HOST=1, and run the GPU under MPS so that the ranks' kernels
run side by side rather than in turns); each joins an "ep"
group and an anchor group over the same store (gloo for CPU tensors, NCCL for CUDA tensors) and
times every op on both after warm-up, the two taking turns run by run. Before an op and size is
timed, one run of it on each backend is checked against the result computed locally (a mismatch
fails the run, naming the backend, op, size and element); with --graph, one replay of it in a
CUDA graph as well. Prints a table (median of
`iters` runs, `iters`/2 from 8 MiB up; max over ranks per run) with the ep/anchor ratio, and writes a PNG. A CUDA op is timed from a
synchronized start to torch.cuda.synchronize() after it, as a caller that needs the result sees it.
Bus bandwidth follows nccl-tests: allreduce 2(n-1)/n, allgather / reduce_scatter /
alltoall (n-1)/n, broadcast 1, times the message bytes over the time.

With --issue (CUDA tensors), a second table: the host time a rank spends issuing one op (the
call's return, no synchronization; batches of 20 back-to-back calls, median of `iters` batches,
slowest rank), the part of a small op's latency that is the caller's thread; and the same for an
all_reduce of the smallest size through each layer: torch.distributed's call, the backend's own
allreduce method called directly (what is left without PyTorch's Python and dispatch), and
`x.add_(0)` (one plain kernel launch through PyTorch). `--gpus 1` measures it without peers.

With --graph (CUDA tensors), another table: the time per op of 20 back-to-back ops captured in
one CUDA graph and replayed (from a synchronized start to torch.cuda.synchronize(), median of
`iters` replays, slowest rank), the latency a caller that replays graphs sees (a serving
engine's decode step): no host work per op, so the GPU's own time is what is left.

With --nccl-socket (CUDA tensors), the anchor is NCCL held to its socket transport over loopback,
tuned as its users tune it (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1
NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4): the anchor of
ep's host route across (virtual) hosts. Under MOELINK_RANKS_PER_HOST=n each virtual host of n
ranks also gets its own MOELINK_HOST_ID, so that ep's transfer engine talks tcp between virtual
hosts as it would between real ones (shared memory inside one). With n > 1 each virtual host
also gets its own NCCL_HOSTID, so that NCCL sees the same hosts, and P2P and shared memory are left
on: NCCL keeps NVLink inside a virtual host and its socket transport between them (its own
two-level algorithms), the anchor of ep's route `host+nvlink`.

With --cpu, a table of the CPU time per op: user + system time of every thread of every rank
(getrusage around the op, summed over ranks; median of `iters`). When the ranks share fewer cores
than there are ranks, a CPU op's time is bounded by this sum over the cores.
"""

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "integration"))
sys.path.insert(0, HERE)
from common import NCCL_SOCKET, fmt_bytes, run_ranks, save_plot, virtual_host  # noqa: E402

OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
BUS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def run_op(op, nbytes, group, world, bufs):
    x, out = bufs
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, x[: x.numel() // world], group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out[: x.numel() // world], x, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(out, x, group=group)
    elif op == "broadcast":
        dist.broadcast(x, src=0, group=group)


def buffers(nbytes, groups, world, device):
    """An (input, output) pair of about `nbytes` float32 per group."""
    n = max(world, nbytes // 4 // world * world)
    return [(torch.ones(n, device=device), torch.empty(n, device=device)) for _ in groups]


def op_case(op, nbytes, group, world, device):
    """(run, got, want) for checking `op` on `group`: `run` copies inputs that every rank can
    compute into place and runs the op once (no allocation: it can be captured in a CUDA graph),
    `got` is the tensor it leaves its result in, `want` the result computed here. Float32
    values below 2^24: exact for every op."""
    rank = dist.get_rank(group)
    n = max(world, nbytes // 4 // world * world)
    blk = n // world
    idx = torch.arange(n, dtype=torch.float32, device=device) % 251

    def inp(r, lo=0, hi=n):
        return idx[lo:hi] + 1000 * r

    src = inp(rank)
    x, out = src.clone(), torch.empty(n, device=device)
    total = 1000 * world * (world - 1) // 2  # the sum over ranks, less world * idx
    got, want = {  # (only the op's expected result is computed)
        "all_reduce": lambda: (x, world * idx + total),
        "all_gather": lambda: (out, torch.cat([inp(r, 0, blk) for r in range(world)])),
        "reduce_scatter": lambda: (out[:blk], world * idx[rank * blk:(rank + 1) * blk] + total),
        "all_to_all": lambda: (out, torch.cat([inp(r, rank * blk, (rank + 1) * blk) for r in range(world)])),
        "broadcast": lambda: (x, inp(0)),
    }[op]()

    def run():
        x.copy_(src)
        run_op(op, nbytes, group, world, (x, out))

    return run, got, want


def verify(got, want, what):
    """Raises naming `what` and the first element that differs."""
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].item()
        raise RuntimeError(f"{what}: element {bad} is {got[bad].item()}, expected {want[bad].item()}")


def check_op(op, nbytes, group, world, device, name):
    """One run of `op` against the result computed here (op_case): a benchmark of wrong
    results measures nothing, so a mismatch raises (the run fails), naming the backend, the
    op, the size and the rank."""
    run, got, want = op_case(op, nbytes, group, world, device)
    run()
    verify(got, want, f"{name} {op} of {fmt_bytes(nbytes)} on rank {dist.get_rank(group)}")


def cpu_seconds():
    """User + system CPU time of this process, all of its threads (the backends' included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def time_once(op, nbytes, group, world, bufs, cuda, sync_group):
    """One synchronized run: the slowest rank's time, and the CPU time of all ranks together."""
    if cuda:
        torch.cuda.synchronize()
    dist.barrier(group=sync_group)
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    run_op(op, nbytes, group, world, bufs)
    if cuda:
        torch.cuda.synchronize()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = torch.tensor([cpu_seconds() - c0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=sync_group)
    dist.all_reduce(cpu, group=sync_group)
    return dt.item(), cpu.item()


def time_pair(op, nbytes, groups, names, world, iters, warmup, device, sync_group):
    """Median time and median CPU time of `op` on each group in `groups`, the groups taking
    turns run by run (so that a slow spell of the machine falls on both alike); each group's
    results are checked first (check_op)."""
    cuda = device != "cpu"
    for g, name in zip(groups, names):
        check_op(op, nbytes, g, world, device, name)
    bufs = buffers(nbytes, groups, world, device)
    for g, b in zip(groups, bufs):
        for _ in range(warmup):
            run_op(op, nbytes, g, world, b)
    times = [[] for _ in groups]
    cpus = [[] for _ in groups]
    for _ in range(iters):
        for k, (g, b) in enumerate(zip(groups, bufs)):
            t, c = time_once(op, nbytes, g, world, b, cuda, sync_group)
            times[k].append(t)
            cpus[k].append(c)
    return [statistics.median(t) for t in times], [statistics.median(c) for c in cpus]


def batch_issue_time(fns, iters, sync_group, batch=20):
    """Median host time per call over batches of `batch` back-to-back calls of each of `fns`
    (taking turns), slowest rank."""
    times = [[] for _ in fns]
    for _ in range(iters):
        for k, f in enumerate(fns):
            torch.cuda.synchronize()
            dist.barrier(group=sync_group)
            t0 = time.perf_counter()
            for _ in range(batch):
                f()
            dt = torch.tensor([(time.perf_counter() - t0) / batch], dtype=torch.float64)
            torch.cuda.synchronize()
            dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=sync_group)
            times[k].append(dt.item())
    return [statistics.median(t) for t in times]


def issue_time(op, nbytes, groups, world, iters, device, sync_group):
    """batch_issue_time of `op` on each group in `groups`."""
    bufs = buffers(nbytes, groups, world, device)
    fns = [lambda g=g, b=b: run_op(op, nbytes, g, world, b) for g, b in zip(groups, bufs)]
    return batch_issue_time(fns, iters, sync_group)


def layer_times(nbytes, groups, iters, device, sync_group):
    """batch_issue_time of an all_reduce of `nbytes` issued through each layer, on each group in
    `groups`: rows of (layer, [seconds per group])."""
    x = torch.ones(max(1, nbytes // 4), device=device)

    def through_backend(g):
        backend = g._get_backend(torch.device(device))
        opts = dist.AllreduceOptions()
        if hasattr(opts, "asyncOp"):
            opts.asyncOp = False  # as dist.all_reduce(async_op=False) passes it
        return lambda: backend.allreduce([x], opts)

    layers = [
        ("dist.all_reduce", lambda g: (lambda: dist.all_reduce(x, group=g))),
        ("backend.allreduce", through_backend),
        ("x.add_(0), one kernel", lambda g: (lambda: x.add_(0))),
    ]
    return [(name, batch_issue_time([make(g) for g in groups], iters, sync_group)) for name, make in layers]


def capture(fn):
    """A CUDA graph of fn(), captured on a side stream (as PyTorch's docs do it)."""
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    return graph


def check_graph(op, nbytes, group, world, device, name):
    """check_op for a replay of `op` captured in a CUDA graph: the result tensor is overwritten
    before the replay, so the values compared are the replay's."""
    run, got, want = op_case(op, nbytes, group, world, device)
    run()  # outside the capture: sets up what the op needs
    graph = capture(run)
    got.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    verify(got, want, f"{name} {op} of {fmt_bytes(nbytes)} replayed in a CUDA graph, rank {dist.get_rank(group)}")


def graph_time(op, nbytes, groups, names, world, iters, device, sync_group, batch=20):
    """Median time per op over replays of a CUDA graph of `batch` back-to-back ops, per group
    in `groups` (taking turns), slowest rank; each group's replay is checked first (check_graph)."""
    for g, name in zip(groups, names):
        check_graph(op, nbytes, g, world, device, name)
    bufs = buffers(nbytes, groups, world, device)
    graphs = []
    for g, b in zip(groups, bufs):
        run_op(op, nbytes, g, world, b)  # outside the capture: sets up what the op needs
        graph = capture(lambda g=g, b=b: [run_op(op, nbytes, g, world, b) for _ in range(batch)])
        graph.replay()  # warm-up
        graphs.append(graph)
    times = [[] for _ in groups]
    for _ in range(iters):
        for k, graph in enumerate(graphs):
            torch.cuda.synchronize()
            dist.barrier(group=sync_group)
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            dt = torch.tensor([(time.perf_counter() - t0) / batch], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=sync_group)
            times[k].append(dt.item())
    return [statistics.median(t) for t in times]


def worker(rank, world, port, sizes, iters, transport, ops, with_gloo, device, issue, graph, nccl_socket, q):
    os.environ["MOELINK_TRANSPORT"] = transport
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rph = int(os.environ.get("MOELINK_RANKS_PER_HOST", "0") or 0)
    if nccl_socket:
        os.environ.update(NCCL_SOCKET)
        if rph:  # NCCL's nodes are ep's virtual hosts (so ranks on different ones may share a GPU)
            os.environ["NCCL_HOSTID"] = f"vhost{rank // rph}"
        if rph > 1:  # NVLink inside a virtual host, sockets between them
            for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
                os.environ.pop(name)
    if rph:
        virtual_host(rank, rph)
    import moelink

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # more ranks than GPUs: they share
    dist.init_process_group("ep", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    anchor = dist.new_group(backend="nccl" if device == "cuda" else "gloo") if with_gloo else None
    anchor_name = ("nccl-socket" if nccl_socket else "nccl") if device == "cuda" else "gloo"
    ep = dist.group.WORLD
    rows = []
    for op in ops:
        for nbytes in sizes:
            big = nbytes >= (8 << 20)
            iters_here = iters if not big else max(5, iters // 2)
            warm = 3 if not big else 1
            groups = [ep, anchor] if with_gloo else [ep]
            t, c = time_pair(op, nbytes, groups, ["ep", anchor_name], world, iters_here, warm, device, ep)
            nan2 = [float("nan")] * 2
            i = issue_time(op, nbytes, groups, world, iters_here, device, ep) if issue else nan2
            gr = graph_time(op, nbytes, groups, ["ep", anchor_name], world, iters_here, device, ep) if graph else nan2
            rows.append((op, nbytes, t[0], t[1] if with_gloo else float("nan"), i[0], i[1] if with_gloo else float("nan"),
                         gr[0], gr[1] if with_gloo else float("nan"), c[0], c[1] if with_gloo else float("nan")))
    layers = []
    if issue and sizes:
        groups = [ep, anchor] if with_gloo else [ep]
        layers = layer_times(sizes[0], groups, iters, device, ep)
    path = moelink.get_backend(ep).cuda_path() if device == "cuda" else ""
    if rank == 0:
        q.put((rows, layers, path))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--gpus", type=int, default=0, help="with --device cuda: processes (one per GPU)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--min-bytes", type=int, default=4 << 10)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--transport", default=os.environ.get("MOELINK_TRANSPORT", "auto"))
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    ap.add_argument("--no-gloo", "--no-anchor", action="store_true", help="time backend ep only")
    ap.add_argument("--issue", action="store_true", help="CUDA: also the host time to issue one op")
    ap.add_argument("--graph", action="store_true", help="CUDA: also the time per op replayed in a CUDA graph")
    ap.add_argument("--nccl-socket", action="store_true",
                    help="CUDA: the anchor is NCCL on its socket transport over loopback, 4x4 sockets")
    ap.add_argument("--cpu", action="store_true",
                    help="also the CPU time per op (all ranks' threads summed): what a ratio costs in cores")
    ap.add_argument("--out", default="collectives.png")
    args = ap.parse_args()
    sizes = []
    s = args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 4
    if sizes and sizes[-1] != args.max_bytes:
        sizes.append(args.max_bytes)
    ops = [o for o in args.ops.split(",") if o]
    n = args.nproc
    anchor = "gloo"
    if args.device == "cuda":
        n = args.gpus or torch.cuda.device_count()
        anchor = "nccl-socket" if args.nccl_socket else "nccl"
    if (args.issue or args.graph) and args.device != "cuda":
        ap.error("--issue and --graph need --device cuda")
    rows, layers, cuda_path = run_ranks(worker, n, (sizes, args.iters, args.transport, ops, not args.no_gloo, args.device, args.issue,
                                 args.graph, args.nccl_socket), timeout=3600)
    path = os.environ.get("MOELINK_RANKS_PER_HOST")
    print(f"# {n} ranks, {args.device} tensors, ep transport={args.transport}"
          f"{', MOELINK_RANKS_PER_HOST=' + path if path else ''}"
          f"{', MOELINK_TCP_STREAMS=' + os.environ['MOELINK_TCP_STREAMS'] if os.environ.get('MOELINK_TCP_STREAMS') else ''}"
          f", median of {args.iters} (max over ranks), "
          f"torch {torch.__version__}")
    # The SMs the in-host kernels hold (route nvlink): from moelink's own plan of each op.
    sms = None
    if cuda_path == "nvlink":
        import moelink

        sms = lambda op, nb: f"{moelink.cuda_sms(op, n, nb):>8}"
    print(f"{'op':<15}{'size':>10}{'ep us':>12}{anchor + ' us':>12}{'ep GB/s':>10}{anchor + ' GB/s':>11}"
          f"{'ep/' + anchor:>9}" + (f"{'ep SMs':>8}" if sms else ""))
    for op, nb, te, tg, *_ in rows:
        bw = lambda t: BUS[op](n) * nb / t / 1e9
        print(f"{op:<15}{fmt_bytes(nb):>10}{te * 1e6:12.1f}{tg * 1e6:12.1f}{bw(te):10.2f}{bw(tg):11.2f}{te / tg:9.2f}"
              + (sms(op, nb) if sms else ""))
    if args.cpu:
        print(f"# CPU time per op (us): user + system of every thread of every rank, summed over ranks, median of {args.iters}")
        print(f"{'op':<15}{'size':>10}{'ep us':>12}{anchor + ' us':>12}{'ep/' + anchor:>9}")
        for op, nb, *_, ce, cg in rows:
            print(f"{op:<15}{fmt_bytes(nb):>10}{ce * 1e6:12.1f}{cg * 1e6:12.1f}{ce / cg:9.2f}")
    if args.issue:
        print(f"# host time to issue one op (us): batches of 20 calls, median of {args.iters}, slowest rank")
        print(f"{'op':<15}{'size':>10}{'ep us':>12}{anchor + ' us':>12}{'ep/' + anchor:>9}")
        for op, nb, _, _, ie, ig, *_ in rows:
            print(f"{op:<15}{fmt_bytes(nb):>10}{ie * 1e6:12.1f}{ig * 1e6:12.1f}{ie / ig:9.2f}")
        print(f"# the same, all_reduce of {fmt_bytes(sizes[0])} issued through each layer (us): PyTorch's "
              "call, the backend's own method called directly, and a plain kernel launch for scale")
        print(f"{'layer':<25}{'ep us':>12}{anchor + ' us':>12}")
        for name, ts in layers:
            print(f"{name:<25}" + "".join(f"{t * 1e6:12.1f}" for t in ts) + ("" if len(ts) > 1 else f"{'':>12}"))
    if args.graph:
        print(f"# time per op replayed in a CUDA graph (us): graphs of 20 ops, median of {args.iters}, slowest rank")
        print(f"{'op':<15}{'size':>10}{'ep us':>12}{anchor + ' us':>12}{'ep/' + anchor:>9}")
        for op, nb, _, _, _, _, ge, gg, *_ in rows:
            print(f"{op:<15}{fmt_bytes(nb):>10}{ge * 1e6:12.1f}{gg * 1e6:12.1f}{ge / gg:9.2f}")
    def draw(plt):
        fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.6), sharey=True, squeeze=False)
        axes = axes[0]
        for ax, op in zip(axes, ops):
            r = [x for x in rows if x[0] == op]
            ax.loglog([x[1] for x in r], [x[2] * 1e6 for x in r], "o-", label="ep")
            ax.loglog([x[1] for x in r], [x[3] * 1e6 for x in r], "s--", label=anchor)
            ax.set_title(op)
            ax.set_xlabel("bytes")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("median latency (us)")
        axes[0].legend()
        fig.suptitle(f"moelink 'ep' vs {anchor}, {n} ranks, {args.device} tensors, transport={args.transport}")
        return fig

    save_plot(draw, args.out)

if __name__ == "__main__":
    main()
