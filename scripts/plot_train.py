#!/usr/bin/env python3
"""The training-step figures of one scripts/device-test run, as a table and a plot.

    scripts/plot_train.py LWO_LOG OUT_JSON [OUT_PNG]

LWO_LOG is device-test's lwo.log: the JSON it holds of every `lwo train` variant,
of bench_workloads' m144 step and of scripts/torch-reference is collected into
OUT_JSON (docs/perf/train_step_03.json), a table is printed, and with OUT_PNG
(and matplotlib) each workload's step time is drawn beside its split floor, its
older bound and its resident compute, all measured in that run.
"""
import json
import re
import sys


def collect(log_text):
    out = {}
    for m in re.finditer(r"===== (lwo train \S+|bench_workloads m144|torch-reference): JSON =====\n",
                         log_text):
        end = log_text.find("\n=====", m.end())
        out[m.group(1)] = json.loads(log_text[m.end():end if end > 0 else None])
    return out


def rows(data):
    for key, j in data.items():
        if key.startswith("lwo train "):
            c, f = j["config"], j.get("split_floor", {})
            yield {
                "name": "%s (T=%d, K=%d %s, depth %d)" % (key[len("lwo train "):], c["tokens"],
                                                           c.get("micro_batches", 1),
                                                           c.get("order", "batch"), c["depth"]),
                "step_ms": j["median_ms"], "floor_ms": f.get("ms"), "bound_ms": j["bound"]["ms"],
                "resident_ms": j["resident"].get("median_ms"),
                "h2d_gib": j["h2d_bytes_per_step"] / 2**30, "d2h_gib": j["d2h_bytes_per_step"] / 2**30,
                "edges": j.get("edges_ms", {}),
            }
        elif key == "bench_workloads m144":
            for b in j["benchmarks"]:
                yield {
                    "name": "m144 block records (T=%d, depth %d)" % (b["rows"], b["depth"]),
                    "step_ms": b["streamed_ms"],
                    "floor_ms": b["floor_ms"], "bound_ms": b["bound_ms"],
                    "resident_ms": b["resident_ms"], "h2d_gib": b["h2d_bytes"] / 2**30,
                    "d2h_gib": b["d2h_bytes"] / 2**30,
                    "edges": {"start": b["edge_start_ms"], "turn": b["edge_turn_ms"],
                              "end": b["edge_end_ms"]},
                }


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    data = collect(open(sys.argv[1]).read())
    with open(sys.argv[2], "w") as f:
        json.dump(data, f, indent=1)
    table = list(rows(data))
    print("| workload | step ms | split floor ms | step / floor | old bound ms | resident ms | "
          "H2D GiB | D2H GiB | start / turn / end ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        e = r["edges"]
        print("| %s | %.1f | %.1f | %.3f | %.1f | %s | %.2f | %.2f | %.2f / %.2f / %.2f |" % (
            r["name"], r["step_ms"], r["floor_ms"] or 0, r["step_ms"] / r["floor_ms"] if r["floor_ms"] else 0,
            r["bound_ms"], "%.1f" % r["resident_ms"] if r["resident_ms"] else "-", r["h2d_gib"],
            r["d2h_gib"], e.get("start", 0), e.get("turn", 0), e.get("end", 0)))
    for r in data.get("torch-reference", {}).get("results", []):
        print("PyTorch resident %s T=%d: %.1f ms (forward %.1f, backward %.1f)" % (
            r["chain"], r["tokens"], r["step_ms"], r["forward_ms"], r["backward_ms"]))
    if len(sys.argv) > 3:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 0.6 * len(table) + 1.5))
        names = [r["name"] for r in table]
        ys = range(len(table))
        h = 0.2
        ax.barh([y - 1.5 * h for y in ys], [r["step_ms"] for r in table], h, label="step (median)")
        ax.barh([y - 0.5 * h for y in ys], [r["floor_ms"] or 0 for r in table], h, label="split floor")
        ax.barh([y + 0.5 * h for y in ys], [r["bound_ms"] for r in table], h, label="old bound")
        ax.barh([y + 1.5 * h for y in ys], [r["resident_ms"] or 0 for r in table], h,
                label="resident compute")
        ax.set_yticks(list(ys))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per training step (one H200, one run)")
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(sys.argv[3], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
