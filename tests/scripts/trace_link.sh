#!/usr/bin/env bash
# scripts/trace-link on a made-up trace whose answers are known: two steps
# split at the device's pause, the link's busy time, idle time and gaps, the
# kernel a copy waited for, the compute stream's gaps (no GPU, no torch).
#   trace_link.sh PYTHON
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" - "$tmp/trace.json" <<'PY'
import json
import sys

def copy(ts, dur, mb, stream=20):
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": ts, "dur": dur, "args": {"bytes": int(mb * 1e6), "stream": stream}}

def kernel(ts, dur, name, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream}}

evs = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5},
       {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 19900, "dur": 50},
       {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 19960,
        "dur": 420}]
for base in (1000.0, 20000.0):  # two steps, 18.6 ms apart
    evs += [copy(base, 100, 1.0), copy(base + 100, 100, 1.0), copy(base + 250, 100, 2.0),
            kernel(base, 50, "gemm_a"), kernel(base + 60, 150, "gemm_b"),
            kernel(base + 240, 160, "gemm_c")]
json.dump({"traceEvents": evs}, open(sys.argv[1], "w"))
PY
out=$("$python" "$root/scripts/trace-link" "$tmp/trace.json")
echo "$out"
failures=0
want() {
  local n
  n=$(grep -cF -- "$1" <<<"$out" || true)
  if [ "$n" -ne "$2" ]; then
    echo "FAIL: \"$1\" appears $n times, not $2"
    failures=$((failures + 1))
  fi
}
want "step 0: span 0.400 ms, 6 device events" 1
want "step 1: span 0.400 ms, 6 device events" 1
want "h2d: 3 copies, 4.0 MB, busy 0.300 ms (75.0 % of the span), median rate 10.00 GB/s (copies >= 1 MiB: 20.00), first starts at +0.000 ms, last ends 0.050 ms before the span's end, idle between 0.050 ms" 2
want "gaps >= 20 us: 1, 0.050 ms together" 2
want "50.0 us at +0.200 ms: after a copy of 1.0 MB, before one of 2.0 MB (copy #2); last kernel ended 40.0 us before: gemm_b" 2
want "compute: 3 kernels, busy 0.360 ms (90.0 % of the span), idle inside 0.040 ms; gaps >= 20 us: 1, 0.030 ms together" 2
want "30.0 us at +0.210 ms, before gemm_c" 2
want "streams: h2d [20], kernel [7]" 2
want "host: 1 runtime calls, the first (cudaLaunchKernel) 1.000 ms before the device's first work; most time in cudaLaunchKernel 1 x 0.005 ms" 1
want "host: 2 runtime calls, the first (cudaGraphLaunch) 0.100 ms before the device's first work; most time in cudaStreamSynchronize 1 x 0.420 ms, cudaGraphLaunch 1 x 0.050 ms" 1
# a smaller pause than --split-ms keeps the two steps one
one=$("$python" "$root/scripts/trace-link" --split-ms 50 "$tmp/trace.json")
if [ "$(grep -c '^step ' <<<"$one")" -ne 1 ]; then
  echo "FAIL: --split-ms 50 split the trace into $(grep -c '^step ' <<<"$one") steps, not 1"
  failures=$((failures + 1))
fi
exit $((failures > 0))
