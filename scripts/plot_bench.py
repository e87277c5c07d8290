#!/usr/bin/env python3
"""Plots (and tabulates) the JSON that scripts/bench writes.

    python3 scripts/plot_bench.py INDIR OUTDIR   # PNG plots (needs matplotlib)
    python3 scripts/plot_bench.py --table INDIR  # text tables (json only)

INDIR holds bench_copy.json, bench_ring.json, bench_workloads.json,
bench_host.json, bench_quant.json and bench_plan.json (Google Benchmark JSON,
--benchmark_out_format=json); missing
files are skipped with a note. Plots written to OUTDIR:

    ring_bandwidth.png   ring streaming GB/s against ring depth, one line per
                         record size, the pinned H2D peak as a horizontal line
                         (the PCIe saturation curve)
    workload_ratios.png  streamed time / bound per workload, with the 1.03
                         target line (green: within the workload's own target)
    copy_bandwidth.png   copy GB/s by size: pinned / registered / pageable,
                         H2D / D2H / both at once
    host_overhead.png    host microseconds per layer, with the 5 us target
"""
import json
import os
import re
import sys

FILES = {
    "copy": "bench_copy.json",
    "ring": "bench_ring.json",
    "workloads": "bench_workloads.json",
    "host": "bench_host.json",
    "quant": "bench_quant.json",
    "plan": "bench_plan.json",
}
RATIO_TARGET = 1.03
HOST_TARGET_US = 5.0


# --- reading ------------------------------------------------------------------

def load(indir, key):
    path = os.path.join(indir, FILES[key])
    if not os.path.exists(path):
        print(f"plot_bench: {path}: not found, skipped", file=sys.stderr)
        return None
    with open(path) as f:
        return json.load(f)


def label(bench):
    """The benchmark's name without Google Benchmark's suffixes."""
    name = bench.get("run_name") or bench.get("name", "?")
    name = re.sub(r"/(iterations:\d+|manual_time|real_time|min_time:[^/]+)", "", name)
    return name


def arg(name, key):
    m = re.search(r"(?:^|/)" + re.escape(key) + r":(\d+)", name)
    return int(m.group(1)) if m else None


def runs(doc):
    """Iteration entries only (no aggregates), in file order."""
    if not doc:
        return []
    return [b for b in doc.get("benchmarks", [])
            if b.get("run_type", "iteration") == "iteration"]


def failed(b):
    return bool(b.get("error_occurred") or b.get("skipped"))


def message(b):
    return b.get("error_message") or b.get("skip_message") or ""


def context_float(doc, key):
    try:
        return float(doc.get("context", {}).get(key))
    except (TypeError, ValueError):
        return None


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g}"


# --- the data of each program -------------------------------------------------

def copy_rows(doc):
    """{(memory, direction): {bytes: GB/s}}"""
    out = {}
    for b in runs(doc):
        parts = label(b).split("/")
        if len(parts) < 3 or failed(b):
            continue
        size = int(b.get("bytes") or arg(label(b), "bytes") or 0)
        out.setdefault((parts[1], parts[2]), {})[size] = b.get("GB/s", 0.0)
    return out


def ring_rows(doc):
    """{record_MiB: {depth: (GB/s, share)}}, and errors [(label, message)]"""
    out, errors = {}, []
    for b in runs(doc):
        name = label(b)
        if failed(b):
            errors.append((name, message(b)))
            continue
        rec = int(b.get("record_MiB") or arg(name, "record_MiB"))
        depth = int(b.get("depth") or arg(name, "depth"))
        out.setdefault(rec, {})[depth] = (b.get("GB/s", 0.0), b.get("share_of_peak", 0.0))
    return out, errors


def workload_rows(doc):
    rows = []
    for b in runs(doc):
        rows.append((label(b), b))
    return rows


# --- tables -------------------------------------------------------------------

