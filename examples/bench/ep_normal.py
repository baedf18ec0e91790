"""EP normal mode (training / prefill): moelink vs DeepEP v1 vs an all_to_all_single pipeline.

    python examples/bench/ep_normal.py [--gpus 2] [--tokens 4096] [--hidden 7168] [--experts 256]
                                       [--topk 8] [--sms 24] [--dispatch-chunks 4,8,...] [--combine-chunks 2,4,...]
                                       [--rings 256] [--deepep] [--sm-sweep 4,8,12,16,24]
                                       [--out ep_normal.png]

One process per GPU. Routing as DeepEP's tests/test_intranode.py draws it (top-8 of 256 by
random scores); timings and bandwidth counted as that test counts them: dispatch and combine
repeat the layout of a first dispatch (``handle=``), CUDA events around each call, L2 flushed
once before the timed calls, average over `iters` calls (median printed beside it);
bandwidth = the bytes this rank receives in bf16 (``recv_x.numel() * 2``; FP8 counts
``(1 + 4/128) / 2`` of that) over the time, and combine the same bytes sent back. Both
libraries are tuned over the same NVL chunk sizes with the same SM count; the best of each
is reported, and the slowest rank's time counts. The all_to_all_single pipeline moves the
same rows over NCCL (each token once per destination rank; counts exchanged first for
dispatch, as a layer must) and sums them back with index_add.

``--sm-sweep`` runs every op again at each of the given SM counts (both libraries, the same
chunk sweep) and prints how many SMs each op needs to reach 90% of its best bandwidth.

``--deepep`` runs DeepEP v1 (``import deep_ep``) in the same processes; without it, or
where it is not importable, its rows are skipped.

``--ranks-per-host L`` makes hosts of L ranks (virtual hosts: ``MOELINK_EP_RANKS_PER_HOST`` and
``MOELINK_RANKS_PER_HOST`` L, a ``MOELINK_HOST_ID`` per host), so that moelink takes its two-hop
route (the host hop over tcp, the local hop over NVLink) and the all_to_all_single pipeline
runs over NCCL's socket transport (4 x 4 sockets), as between real hosts; DeepEP v1's
internode mode needs RDMA, so its rows are skipped there. The two-hop combine rounds the local
sums to bf16 once (as DeepEP's internode combine does), so its check against the pipeline
allows bf16 rounding.
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
from common import NCCL_SOCKET, run_ranks, save_plot, virtual_host  # noqa: E402


def bench(fn, flush, iters=50, warmup=20):
    """(average, median) seconds of back-to-back calls, as DeepEP's tests/utils.py bench."""
    torch.cuda.synchronize()
    for _ in range(warmup):
        fn()
    flush.zero_()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    t = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)][1:]
    return sum(t) / len(t), statistics.median(t)


