"""EP buffer latency vs an all_to_all_single (NCCL) dispatch + combine of the same routing.

    python examples/bench/ep.py [--gpus 4] [--tokens 128,256] [--experts 256] [--iters 200] [--out ep.png]
                                [--mooncake] [--deepep] [--trace [--build build]]

One process per GPU. Per round: random top-8 of 256 experts per token (hidden 7168), FP8
dispatch and BF16 combine for moelink; the NCCL pipeline moves bf16 tokens with
all_to_all_single (counts exchanged first, as a real MoE layer must) and combines with
index_add. Every timing is CUDA events around one call, L2 flushed before it, median of
`iters` after warm-up, slowest rank. Bandwidth as DeepEP's tests/test_low_latency.py counts
it: dispatch moves (hidden + hidden/128*4 + 16) bytes per selected (token, expert) pair,
combine hidden*2 bytes per pair. Both figures are that count over the time, not the bytes on
the links: moelink sends a token once per destination rank in dispatch, and one weighted sum
per (token, rank) back in combine. --mooncake adds Mooncake's EP buffer (its PyPI wheel) and
--deepep DeepEP v1 (``import deep_ep``: bash .devdeps/deepep/build.sh, see scripts/gpu-run.sh) on
the same inputs, timed the same way; with --deepep every round first checks that both libraries
received as many tokens per expert and combine alike (each combining what it received, an
identity expert). "back to back" is 50 dispatch + combine pairs issued eagerly with one sync at
the end, per pair: the host's launch path against the GPU time of the pair. --trace adds the
kernels' phase times, each rank's event time beside its kernel's span, and the launch floor
(examples/bench/launch_floor.cu, built as moelink_launch_bench). --gpus 1 runs EP1: every expert
on the one GPU, the whole protocol into its own memory, no NVLink.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "integration"))
sys.path.insert(0, HERE)
from common import run_built, run_ranks, save_plot  # noqa: E402

HIDDEN, TOPK = 7168, 8
# --experts reaches the rank processes through the environment (they import this module anew).
EXPERTS = int(os.environ.get("EP_BENCH_EXPERTS", "256"))


def timed(fn, flush, iters, warmup, barrier, gpu_only=True):
    """CUDA-event times (us). gpu_only: a sleep kernel queued first lets the host enqueue the
    call before the start event fires, so the events measure the GPU's time, not the host's
    launch and allocation overhead (what DeepEP's kernel timings report). `barrier` (a tiny
    NCCL all_reduce) runs on the GPU right before the start event, so that every rank's call
    starts at the same moment: otherwise a rank whose host happened to launch earlier would
    count its wait for the others as its own latency."""
    times = []
    for i in range(warmup + iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if gpu_only:
            torch.cuda._sleep(2_000_000)  # ~1 ms
        barrier()
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3)  # us
    return times


def a2a_pipeline(x, idx, w, world, nccl):
    """Dispatch: send each (token, expert) copy to the expert's rank; combine: back + weighted sum."""
    nle = EXPERTS // world
    valid = idx >= 0
    tok = valid.nonzero()[:, 0]
    exp = idx[valid]
    dst = exp // nle
    order = torch.argsort(dst, stable=True)
    send_counts = torch.bincount(dst, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=nccl)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    send = x[tok[order]]
    recv = torch.empty(sum(rc), x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, send, rc, sc, group=nccl)
    # (experts would run here)
    back = torch.empty_like(send)
    dist.all_to_all_single(back, recv, sc, rc, group=nccl)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok[order], back.float() * w[valid][order].unsqueeze(1))
    return out.to(torch.bfloat16)


DISPATCH_POINTS = ["start", "1st token staged", "sends done", "experts counted", "counts seen", "end"]
COMBINE_POINTS = ["start", "sends done", "flags seen", "tokens done", "routes in"]


