"""The NVLink all-to-all ceiling of this host: the bandwidth each way of moving bytes between GPUs
reaches when every GPU sends the same amount to every other at once (the traffic of EP dispatch
and combine, of an all-to-all and of a collective's rounds), by SMs held. The EP and collective
tables in docs/PERF.md are read against it.

    python examples/bench/nvlink.py [--gpus 4] [--bytes 268435456] [--sms 4,8,12,16,24,32,48,64]

Runs build/moelink_nvlink_bench (examples/bench/nvlink_ceiling.cu: SM stores, SM loads, bulk
copies (TMA) and copy engines; one process drives every GPU). GB/s are per GPU and direction:
the bytes each GPU sends to its peers over the time until every GPU is done, median of --iters.
Prints the table and writes a PNG.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import fmt_bytes, run_built, save_plot  # noqa: E402

WAYS = {"store": "SM stores (push)", "load": "SM loads (pull)", "bulk": "bulk copies, TMA (push)",
        "ce": "copy engines (cudaMemcpyPeerAsync)"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=0, help="GPUs (default: all)")
    ap.add_argument("--bytes", type=int, default=256 << 20, help="bytes per (GPU, peer) pair")
    ap.add_argument("--sms", default="4,8,12,16,24,32,48,64")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--build", default=os.path.join(HERE, "..", "..", "build"))
    ap.add_argument("--out", default="nvlink.png")
    args = ap.parse_args()
    lines = run_built(args.build, "moelink_nvlink_bench", ["--gpus", args.gpus, "--bytes", args.bytes, "--sms",
                                                            args.sms, "--iters", args.iters])
    rows = [(w, int(n), float(g)) for w, n, g in (line.split() for line in lines)]
    counts = sorted({n for w, n, _ in rows if w != "ce"})
    print(f"# NVLink all-to-all, {fmt_bytes(args.bytes)} per pair: GB/s per GPU and direction (median of "
          f"{args.iters}), by SMs per GPU")
    print(f"{'way':36s}" + "".join(f"{n:>8d}" for n in counts))
    for w, title in WAYS.items():
        got = {n: g for ww, n, g in rows if ww == w}
        if w == "ce":
            print(f"{title:36s}{got[0]:8.1f}  (no SMs)")
        else:
            print(f"{title:36s}" + "".join(f"{got[n]:8.1f}" for n in counts))

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for w in ("store", "load", "bulk"):
            r = [x for x in rows if x[0] == w]
            ax.plot([x[1] for x in r], [x[2] for x in r], "o-", label=WAYS[w])
        ce = [x[2] for x in rows if x[0] == "ce"]
        if ce:
            ax.axhline(ce[0], color="gray", linestyle="--", label=WAYS["ce"] + ", no SMs")
        ax.set_xlabel("SMs per GPU")
        ax.set_ylabel("GB/s per GPU and direction")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"NVLink all-to-all, {fmt_bytes(args.bytes)} per pair")
        return fig

    save_plot(draw, args.out)


if __name__ == "__main__":
    main()
