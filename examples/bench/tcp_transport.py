"""The tcp transport's own bandwidth over loopback, by number of streams: the ceiling that the
collectives' numbers over tcp (host route, CPU tensors) are read against.

    python examples/bench/tcp_transport.py [--streams 1,2,4,8] [--max-bytes 268435456] [--out tcp.png]
    python examples/bench/tcp_transport.py --rows 14336 --min-bytes 262144 --max-bytes 16777216 [--wave 262144]

Runs build/moelink_tcp_bench (two transfer engines in one process, tcp forced, listening on
127.0.0.1): for each number of streams (MOELINK_TCP_STREAMS: connections and progress threads per
peer) and write size, the median time of one write until its acknowledgement, one way and both
ways at once (each engine writing to the other; GB/s per direction). With --rows R the bytes go as
rows of R bytes into every other slot of the peer, then a signal, in one batch (what the EP CPU
proxy sends): in order (the first stream carries them) beside unordered (spread over the streams);
--wave W puts a signal after every W bytes of rows too, as the proxy's waves have theirs.
Prints the table and writes a PNG.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import fmt_bytes, run_built, save_plot  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--min-bytes", type=int, default=1 << 20)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rows", type=int, default=0, help="bytes per row (0: one write per size)")
    ap.add_argument("--wave", type=int, default=0, help="with --rows: a signal after every this many bytes of rows")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "..", "build"))
    ap.add_argument("--out", default="tcp_transport.png")
    args = ap.parse_args()
    lines = run_built(args.build, "moelink_tcp_bench", ["--streams", args.streams, "--min-bytes", args.min_bytes,
                                                         "--max-bytes", args.max_bytes, "--iters", args.iters,
                                                         "--rows", args.rows, "--wave", args.wave])
    rows = [(int(s), int(b), float(o), float(t)) for s, b, o, t in (line.split() for line in lines)]
    if args.rows:
        cols = ("in order", "unordered")
        signals = f"a signal after every {fmt_bytes(args.wave)} of them" if args.wave else "a signal"
        print(f"# tcp transport over loopback, {os.cpu_count()} cores: GB/s of a batch of {fmt_bytes(args.rows)} "
              f"rows and {signals} (median of up to {args.iters}), one way")
    else:
        cols = ("one way", "both ways")
        print(f"# tcp transport over loopback, {os.cpu_count()} cores: GB/s of one write (median of up to "
              f"{args.iters}), one way and each way while the peer writes back")
    print(f"{'streams':>8}{'size':>10}{cols[0]:>10}{cols[1]:>11}")
    for s, b, o, t in rows:
        print(f"{s:>8}{fmt_bytes(b):>10}{o:10.2f}{t:11.2f}")

    def draw(plt):
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
        titles = cols if args.rows else ("one way", "both ways (each)")
        for k, title in ((2, titles[0]), (3, titles[1])):
            a = ax[k - 2]
            for s in sorted({r[0] for r in rows}):
                r = [x for x in rows if x[0] == s]
                a.semilogx([x[1] for x in r], [x[k] for x in r], "o-", label=f"{s} stream(s)")
            a.set_title(title)
            a.set_xlabel(f"bytes per batch of {fmt_bytes(args.rows)} rows" if args.rows else "bytes per write")
            a.grid(True, which="both", alpha=0.3)
        ax[0].set_ylabel("GB/s")
        ax[0].legend()
        fig.suptitle("moelink tcp transport over loopback")
        return fig

    save_plot(draw, args.out)


if __name__ == "__main__":
    main()