def trace_breakdown(buf, fn, names, flush, barrier, iters=30):
    """Per-phase timestamps from inside the kernel (%globaltimer, one block = one sample):
    for each phase, the min / median / max over blocks of its time since the earliest block
    started, each the median over `iters` calls; and the medians of the call's event time (as
    `timed` measures it) and of the kernel's span on this GPU (earliest block start to the
    latest timestamp), whose difference is what the events see outside the kernel."""
    trace = torch.zeros(buf._impl.num_sms() * 8, dtype=torch.int64, device="cuda")
    buf._impl.set_trace(trace)
    per_call, events, spans = [], [], []
    for _ in range(iters):
        trace.zero_()
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        barrier()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        events.append(start.elapsed_time(end) * 1e3)
        t = trace.view(-1, 8).cpu()
        t0 = int(t[:, 0][t[:, 0] > 0].min())
        spans.append((int(t.max()) - t0) / 1e3)
        stats = []
        for i in range(len(names)):
            col = t[:, i][t[:, i] > 0]
            col = (col - t0).float() / 1e3
            stats.append((float(col.min()), float(col.median()), float(col.max())) if len(col) else (0, 0, 0))
        per_call.append(stats)
    buf._impl.set_trace(None)
    phases = [tuple(statistics.median(c[i][j] for c in per_call) for j in range(3)) for i in range(len(names))]
    return phases, statistics.median(events), statistics.median(spans)


def anchor_times(dispatch, combine, flush, barrier, iters, end_to_end=False):
    """Another library's dispatch and combine timed as moelink's (three warm-up pairs, then
    `iters` rounds after ten more): the medians (us) of each call's GPU time and, with
    `end_to_end`, of one pair end to end and the back-to-back time per pair."""
    for _ in range(3):
        dispatch()
        combine()
    torch.cuda.synchronize()
    t_disp, t_comb, t_call = [], [], []
    for _ in range(iters + 10):
        t_disp += timed(dispatch, flush, 1, 0, barrier)
        t_comb += timed(combine, flush, 1, 0, barrier)
        if end_to_end:
            t_call += timed(lambda: (dispatch(), combine()), flush, 1, 0, barrier, gpu_only=False)
    meds = (statistics.median(t_disp[10:]), statistics.median(t_comb[10:]))
    if not end_to_end:
        return meds
    b2b = statistics.median(back_to_back(dispatch, combine, barrier) for _ in range(5))
    torch.cuda.synchronize()
    return meds + (statistics.median(t_call[10:]), b2b)