def table_copy(doc):
    data = copy_rows(doc)
    if not data:
        return
    peak = context_float(doc, "lwo_h2d_peak_gbps")
    cols = [(m, d) for m in ("pinned", "registered", "pageable") for d in ("h2d", "d2h", "both")]
    cols = [c for c in cols if c in data]
    sizes = sorted({s for v in data.values() for s in v})
    print("copy bandwidth, GB/s (1e9 B/s), median of the batches"
          + (f"; pinned H2D peak {peak:.2f} GB/s" if peak else ""))
    short = {"pinned": "pin", "registered": "reg", "pageable": "page"}
    print(f"{'size':>10} " + " ".join(f"{short[m] + ' ' + d:>10}" for m, d in cols))
    for s in sizes:
        cells = []
        for c in cols:
            v = data[c].get(s)
            cells.append(f"{v:10.2f}" if v is not None else f"{'-':>10}")
        print(f"{fmt_bytes(s):>10} " + " ".join(cells))
    print()


def table_ring(doc):
    data, errors = ring_rows(doc)
    if not data and not errors:
        return
    peak = context_float(doc, "lwo_h2d_peak_gbps")
    recs = sorted(data)
    depths = sorted({d for v in data.values() for d in v})
    print("ring streaming, GB/s and share of the pinned H2D peak"
          + (f" ({peak:.2f} GB/s)" if peak else "")
          + "; target >= 97% for records >= 16 MiB at depth >= 2")
    print(f"{'depth':>5} " + " ".join(f"{str(r) + ' MiB':>16}" for r in recs))
    for d in depths:
        cells = []
        for r in recs:
            v = data[r].get(d)
            if v is None:
                cells.append(f"{'-':>16}")
            else:
                miss = r >= 16 and d >= 2 and v[1] < 0.97
                cells.append(f"{v[0]:7.2f} {100 * v[1]:6.1f}%" + ("!" if miss else " "))
        print(f"{d:>5} " + " ".join(cells))
    for name, msg in errors:
        print(f"  {name}: ERROR {msg}")
    print("  (! = below the 97% target)\n")


def table_workloads(doc):
    rows = workload_rows(doc)
    if not rows:
        return
    h2d = context_float(doc, "lwo_h2d_peak_gbps")
    d2h = context_float(doc, "lwo_d2h_peak_gbps")
    print("workloads: medians in ms; bound = max(resident, H2D bytes / H2D peak, D2H bytes / "
          "D2H peak)" + (f"; peaks H2D {h2d:.2f}, D2H {d2h:.2f} GB/s" if h2d and d2h else ""))
    width = max(len(n) for n, _ in rows)
    print(f"{'workload':<{width}} {'streamed':>9} {'resident':>9} {'H2D@pk':>8} {'D2H@pk':>8} "
          f"{'bound':>9} {'by':>4} {'ratio':>6} {'target':>6} {'met':>4} {'vs res':>6} {'same':>4}")
    by = {0: "gpu", 1: "h2d", 2: "d2h"}
    for name, b in rows:
        if failed(b):
            print(f"{name:<{width}} ERROR/SKIPPED: {message(b)}")
            continue
        extra = ""
        if "resident_target" in b:
            extra = (f"  (streamed/resident {b['streamed_over_resident']:.3f}, target "
                     f"<= {b['resident_target']:.2f}: "
                     f"{'met' if b.get('resident_met') else 'NOT met'})")
        print(f"{name:<{width}} {b['streamed_ms']:9.3f} {b['resident_ms']:9.3f} "
              f"{b['h2d_ms_at_peak']:8.3f} {b['d2h_ms_at_peak']:8.3f} {b['bound_ms']:9.3f} "
              f"{by.get(int(b['bound_by']), '?'):>4} {b['ratio']:6.3f} {b['target']:6.2f} "
              f"{'yes' if b['met'] else 'NO':>4} {b['streamed_over_resident']:6.3f} "
              f"{'yes' if b['matches_resident'] else 'NO':>4}{extra}")
    print()


