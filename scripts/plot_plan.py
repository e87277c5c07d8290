#!/usr/bin/env python3
"""Time against the device memory budget, predicted and measured.

    scripts/plot_plan.py SWEEP_DIR OUT_JSON [OUT_PNG]

SWEEP_DIR holds scripts/plan-sweep's run_<pct>.json and train_<pct>.json. The
budgets, the plans' predicted times and the measured times of the planned and
the unbudgeted pass (forward, `lwo run`) and step (`lwo train`) are collected
into OUT_JSON, a table is printed, and with OUT_PNG (and matplotlib) each is
drawn against the budget as a share of the model, predicted and measured on
one chart.
"""
import glob
import json
import os
import re
import sys


def collect(sweep_dir):
    out = {"forward": [], "train": []}
    for path in sorted(glob.glob(os.path.join(sweep_dir, "*_*.json"))):
        m = re.match(r"(run|train)_(\d+)\.json$", os.path.basename(path))
        if not m:
            continue
        with open(path) as f:
            j = json.load(f)
        kind, pct = ("forward" if m.group(1) == "run" else "train"), int(m.group(2))
        plan, planned = j["plan"], j["planned"]
        row = {
            "budget_pct": pct,
            "budget_bytes": plan["budget_bytes"],
            "depth": plan["depth"],
            "n_resident": plan["n_resident"],
            "predicted_ms": plan["predicted_ms"],
            "first_k_ms": plan["first_k_ms"],
            "measured_ms": planned["median_ms"],
            "unbudgeted_ms": j["median_ms"],
            "time_ratio": planned["time_ratio"],
        }
        if kind == "forward":
            row["bytes_ratio"] = planned["bytes_ratio"]
        out[kind].append(row)
    for rows in out.values():
        rows.sort(key=lambda r: r["budget_pct"])
        if rows:  # budget 0: the unbudgeted ring every run measured beside its plan
            rows.insert(0, {"budget_pct": 0, "budget_bytes": 0, "depth": 2, "n_resident": 0,
                            "predicted_ms": None, "first_k_ms": None,
                            "measured_ms": rows[0]["unbudgeted_ms"],
                            "unbudgeted_ms": rows[0]["unbudgeted_ms"], "time_ratio": 1.0})
    return out


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    data = collect(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        json.dump(data, f, indent=1)
    for kind, rows in data.items():
        print("%s:" % kind)
        print("  %7s %5s %8s %12s %12s %12s %8s" % ("budget", "depth", "resident", "predicted",
                                                   "measured", "unbudgeted", "ratio"))
        for r in rows:
            pred = r["predicted_ms"]
            err = "(%+.1f%%)" % (100 * (r["measured_ms"] / pred - 1)) if pred else ""
            print("  %6d%% %5d %8d %12s %9.3f ms %9.3f ms %7.3fx  %s" % (
                r["budget_pct"], r["depth"], r["n_resident"],
                "%.3f ms" % pred if pred else "-", r["measured_ms"], r["unbudgeted_ms"],
                r["time_ratio"], err))
    if len(sys.argv) == 4:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, (kind, rows) in zip(axes, data.items()):
            p = [r for r in rows if r["predicted_ms"]]
            ax.plot([r["budget_pct"] for r in p], [r["predicted_ms"] for r in p], "o--",
                    label="predicted")
            ax.plot([r["budget_pct"] for r in rows], [r["measured_ms"] for r in rows], "s-",
                    label="measured")
            ax.plot([r["budget_pct"] for r in p], [r["first_k_ms"] for r in p], ":",
                    label="first k (predicted)")
            ax.set_xlabel("budget, % of the model")
            ax.set_ylabel("ms per %s" % ("pass" if kind == "forward" else "step"))
            ax.set_title({"forward": "forward (lwo run)", "train": "training step (lwo train)"}[kind])
            ax.set_ylim(bottom=0)
            ax.legend()
        fig.tight_layout()
        fig.savefig(sys.argv[3], dpi=120)


if __name__ == "__main__":
    main()