def mooncake_times(nccl, x, idx, w, tokens, world, flush, barrier, iters):
    """Mooncake's EP buffer (its PyPI wheel, mooncake.mooncake_ep_buffer) on the same inputs:
    FP8 dispatch, BF16 combine, every rank active, GPU time of each call as moelink's."""
    from mooncake.mooncake_ep_buffer import Buffer as MooncakeBuffer

    mb = MooncakeBuffer(nccl, MooncakeBuffer.get_ep_buffer_size_hint(tokens, HIDDEN, world, EXPERTS))
    active = torch.ones(world, dtype=torch.int32, device="cuda")
    y = torch.zeros(EXPERTS // world, world * tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    state = {}

    def dispatch():
        state["r"] = mb.dispatch(x, idx, active, tokens, EXPERTS, -1, use_fp8=True)

    def combine():
        mb.combine(y, idx, w, active, -1, state["r"][2])

    return anchor_times(dispatch, combine, flush, barrier, iters)  # its first calls compile its kernels


def back_to_back(dispatch, combine, barrier, pairs=50):
    """Microseconds per dispatch + combine pair, `pairs` of them issued eagerly with one sync at
    the end."""
    torch.cuda.synchronize()
    barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(pairs):
        dispatch()
        combine()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / pairs * 1e6


def dequant_identity(recv_x):
    """An identity expert over FP8 rows received as (data, per-128 scales): their BF16 values."""
    data, scales = recv_x
    nle, rows, hidden = data.shape
    v = data.float().view(nle, rows, hidden // 128, 128) * scales.float().unsqueeze(-1)
    return v.view(nle, rows, hidden).to(torch.bfloat16)


def deepep_buffer(nccl, tokens, world):
    """One DeepEP v1 low-latency buffer per process (NVSHMEM is set up once), sized for the
    largest token count, as its tests/test_low_latency.py builds it."""
    import deep_ep

    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, HIDDEN, world, EXPERTS)
    return deep_ep.Buffer(nccl, num_rdma_bytes=size, low_latency_mode=True, num_qps_per_rank=EXPERTS // world,
                          explicitly_destroy=True)


def check_identity_combine(libs, x, idx, w, tokens):
    """Both libraries (name -> buffer) dispatch `x` and combine an identity expert over what they
    received; each result must equal the local reference x * sum(w) (every expert valid). BF16
    dispatch is exact, so only the combine's BF16 rounding is allowed; FP8 quantization moves an
    element by up to half an e4m3 step (2^-4 of it), and a whole step is allowed before the weights
    multiply it. (The libraries' FP8 rows need not be equal: they round the scaled values in
    different orders.) Per-expert counts must agree between the libraries."""
    ref = x.float() * w.float().sum(1, keepdim=True)
    wsum = w.float().abs().sum(1, keepdim=True)
    for fp8 in (False, True):
        counts = {}
        for name, lib in libs.items():
            recv, count, handle = lib.low_latency_dispatch(x, idx, tokens, EXPERTS, use_fp8=fp8)[:3]
            out = lib.low_latency_combine(dequant_identity(recv) if fp8 else recv, idx, w, handle)[0].float()
            counts[name] = count.int()
            tol = wsum * x.float().abs() * (2 ** -3 if fp8 else 0.0) + ref.abs() * 2 ** -7 + 1e-3
            excess = float(((out - ref).abs() - tol).max())
            assert excess <= 0, (f"{name}: identity-expert combine after {'FP8' if fp8 else 'BF16'} dispatch is off "
                                 f"the reference by {excess:.4g} beyond the rounding allowed")
        a, b = counts.values()
        assert torch.equal(a, b), "DeepEP and moelink received different tokens per expert"


def deepep_times(db, buf, x, idx, w, tokens, world, flush, barrier, iters):
    """DeepEP v1's low-latency buffer `db` on the same inputs, after checking that it and
    moelink's `buf` agree (check_identity_combine). Returns the medians (us) of dispatch and
    combine GPU time, of one pair end to end, and the back-to-back time per pair."""
    db.clean_low_latency_buffer(tokens, HIDDEN, EXPERTS)
    check_identity_combine({"moelink": buf, "DeepEP v1": db}, x, idx, w, tokens)
    y = torch.zeros(EXPERTS // world, world * tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    state = {}

    def dispatch():
        state["r"] = db.low_latency_dispatch(x, idx, tokens, EXPERTS, use_fp8=True)

    def combine():
        db.low_latency_combine(y, idx, w, state["r"][2])

    return anchor_times(dispatch, combine, flush, barrier, iters, end_to_end=True)


def worker(rank, world, port, tokens_list, iters, trace, mooncake, deepep, q):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    import moelink

    dist.init_process_group("ep", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    nccl = dist.new_group(backend="nccl", device_id=torch.device("cuda", rank))
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    token = torch.ones(1, device="cuda")

    def barrier():
        dist.all_reduce(token, group=nccl)
    rows = []
    db = deepep_buffer(nccl, max(tokens_list), world) if deepep else None
    for tokens in tokens_list:
        buf = moelink.Buffer(None, tokens, HIDDEN, EXPERTS)
        g = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        scores = torch.randn(tokens, EXPERTS, device="cuda", generator=g).abs() + 1
        idx = scores.topk(TOPK, dim=1).indices
        w = torch.rand(tokens, TOPK, device="cuda", generator=g)
        state = {}

        def dispatch():
            state["r"] = buf.low_latency_dispatch(x, idx, tokens, EXPERTS, use_fp8=True)

        def combine():
            recv, count, handle, _, _ = state["r"]
            buf.low_latency_combine(state["y"], idx, w, handle)

        nle = EXPERTS // world
        state["y"] = torch.zeros(nle, world * tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
        dispatch()  # warm-up round trip
        combine()
        torch.cuda.synchronize()
        dist.barrier()
        def dispatch_send():
            state["h"] = buf.low_latency_dispatch(x, idx, tokens, EXPERTS, use_fp8=True, return_recv_hook=True)

        def combine_send():
            state["ch"] = buf.low_latency_combine(state["y"], idx, w, state["h"][2], return_recv_hook=True)

        t_disp, t_comb, t_call, t_hook = [], [], [], [[], [], [], []]
        for _ in range(iters + 10):
            t_disp += timed(dispatch, flush, 1, 0, barrier)
            t_comb += timed(combine, flush, 1, 0, barrier)
            t_call += timed(lambda: (dispatch(), combine()), flush, 1, 0, barrier, gpu_only=False)
            # Hook mode: the send and receive halves on their own (the receive after every
            # rank's send has finished, so it measures the copy-out alone).
            t_hook[0] += timed(dispatch_send, flush, 1, 0, barrier)
            t_hook[1] += timed(lambda: state["h"][4](), flush, 1, 0, barrier)
            t_hook[2] += timed(combine_send, flush, 1, 0, barrier)
            t_hook[3] += timed(lambda: state["ch"][2](), flush, 1, 0, barrier)
        t_disp, t_comb, t_call = t_disp[10:], t_comb[10:], t_call[10:]
        if trace:
            bd, ev_d, span_d = trace_breakdown(buf, dispatch, DISPATCH_POINTS, flush, barrier)
            bc, ev_c, span_c = trace_breakdown(buf, combine, COMBINE_POINTS, flush, barrier)
            mine = torch.tensor([ev_d, span_d, ev_c, span_c], device="cuda", dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine, group=nccl)
            if rank == 0:
                print(f"# rank 0, {tokens} tokens: phase times in the kernel (us since the first block started; "
                      f"min / median / max over blocks)")
                for title, names, b in (("dispatch", DISPATCH_POINTS, bd), ("combine", COMBINE_POINTS, bc)):
                    for name, (lo, med, hi) in zip(names, b):
                        print(f"  {title:9}{name:18}{lo:8.1f}{med:8.1f}{hi:8.1f}")
                print(f"# {tokens} tokens, each rank (median of its calls, us): the call's event time and the kernel's "
                      "span on its GPU (first block start to last timestamp)")
                print(f"{'rank':>6}{'dispatch event':>16}{'span':>8}{'combine event':>15}{'span':>8}")
                for r, v in enumerate(every):
                    e_d, s_d, e_c, s_c = v.tolist()
                    print(f"{r:>6}{e_d:16.1f}{s_d:8.1f}{e_c:15.1f}{s_c:8.1f}")
        t_hook = [t[10:] for t in t_hook]
        dist.barrier()
        # The all_to_all pipeline syncs with the host (split sizes), so it is timed end to end.
        t_a2a = timed(lambda: a2a_pipeline(x, idx, w, world, nccl), flush, max(20, iters // 5), 5, barrier,
                      gpu_only=False)
        sel = int((idx >= 0).sum())
        b2b = statistics.median(back_to_back(dispatch, combine, barrier) for _ in range(5))
        mc = mooncake_times(nccl, x, idx, w, tokens, world, flush, barrier, iters) if mooncake else (0.0, 0.0)
        dp = deepep_times(db, buf, x, idx, w, tokens, world, flush, barrier, iters) if deepep else (0.0,) * 4
        meds = torch.tensor([statistics.median(t_disp), statistics.median(t_comb), statistics.median(t_a2a),
                             statistics.median(t_call), b2b] + [statistics.median(t) for t in t_hook] + list(mc)
                            + list(dp), device="cuda")
        dist.all_reduce(meds, op=dist.ReduceOp.MAX, group=nccl)
        sel_t = torch.tensor([sel], device="cuda")
        dist.all_reduce(sel_t, group=nccl)
        d, c, a, call, b2b, *rest = meds.tolist()
        hook, mc, dp = rest[:4], rest[4:6], rest[6:]
        rows.append((tokens, d, c, a, call, int(sel_t) / world, hook, mc, b2b, dp))
        del buf
        torch.cuda.synchronize()
        dist.barrier()
    if db is not None:
        db.destroy()
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--tokens", default="128,256")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="ep.png")
    ap.add_argument("--trace", action="store_true", help="also print per-phase times from inside the kernels, and "
                    "each rank's event time beside its kernel's span and the launch floor (what events see "
                    "outside an empty kernel of the same launch shape: build/moelink_launch_bench)")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "..", "build"),
                    help="the build directory with moelink_launch_bench (--trace)")
    ap.add_argument("--mooncake", action="store_true",
                    help="also Mooncake's EP buffer on the same inputs (its wheel: pip install "
                         "mooncake-transfer-engine-cuda13; its kernels compile at the first call)")
    ap.add_argument("--deepep", action="store_true",
                    help="also DeepEP v1's low-latency buffer on the same inputs (import deep_ep), after checking "
                         "that both libraries agree")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    global EXPERTS
    EXPERTS = args.experts
    os.environ["EP_BENCH_EXPERTS"] = str(args.experts)
    rows = run_ranks(worker, args.gpus, (tokens, args.iters, args.trace, args.mooncake, args.deepep), timeout=1800)
    fp8_bytes, bf16_bytes = HIDDEN + HIDDEN // 128 * 4 + 16, HIDDEN * 2
    print(f"# EP{args.gpus}, hidden {HIDDEN}, top-{TOPK} of {EXPERTS} experts, FP8 dispatch / BF16 combine, "
          f"median of {args.iters} (slowest rank), {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'tokens':>7}{'dispatch us':>13}{'GB/s':>8}{'combine us':>12}{'GB/s':>8}{'d+c call us':>13}"
          f"{'a2a d+c us':>12}{'speed-up':>10}")
    for tok, d, c, a, call, sel, *_ in rows:
        print(f"{tok:>7}{d:13.1f}{sel * fp8_bytes / d / 1e3:8.1f}{c:12.1f}{sel * bf16_bytes / c / 1e3:8.1f}"
              f"{call:13.1f}{a:12.1f}{a / call:9.1f}x")
    print("dispatch/combine: GPU time of each call; d+c call: one dispatch + combine end to end (host launch "
          "overhead included), which the speed-up compares with the all_to_all pipeline (end to end)")
    print(f"{'tokens':>7}{'back to back us/pair':>22}{'GPU d+c us':>12}{'ratio':>8}")
    for tok, d, c, *_, b2b, _ in rows:
        print(f"{tok:>7}{b2b:22.1f}{d + c:12.1f}{b2b / (d + c):8.2f}")
    if args.deepep:
        print(f"{'tokens':>7}{'DeepEP dispatch us':>20}{'combine us':>12}{'d+c call':>10}{'back to back':>14}"
              f"{'moelink speed-up: dispatch':>28}{'combine':>9}{'back to back':>14}   (same inputs; results agree)")
        for tok, d, c, a, call, sel, hook, mc, b2b, dp in rows:
            print(f"{tok:>7}{dp[0]:20.1f}{dp[1]:12.1f}{dp[2]:10.1f}{dp[3]:14.1f}{dp[0] / d:27.2f}x{dp[1] / c:8.2f}x"
                  f"{dp[3] / b2b:13.2f}x")
    print(f"{'tokens':>7}{'hook: dispatch send':>21}{'recv':>7}{'combine send':>14}{'recv':>7}   (us)")
    for tok, d, c, a, call, sel, hook, *_ in rows:
        print(f"{tok:>7}{hook[0]:21.1f}{hook[1]:7.1f}{hook[2]:14.1f}{hook[3]:7.1f}")
    if args.mooncake:
        print(f"{'tokens':>7}{'Mooncake dispatch us':>22}{'combine us':>12}{'moelink dispatch':>18}{'combine':>9}"
              "   (GPU time of each call, same inputs)")
        for tok, d, c, a, call, sel, hook, mc, *_ in rows:
            print(f"{tok:>7}{mc[0]:22.1f}{mc[1]:12.1f}{mc[0] / d:17.2f}x{mc[1] / c:8.2f}x")
    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        labels = [str(r[0]) for r in rows]
        xs = range(len(rows))
        bars = [("moelink dispatch (FP8)", [r[1] for r in rows]), ("moelink combine (BF16)", [r[2] for r in rows])]
        if args.mooncake:
            bars += [("Mooncake dispatch (FP8)", [r[7][0] for r in rows]),
                     ("Mooncake combine (BF16)", [r[7][1] for r in rows])]
        if args.deepep:
            bars += [("DeepEP v1 dispatch (FP8)", [r[9][0] for r in rows]),
                     ("DeepEP v1 combine (BF16)", [r[9][1] for r in rows])]
        bars.append(("all_to_all_single d+c (NCCL, end to end)", [r[3] for r in rows]))
        width = 0.8 / len(bars)
        for j, (label, values) in enumerate(bars):
            ax.bar([i + (j - (len(bars) - 1) / 2) * width for i in xs], values, width, label=label)
        ax.set_yscale("log")
        ax.set_xticks(list(xs), labels)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("median latency (us)")
        ax.set_title(f"EP{args.gpus}, hidden {HIDDEN}, top-{TOPK}")
        ax.legend(fontsize=8)
        return fig

    save_plot(draw, args.out)
    if args.trace:
        print_launch_floor(args.build)


def print_launch_floor(build):
    """What CUDA events see outside a kernel that does nothing, launched as the EP kernels are (a
    block of 1024 threads per SM), timed as the trace times a call: the part of each rank's
    event time beyond its kernel's span that any kernel of that shape pays on this GPU."""
    if not os.path.exists(os.path.join(build, "moelink_launch_bench")):
        print(f"# launch floor: {build}/moelink_launch_bench not built (a CUDA build of the project has it)")
        return
    blocks, threads, _, event, span, outside = run_built(build, "moelink_launch_bench", ["--threads", 1024])[0].split()
    print(f"# launch floor, GPU 0: an empty kernel of {blocks} blocks x {threads} threads, timed as the trace times a "
          f"call: event {event} us, span {span} us, {outside} us outside the kernel")


if __name__ == "__main__":
    main()