def table_host(doc):
    rows = runs(doc)
    if not rows:
        return
    print(f"host cost per layer, microseconds (target <= {HOST_TARGET_US:g})")
    width = max(len(label(b)) for b in rows)
    print(f"{'calls':<{width}} {'mean':>7} {'median':>7}")
    for b in rows:
        if failed(b):
            print(f"{label(b):<{width}} ERROR: {message(b)}")
            continue
        print(f"{label(b):<{width}} {b['us_per_layer']:7.2f} {b['us_per_layer_median']:7.2f}")
    print()


QUANT_FORMATS = ("fp8", "fp8_block", "int8", "int4")


def table_quant(doc):
    """bench_quant: each format's speed-up over bf16 (T=1024), and the
    dequantization's share of a compute-bound step (T=16384)."""
    rows = runs(doc)
    if not rows:
        return
    print("quantized weights: speed-up over bf16 in the same run (targets: fp8, int8 >= 1.9x;"
          " int4 >= 3.5x), and dequantization's share of the step (target <= 3%)")
    width = max(len(label(b)) for b in rows)
    print(f"{'benchmark':<{width}} {'bf16 ms':>8} " + " ".join(f"{f:>16}" for f in QUANT_FORMATS))
    for b in rows:
        if failed(b):
            print(f"{label(b):<{width}} ERROR: {message(b)}")
            continue
        cells = []
        if "dequant_share" in label(b):
            for f in QUANT_FORMATS:
                v = b.get(f + "_share")
                ok = b.get(f + "_share_met", 0) and b.get(f + "_matches_resident", 0)
                cells.append(f"{100 * v:14.2f}%" + (" " if ok else "!") if v is not None
                             else f"{'-':>16}")
            print(f"{label(b):<{width}} {'':>8} " + " ".join(cells))
            # The step's dequantizations alone (no GEMMs), as a share of the step.
            kern = [b.get(f + "_kernels_share") for f in QUANT_FORMATS]
            if any(v is not None for v in kern):
                cells = [f"{100 * v:14.2f}% " if v is not None else f"{'-':>16}" for v in kern]
                print(f"{'  (the kernels alone)':<{width}} {'':>8} " + " ".join(cells))
        else:
            for f in QUANT_FORMATS:
                v = b.get(f + "_speedup")
                ok = b.get(f + "_met", 0)
                cells.append(f"{v:8.2f}x {b.get(f + '_ms', 0):5.1f}ms" + (" " if ok else "!")
                             if v is not None else f"{'-':>16}")
            print(f"{label(b):<{width}} {b.get('bf16_ms', 0):8.2f} " + " ".join(cells))
    print()


def table_plan(doc):
    """bench_plan: the planner's predicted pass against the measured one."""
    rows = runs(doc)
    if not rows:
        return
    print("the planner: predicted against measured, the plan's own ring and residents "
          "(target |error| <= 5%)")
    width = max(len(label(b)) for b in rows)
    print(f"{'benchmark':<{width}} {'depth':>5} {'res':>4} {'predicted':>10} {'measured':>10} "
          f"{'error':>8} {'H2D pred':>10} {'H2D meas':>10} {'stall pr':>9} {'stall ms':>9}")
    for b in rows:
        if failed(b):
            print(f"{label(b):<{width}} ERROR: {message(b)}")
            continue
        ok = b.get("met", 0) and b.get("matches_resident", 0)
        stall = b.get("stall_measured_ms")
        print(f"{label(b):<{width}} {int(b.get('depth', 0)):5d} {int(b.get('n_resident', 0)):4d} "
              f"{b.get('predicted_ms', 0):10.3f} {b.get('measured_ms', 0):10.3f} "
              f"{100 * b.get('error', 0):+7.2f}%{' ' if ok else '!'}"
              f"{fmt_bytes(b.get('h2d_bytes_predicted', 0)):>10} "
              f"{fmt_bytes(b.get('h2d_bytes_measured', 0)):>10} "
              f"{b.get('stall_predicted_ms', 0):9.3f} "
              + (f"{stall:9.3f}" if stall is not None else f"{'-':>9}"))
    print()


