"""The EP CPU proxy's carrier over loopback tcp, without a GPU: a burst of token rows posted one
by one into the proxy's ring, from the first post until its signal lands in the peer's inbox,
beside the same rows handed to the transfer engine as one batch at once (the floor).

    python examples/bench/proxy_carrier.py [--streams 4,8] [--rows 64,128,256,512] [--row-bytes 7392]
                                           [--gap-us 0.5] [--iters 40] [--out proxy_carrier.png]

Runs build/moelink_proxy_bench (two transfer engines in one process, tcp forced, 127.0.0.1):
for each number of tcp streams and burst of rows (into every other row slot of the peer, then a
signal), the median time through ProxyCarrier (a thread posts a row every --gap-us, as the GPU's
warps post them) and as one unordered batch. 7392 bytes is an FP8 dispatch row with its scales,
14336 a BF16 combine row. The engines' tcp threads poll as the EP proxy's do
(MOELINK_EP_PROXY_TCP_SPIN_US; =0 for threads that sleep at once). Prints the table and writes a PNG.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import run_built, save_plot  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="4,8")
    ap.add_argument("--rows", default="64,128,256,512")
    ap.add_argument("--row-bytes", type=int, default=7392)
    ap.add_argument("--gap-us", type=float, default=0.5)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--build", default=os.path.join(HERE, "..", "..", "build"))
    ap.add_argument("--out", default="proxy_carrier.png")
    args = ap.parse_args()
    lines = run_built(args.build, "moelink_proxy_bench", ["--streams", args.streams, "--rows", args.rows,
                                                           "--row-bytes", args.row_bytes, "--gap-us", args.gap_us,
                                                           "--iters", args.iters])
    rows = [(int(s), int(n), int(b), float(g), float(c), float(o)) for s, n, b, g, c, o in (x.split() for x in lines)]
    print(f"# EP proxy carrier over loopback tcp, {os.cpu_count()} cores: {args.row_bytes}-byte rows posted "
          f"{args.gap_us} us apart, then a signal; us from the first post until the signal lands (median of "
          f"{args.iters})")
    print(f"{'streams':>8}{'rows':>6}{'KiB':>10}{'carrier us':>12}{'one batch us':>14}{'ratio':>7}")
    for s, n, b, _, c, o in rows:
        print(f"{s:>8}{n:>6}{round(n * b / 1024):>10}{c:12.1f}{o:14.1f}{c / o:7.2f}")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for s in sorted({r[0] for r in rows}):
            r = [x for x in rows if x[0] == s]
            ax.plot([x[1] for x in r], [x[4] for x in r], "o-", label=f"carrier, {s} streams")
            ax.plot([x[1] for x in r], [x[5] for x in r], "x--", label=f"one batch, {s} streams")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"{args.row_bytes}-byte rows in the burst")
        ax.set_ylabel("us until the signal lands")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.suptitle("moelink EP proxy carrier over loopback tcp")
        return fig

    save_plot(draw, args.out)


if __name__ == "__main__":
    main()
