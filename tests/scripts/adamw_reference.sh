#!/usr/bin/env bash
# scripts/torch-adamw-reference --pair-with runs bench_optim once per state
# variant and reads exactly one AdamW run from its JSON: its filter
# (bench_filter) must select exactly that run among the benchmarks bench_optim
# registers, and no benchmark registered beside it (no GPU needed: the list
# only).
#   adamw_reference.sh PYTHON BENCH_OPTIM
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python=$1
bench=$2
filters=$("$python" - "$root/scripts/torch-adamw-reference" <<'PY'
import importlib.machinery
import importlib.util
import sys

loader = importlib.machinery.SourceFileLoader("adamw_reference", sys.argv[1])
spec = importlib.util.spec_from_loader("adamw_reference", loader)
module = importlib.util.module_from_spec(spec)
loader.exec_module(module)
for v in module.VARIANTS:
    print(v, module.bench_filter(v))
PY
)
failures=0
n=0
while read -r variant filter; do
  n=$((n + 1))
  mapfile -t got < <("$bench" --benchmark_list_tests "--benchmark_filter=$filter")
  if [ "${#got[@]}" -ne 1 ] || [[ "${got[0]}" != "AdamW/$variant/"* ]]; then
    echo "FAIL: AdamW/$variant: the filter $filter selects ${#got[@]} benchmarks of" \
         "bench_optim, not its one run: ${got[*]:-none}"
    failures=$((failures + 1))
  else
    echo "ok: AdamW/$variant: $filter selects ${got[0]}"
  fi
done <<<"$filters"
if [ "$n" -lt 2 ]; then
  echo "FAIL: the script names $n state variants, not f32 and bf16"
  failures=$((failures + 1))
fi
exit $((failures > 0))