def tables(indir):
    table_copy(load(indir, "copy"))
    table_ring(load(indir, "ring"))
    table_workloads(load(indir, "workloads"))
    table_host(load(indir, "host"))
    table_quant(load(indir, "quant"))
    table_plan(load(indir, "plan"))


# --- plots --------------------------------------------------------------------

def plot_ring(plt, doc, path):
    data, _ = ring_rows(doc)
    if not data:
        return False
    peak = context_float(doc, "lwo_h2d_peak_gbps")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rec in sorted(data):
        depths = sorted(data[rec])
        ax.plot(depths, [data[rec][d][0] for d in depths], marker="o", label=f"{rec} MiB records")
    if peak:
        ax.axhline(peak, color="black", linestyle="--", linewidth=1,
                   label=f"pinned H2D peak {peak:.1f} GB/s")
        ax.axhline(0.97 * peak, color="gray", linestyle=":", linewidth=1, label="97% of peak")
    ax.set_xlabel("ring depth (slots)")
    ax.set_ylabel("GB/s (1e9 B/s)")
    ax.set_title("Ring streaming bandwidth, checksum consumer reading every byte")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_workloads(plt, doc, path):
    rows = workload_rows(doc)
    if not rows:
        return False
    names = [n for n, _ in rows]
    ratios = [0.0 if failed(b) else b.get("ratio", 0.0) for _, b in rows]
    colors = []
    for _, b in rows:
        if failed(b):
            colors.append("lightgray")
        else:
            colors.append("tab:green" if b.get("met") else "tab:red")
    fig, ax = plt.subplots(figsize=(8, 0.38 * len(rows) + 1.5))
    y = list(range(len(rows)))
    ax.barh(y, ratios, color=colors)
    for i, (_, b) in enumerate(rows):
        text = "skipped: " + message(b) if failed(b) else f"{ratios[i]:.3f}"
        ax.text(max(ratios[i], 0) + 0.01, i, text, va="center", fontsize=7)
    ax.axvline(RATIO_TARGET, color="black", linestyle="--", linewidth=1,
               label=f"target {RATIO_TARGET}")
    ax.axvline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("streamed time / max(resident, H2D bytes / peak, D2H bytes / peak)")
    ax.set_title("Streamed against the bound, per workload")
    top = max([r for r in ratios] + [RATIO_TARGET])
    ax.set_xlim(0, top * 1.25)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_copy(plt, doc, path):
    data = copy_rows(doc)
    if not data:
        return False
    peak = context_float(doc, "lwo_h2d_peak_gbps")
    colors = {"pinned": "tab:blue", "registered": "tab:orange", "pageable": "tab:red"}
    styles = {"h2d": "-", "d2h": "--", "both": ":"}
    fig, ax = plt.subplots(figsize=(7.5, 5.8))
    order = [(m, d) for m in colors for d in styles]
    for key in order + sorted(k for k in data if k not in order):
        if key not in data:
            continue
        mem, d = key
        v = data[key]
        sizes = sorted(v)
        ax.plot(sizes, [v[s] for s in sizes], marker="o", markersize=3,
                color=colors.get(mem, "black"), linestyle=styles.get(d, "-"),
                label=f"{mem} {d.upper() if d != 'both' else 'both at once (sum)'}")
    if peak:
        ax.axhline(peak, color="black", linestyle="-.", linewidth=1,
                   label=f"pinned H2D peak {peak:.1f} GB/s")
    ax.set_xscale("log", base=2)
    sizes = sorted({s for v in data.values() for s in v})
    ax.set_xticks(sizes)
    ax.set_xticklabels([fmt_bytes(s) for s in sizes], fontsize=8)
    ax.set_xlabel("copy size")
    ax.set_ylabel("GB/s (1e9 B/s)")
    ax.set_title("Host <-> device copy bandwidth by host memory kind")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_host(plt, doc, path):
    rows = [b for b in runs(doc) if not failed(b)]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1.5))
    y = list(range(len(rows)))
    vals = [b["us_per_layer"] for b in rows]
    ax.barh(y, vals, color=["tab:green" if v <= HOST_TARGET_US else "tab:red" for v in vals])
    for i, v in enumerate(vals):
        ax.text(v + 0.05, i, f"{v:.2f}", va="center", fontsize=7)
    ax.axvline(HOST_TARGET_US, color="black", linestyle="--", linewidth=1,
               label=f"target {HOST_TARGET_US:g} us")
    ax.set_yticks(y)
    ax.set_yticklabels([label(b) for b in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("host microseconds per layer")
    ax.set_title("Host cost of the streaming calls (4 KiB records)")
    ax.set_xlim(0, max(vals + [HOST_TARGET_US]) * 1.25)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_quant(plt, doc, path):
    """bench_quant: speed-up over bf16 per format (T=1024, transfer-bound) with the
    targets, and the dequantization's share of a compute-bound step (T=16384)."""
    rows = [b for b in runs(doc) if not failed(b)]
    speed = [b for b in rows if "dequant_share" not in label(b)]
    share = [b for b in rows if "dequant_share" in label(b)]
    if not speed and not share:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(QUANT_FORMATS)
    for k, f in enumerate(QUANT_FORMATS):
        xs = [i + (k - (len(QUANT_FORMATS) - 1) / 2) * width for i in range(len(speed))]
        ax1.bar(xs, [b.get(f + "_speedup", 0) for b in speed], width, label=f)
    ax1.axhline(1.9, color="gray", ls="--", lw=1)
    ax1.axhline(3.5, color="gray", ls=":", lw=1)
    ax1.set_xticks(range(len(speed)))
    ax1.set_xticklabels([label(b).split("/T:")[0].replace("quant/", "").replace("/", "\n")
                         for b in speed], fontsize=7)
    ax1.set_ylabel("throughput over bf16 (same run)")
    ax1.set_title("T=1024, depth 2 (targets: 1.9x fp8/int8, 3.5x int4)", fontsize=9)
    ax1.legend(fontsize=8)
    for k, f in enumerate(QUANT_FORMATS):
        xs = [i + (k - (len(QUANT_FORMATS) - 1) / 2) * width for i in range(len(share))]
        ax2.bar(xs, [100 * b.get(f + "_share", 0) for b in share], width, label=f)
        kern = [(x, 100 * b[f + "_kernels_share"]) for x, b in zip(xs, share)
                if f + "_kernels_share" in b]
        if kern:  # the step's dequantizations alone, no GEMMs
            ax2.scatter([x for x, _ in kern], [y for _, y in kern], marker="_", s=160,
                        color="black", zorder=3, label="kernels alone" if k == 0 else None)
    ax2.axhline(3.0, color="gray", ls="--", lw=1)
    ax2.legend(fontsize=7, loc="lower right")
    ax2.set_xticks(range(len(share)))
    ax2.set_xticklabels([label(b).split("/dequant_share")[0] for b in share], fontsize=8)
    ax2.set_ylabel("dequantization, % of the step")
    ax2.set_title("T=16384, compute-bound, paired steps (target <= 3%)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plots(indir, outdir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    jobs = [
        ("ring", "ring_bandwidth.png", plot_ring),
        ("workloads", "workload_ratios.png", plot_workloads),
        ("copy", "copy_bandwidth.png", plot_copy),
        ("host", "host_overhead.png", plot_host),
        ("quant", "quant.png", plot_quant),
    ]
    wrote = 0
    for key, name, fn in jobs:
        doc = load(indir, key)
        if doc is None:
            continue
        path = os.path.join(outdir, name)
        if fn(plt, doc, path):
            print(f"plot_bench: wrote {path}")
            wrote += 1
        else:
            print(f"plot_bench: {FILES[key]}: no usable results, {name} not drawn",
                  file=sys.stderr)
    return wrote


def main(argv):
    if len(argv) == 3 and argv[1] == "--table":
        tables(argv[2])
        return 0
    if len(argv) == 3 and not argv[1].startswith("-"):
        return 0 if plots(argv[1], argv[2]) else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