def per_token_fp8(x):
    """e4m3 with one float scale per 128 values (DeepEP's per_token_cast_to_fp8)."""
    t, h = x.shape
    xv = x.float().view(t, h // 128, 128)
    amax = xv.abs().amax(-1).clamp(min=1e-4)
    q = (xv * (448.0 / amax.unsqueeze(-1))).to(torch.float8_e4m3fn).view(t, h)
    return q, (amax / 448.0).contiguous()


def worker(rank, world, port, args, q):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    L = args.ranks_per_host
    if L:
        os.environ.update(NCCL_SOCKET, MOELINK_EP_RANKS_PER_HOST=str(L), MOELINK_RANKS_PER_HOST=str(L))
        virtual_host(rank, L)
    torch.cuda.set_device(rank)
    import moelink

    dist.init_process_group("ep", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    nccl = dist.new_group(backend="nccl", device_id=torch.device("cuda", rank))
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    torch.manual_seed(rank)
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
    x_fp8 = per_token_fp8(x)
    scores = torch.randn(T, E, device="cuda").abs() + 1
    idx = torch.topk(scores, K, dim=-1, sorted=False)[1].to(torch.int64)
    w = torch.rand(T, K, device="cuda")

    def slowest(v):
        t = torch.tensor([v], dtype=torch.float64, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=nccl)
        return float(t)

    rows, sweep = [], []
    sm_counts = [int(n) for n in args.sm_sweep.split(",")] if args.sm_sweep else []

    def tune(lib, name, run, make_config, chunks, nbytes, sms=None):
        best = None
        for c in chunks:
            avg, med = bench(lambda: run(make_config(c)), flush)  # noqa: B023
            avg, med = slowest(avg), slowest(med)
            if best is None or avg < best[0]:
                best = (avg, med, c)
        if sms is None:
            rows.append((name, lib, best[0] * 1e6, best[1] * 1e6, nbytes / 1e9 / best[0], best[2]))
        else:
            sweep.append((name, lib, sms, nbytes / 1e9 / best[0], best[2]))
        if rank == 0:
            print(f"  [{time.time() - t_start:5.1f} s] {name:14s} {lib:10s} {'' if sms is None else f'{sms:2d} SMs '}"
                  f"{best[0] * 1e6:9.1f} us  {nbytes / 1e9 / best[0]:7.1f} GB/s  chunk, ring {best[2]}", flush=True)

    def sm_sweep(lib, make_handle, dispatch, combine, make_config, fp8_x):
        """The three ops at each SM count of --sm-sweep, each tuned over the same chunks."""
        for n in sm_counts:
            mk = lambda c, n=n: make_config(n, c)  # noqa: E731
            h = make_handle(n)
            tune(lib, "dispatch FP8", lambda cfg: dispatch(fp8_x, h, cfg), mk, disp_chunks,  # noqa: B023
                 bf16_bytes * fp8_factor, n)
            tune(lib, "dispatch BF16", lambda cfg: dispatch(x, h, cfg), mk, disp_chunks, bf16_bytes, n)  # noqa: B023
            tune(lib, "combine BF16", lambda cfg: combine(h, cfg), mk, comb_chunks, bf16_bytes, n)  # noqa: B023

    fp8_factor = (1 + 4 / 128) / 2
    rings = [int(r) for r in args.rings.split(",")]
    disp_chunks = tuple((int(c), r) for r in rings for c in args.dispatch_chunks.split(","))
    comb_chunks = tuple((int(c), r) for r in rings for c in args.combine_chunks.split(","))
    t_start = time.time()

    # moelink
    moelink.Buffer.set_num_sms(args.sms)
    buf = moelink.Buffer(None, 128, H, E)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout_t = bench(lambda: buf.get_dispatch_layout(idx, E), flush)[0]
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw)
    route = buf._normal_path(x.device)
    assert route == ("two_hop" if L else "nvlink"), route
    bf16_bytes = recv_x.numel() * 2
    full_t = bench(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw), flush)[0]
    mcfg = lambda c: moelink.Config(args.sms, c[0], c[1])  # noqa: E731
    tune("moelink", "dispatch FP8", lambda cfg: buf.dispatch(x_fp8, handle=handle, config=cfg), mcfg, disp_chunks,
         bf16_bytes * fp8_factor)
    tune("moelink", "dispatch BF16", lambda cfg: buf.dispatch(x, handle=handle, config=cfg), mcfg, disp_chunks,
         bf16_bytes)
    tune("moelink", "combine BF16", lambda cfg: buf.combine(recv_x, handle, config=cfg), mcfg, comb_chunks, bf16_bytes)
    rows.append(("dispatch BF16 + layout exchange", "moelink", slowest(full_t) * 1e6, 0, bf16_bytes / 1e9 / full_t, "-"))
    rows.append(("get_dispatch_layout", "moelink", slowest(layout_t) * 1e6, 0, 0, "-"))
    # the correctness of what was timed, against the pipeline below (same routing)
    combined = buf.combine(recv_x, handle)[0]
    if sm_counts:
        def m_handle(n):
            return buf.dispatch(x, topk_idx=idx, topk_weights=w, config=moelink.Config(n, 8, 256), **kw)[4]

        sm_sweep("moelink", m_handle, lambda d, h, cfg: buf.dispatch(d, handle=h, config=cfg),
                 lambda h, cfg: buf.combine(recv_x, h, config=cfg), lambda n, c: moelink.Config(n, c[0], c[1]), x_fp8)

    # all_to_all_single over NCCL
    tok_of = in_rank.t().nonzero()[:, 1]
    send_counts = in_rank.sum(0).to(torch.int64)

    def a2a_dispatch():
        rc = torch.empty_like(send_counts)
        dist.all_to_all_single(rc, send_counts, group=nccl)
        out = torch.empty(int(rc.sum()), H, dtype=torch.bfloat16, device="cuda")
        dist.all_to_all_single(out, x[tok_of], rc.tolist(), send_counts.tolist(), group=nccl)
        return out, rc

    got, rc = a2a_dispatch()
    rc_l, sc_l = rc.tolist(), send_counts.tolist()

    def a2a_combine():
        back = torch.empty(len(tok_of), H, dtype=torch.bfloat16, device="cuda")
        dist.all_to_all_single(back, got, sc_l, rc_l, group=nccl)
        out = torch.zeros(T, H, dtype=torch.float32, device="cuda")
        out.index_add_(0, tok_of, back.float())
        return out.to(torch.bfloat16)

    ref = a2a_combine()
    ok = torch.allclose(combined.float(), ref.float(), rtol=1e-2, atol=1e-2) if L else torch.equal(combined, ref)
    t = bench(a2a_dispatch, flush)[0]
    rows.append(("dispatch BF16", "all_to_all_single", slowest(t) * 1e6, 0, bf16_bytes / 1e9 / slowest(t), "-"))
    t = bench(a2a_combine, flush)[0]
    rows.append(("combine BF16", "all_to_all_single", slowest(t) * 1e6, 0, bf16_bytes / 1e9 / slowest(t), "-"))

    # DeepEP v1
    note = ""
    if args.deepep and L:
        note = "DeepEP v1 across hosts needs RDMA (its internode mode): its rows are skipped"
    elif args.deepep:
        try:
            import deep_ep
        except ImportError as e:
            deep_ep = None
            note = f"DeepEP not importable ({e}): its rows are skipped"
        if deep_ep is not None:
            deep_ep.Buffer.set_num_sms(args.sms)  # the handle's channel count must match the tuned configs'
            dbuf = deep_ep.Buffer(nccl, int(1e9), 0)
            d_per_rank, _, d_per_expert, d_in_rank, _ = dbuf.get_dispatch_layout(idx, E)
            d_recv, _, _, _, d_handle, _ = dbuf.dispatch(x, num_tokens_per_rank=d_per_rank,
                                                         is_token_in_rank=d_in_rank,
                                                         num_tokens_per_expert=d_per_expert, topk_idx=idx,
                                                         topk_weights=w)
            assert torch.equal(d_recv, recv_x), "DeepEP and moelink received different rows"
            d_fp8 = (x_fp8[0], x_fp8[1].T.contiguous().T)  # DeepEP takes column-major scales
            dcfg = lambda c: deep_ep.Config(args.sms, c[0], c[1])  # noqa: E731
            tune("DeepEP v1", "dispatch FP8", lambda cfg: dbuf.dispatch(d_fp8, handle=d_handle, config=cfg), dcfg,
                 disp_chunks, bf16_bytes * fp8_factor)
            tune("DeepEP v1", "dispatch BF16", lambda cfg: dbuf.dispatch(x, handle=d_handle, config=cfg), dcfg,
                 disp_chunks, bf16_bytes)
            tune("DeepEP v1", "combine BF16", lambda cfg: dbuf.combine(d_recv, d_handle, config=cfg), dcfg,
                 comb_chunks, bf16_bytes)
            d_comb = dbuf.combine(d_recv, d_handle)[0]
            torch.testing.assert_close(d_comb.float(), combined.float(), rtol=1e-2, atol=1e-2)
            if sm_counts:
                def d_handle_of(n):
                    deep_ep.Buffer.set_num_sms(n)
                    return dbuf.dispatch(x, num_tokens_per_rank=d_per_rank, is_token_in_rank=d_in_rank,
                                         num_tokens_per_expert=d_per_expert, topk_idx=idx, topk_weights=w,
                                         config=deep_ep.Config(n, 8, 256))[4]

                sm_sweep("DeepEP v1", d_handle_of, lambda d, h, cfg: dbuf.dispatch(d, handle=h, config=cfg),
                         lambda h, cfg: dbuf.combine(d_recv, h, config=cfg), lambda n, c: deep_ep.Config(n, c[0], c[1]),
                         d_fp8)
    if rank == 0:
        q.put((rows, sweep, ok, note, bf16_bytes))
    dist.barrier(group=nccl)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--dispatch-chunks", default="4,8,12,16,20,24,28,32", help="NVL send chunk sizes to tune over")
    ap.add_argument("--combine-chunks", default="2,4,6,8,10,12,14,16")
    ap.add_argument("--rings", default="256", help="NVL ring sizes (num_max_nvl_chunked_recv_tokens) to tune over")
    ap.add_argument("--deepep", action="store_true", help="also run DeepEP v1 (import deep_ep)")
    ap.add_argument("--sm-sweep", default="", help="SM counts (e.g. 4,8,12,16,24) to run every op at as well")
    ap.add_argument("--ranks-per-host", type=int, default=0,
                    help="virtual hosts of this many ranks: moelink's two-hop route beside the pipeline over "
                         "NCCL's socket transport")
    ap.add_argument("--out", default="ep_normal.png")
    args = ap.parse_args()
    if args.gpus < 2:
        sys.exit("needs at least 2 GPUs")
    if args.ranks_per_host and (args.ranks_per_host < 2 or args.gpus % args.ranks_per_host or
                                args.gpus // args.ranks_per_host < 2):
        sys.exit("--ranks-per-host: at least 2 ranks per host and at least 2 hosts, dividing --gpus")
    rows, sweep, ok, note, nbytes = run_ranks(worker, args.gpus, (args,), timeout=900)
    across = (f", {args.gpus // args.ranks_per_host} virtual hosts of {args.ranks_per_host} (moelink's two-hop "
              f"route; the pipeline over NCCL's socket transport)" if args.ranks_per_host else "")
    print(f"EP normal mode, {args.gpus} GPUs{across}: {args.tokens} tokens/rank, hidden {args.hidden}, top-{args.topk} "
          f"of {args.experts}, {args.sms} SMs; rank 0 receives {nbytes / 1e6:.1f} MB (bf16)")
    if note:
        print(note)
    print(f"combine result equals the all_to_all_single pipeline's{' (to bf16 rounding)' if args.ranks_per_host else ''}:"
          f" {ok}")
    print(f"{'op':34s} {'impl':18s} {'avg us':>9s} {'med us':>9s} {'GB/s':>8s}  (chunk, ring)")
    for name, lib, avg, med, gbs, chunk in rows:
        print(f"{name:34s} {lib:18s} {avg:9.1f} {med:9.1f} {gbs:8.1f}  {chunk}")

    ops = ["dispatch FP8", "dispatch BF16", "combine BF16"]
    sweep_libs = [lib for lib in ("moelink", "DeepEP v1") if any(r[1] == lib for r in sweep)]
    if sweep:
        counts = sorted({r[2] for r in sweep})
        print("\nSM sweep: GB/s (best chunk, ring) at each SM count; 90%: the fewest SMs within 90% of the op's best")
        print(f"{'op':14s} {'impl':10s} " + " ".join(f"{str(n) + ' SMs':>9s}" for n in counts) + f" {'90%':>5s}")
        for op in ops:
            for lib in sweep_libs:
                got = {r[2]: r for r in sweep if r[0] == op and r[1] == lib}
                best = max(r[3] for r in got.values())
                need = min(n for n in counts if got[n][3] >= 0.9 * best)
                print(f"{op:14s} {lib:10s} " + " ".join(f"{got[n][3]:9.1f}" for n in counts) + f" {need:5d}")
                print(f"{'':25s} " + " ".join(f"{str(got[n][4]):>9s}" for n in counts))

    def draw(plt):
        libs = [lib for lib in ("moelink", "DeepEP v1", "all_to_all_single") if any(r[1] == lib for r in rows)]
        fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 7, 4))
        ax = axes[0] if sweep else axes
        width = 0.8 / len(libs)
        for i, lib in enumerate(libs):
            vals = [next((r[4] for r in rows if r[0] == op and r[1] == lib), 0) for op in ops]
            ax.bar([j + i * width for j in range(len(ops))], vals, width, label=lib)
        ax.set_xticks([j + width * (len(libs) - 1) / 2 for j in range(len(ops))])
        ax.set_xticklabels(ops)
        ax.set_ylabel("GB/s (NVL bytes, DeepEP's count)")
        hosts = f" as {args.gpus // args.ranks_per_host} hosts" if args.ranks_per_host else ""
        ax.set_title(f"EP normal mode, {args.gpus} GPUs{hosts}, {args.tokens} tokens, hidden {args.hidden}")
        ax.legend()
        if sweep:
            ax = axes[1]
            for op, mark in zip(ops, "os^"):
                for lib, style in zip(sweep_libs, ("-", "--")):
                    pts = sorted((r[2], r[3]) for r in sweep if r[0] == op and r[1] == lib)
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=mark, label=f"{op}, {lib}")
            ax.set_xlabel("SMs")
            ax.set_ylabel("GB/s")
            ax.set_title("by SM count")
            ax.legend(fontsize=7)
        return fig

    save_plot(draw, args.out)


if __name__ == "__main__":
    main()
