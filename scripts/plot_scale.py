#!/usr/bin/env python3
"""Plots (and tabulates) the results of scripts/scale (bench_shard --json).

    python3 scripts/plot_scale.py SCALE_JSON OUT_PNG   # the plot (needs matplotlib)
    python3 scripts/plot_scale.py --table SCALE_JSON   # a text table (json only)

SCALE_JSON holds {"results": [...]} (scripts/scale merges them) or is one
`bench_shard --json` file. The plot has two panels against the number of ranks:
GB/s per GPU (forward streaming, training step, the pinned H2D link peak and
the NCCL all-gather of one record), and forward bandwidth per GPU as a
multiple of one link, with the ideal (= ranks) as a dashed line.
"""
import json
import sys


def load(path):
    with open(path) as f:
        doc = json.load(f)
    results = doc.get("results", [])
    return sorted(results, key=lambda r: r["ranks"])


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def table(results):
    cols = [
        ("ranks", "ranks", "d"),
        ("shard MiB", None, None),
        ("peak GB/s", "peak_h2d_gbps_per_gpu", ".2f"),
        ("all-gather GB/s", "allgather_gbps", ".1f"),
        ("forward GB/s/GPU", "forward_gbps_per_gpu", ".2f"),
        ("x link", "forward_ratio_to_peak", ".2f"),
        ("step ms", "train_step_ms", ".2f"),
        ("train GB/s/GPU", "train_gbps_per_gpu", ".2f"),
        ("step/bound", "train_ratio_to_bound", ".3f"),
    ]
    print("  ".join(f"{c[0]:>{max(len(c[0]), 6)}}" for c in cols))
    for r in results:
        cells = []
        for name, key, spec in cols:
            if key is None:
                v = format(r["shard_bytes"] / 2**20, ".1f")
            else:
                v = fmt(r.get(key), spec)
            cells.append(f"{v:>{max(len(name), 6)}}")
        print("  ".join(cells))


def plot(results, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r["ranks"] for r in results]

    def series(key):
        pts = [(r["ranks"], r.get(key)) for r in results if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, style in [
        ("forward_gbps_per_gpu", "forward streaming, per GPU", "o-"),
        ("train_gbps_per_gpu", "training step (2 x layers x record / step), per GPU", "s-"),
        ("peak_h2d_gbps_per_gpu", "pinned H2D peak of one link", "k--"),
        ("allgather_gbps", "NCCL all-gather of one record", "^-"),
    ]:
        x, y = series(key)
        if x:
            a.plot(x, y, style, label=label)
    a.set_xlabel("ranks (GPUs)")
    a.set_ylabel("GB/s")
    a.set_xticks(ranks)
    a.set_yscale("log")
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=8)
    rec = results[0]["record_bytes"] / 2**20 if results else 0
    a.set_title(f"sharded host weights, {rec:.0f} MiB records")

    x, y = series("forward_ratio_to_peak")
    b.plot(ranks, ranks, "k--", label="ideal: one link per rank")
    if x:
        b.plot(x, y, "o-", label="forward, per GPU / one link")
        for xi, yi in zip(x, y):
            b.annotate(f"{yi:.2f}x", (xi, yi), textcoords="offset points", xytext=(5, -12),
                       fontsize=8)
    b.set_xlabel("ranks (GPUs)")
    b.set_ylabel("x one link's peak")
    b.set_xticks(ranks)
    b.grid(True, alpha=0.3)
    b.legend(fontsize=8)
    b.set_title("effective bandwidth per GPU in links")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot_scale: wrote {out}", file=sys.stderr)


def main(argv):
    if len(argv) == 3 and argv[1] == "--table":
        table(load(argv[2]))
        return 0
    if len(argv) == 3:
        results = load(argv[1])
        if not results:
            print(f"plot_scale: {argv[1]}: no results", file=sys.stderr)
            return 1
        plot(results, argv[2])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
