#!/usr/bin/env bash
# scripts/racecheck-filter on saved racecheck output (racecheck_*.log beside
# this file) and on variants of it: allow-listed reports are counted and
# filtered, every other report, a cut-short log, a summary that disagrees with
# the reports read and a reached print limit fail. The allow-list is the one
# scripts/device-test passes (its RACECHECK_ALLOW array, read from the script).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
filter="$root/scripts/racecheck-filter"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
failures=0

# expect RC PATTERN ARGS...: runs the filter; its status must be RC and its
# output must match the extended regular expression PATTERN.
expect() {
  local want=$1 pattern=$2 rc=0
  shift 2
  "$filter" "$@" >"$tmp/out" 2>&1 || rc=$?
  if [ "$rc" -ne "$want" ] || ! grep -Eq -- "$pattern" "$tmp/out"; then
    echo "FAIL: racecheck-filter $* gave status $rc (wanted $want), output:"
    sed 's/^/    /' "$tmp/out"
    echo "    (wanted a line matching: $pattern)"
    failures=$((failures + 1))
  else
    echo "ok: racecheck-filter $* -> $rc"
  fi
}

# device-test's allow-list, as the script defines it.
bash -n "$root/scripts/device-test"
eval "$(sed -n '/^RACECHECK_ALLOW=(/,/^)/p' "$root/scripts/device-test")"
if [ "${#RACECHECK_ALLOW[@]}" -eq 0 ]; then
  echo "FAIL: scripts/device-test defines no RACECHECK_ALLOW entries"
  exit 1
fi
allow=()
for g in "${RACECHECK_ALLOW[@]}"; do allow+=(--allow "$g"); done
if ! grep -qF 'racecheck-filter" "${allow_args[@]}"' "$root/scripts/device-test"; then
  echo "FAIL: scripts/device-test does not pass RACECHECK_ALLOW to scripts/racecheck-filter"
  failures=$((failures + 1))
fi

nvjet="$here/racecheck_nvjet.log"
mixed="$here/racecheck_mixed.log"

# Only cuBLASLt's kernels: both reports filtered and counted.
expect 0 '^racecheck-filter: 2 reports: 2 filtered \(allow-listed kernels: [^)]*nvjet_[^)]*\), 0 not$' \
  "${allow[@]}" --print-limit 10000 "$nvjet"
# Without the allow-list the same log fails.
expect 1 '^racecheck-filter: 2 reports: 0 filtered \(allow-listed kernels: none\), 2 not$' "$nvjet"
# A hazard of an lwo kernel beside them fails, and is named.
expect 1 '^unfiltered: .*lwo::dequant_int4_kernel' "${allow[@]}" "$mixed"
expect 1 '^racecheck-filter: 2 reports: 1 filtered .*, 1 not$' "${allow[@]}" "$mixed"
expect 1 '^racecheck-filter: FAIL$' "${allow[@]}" "$mixed"

# No hazard at all.
printf '%s\n' '========= COMPUTE-SANITIZER' '[  PASSED  ] 1 test.' \
  '========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)' >"$tmp/clean.log"
expect 0 '^racecheck-filter: 0 reports: 0 filtered .*, 0 not$' "${allow[@]}" "$tmp/clean.log"

# A run cut short: no summary line.
grep -v 'RACECHECK SUMMARY' "$nvjet" >"$tmp/cut.log"
expect 1 'no RACECHECK SUMMARY line' "${allow[@]}" "$tmp/cut.log"

# A report of a shape the filter does not know (no access line) is not
# filtered, even when it names an allow-listed kernel.
{
  sed '/RACECHECK SUMMARY/d' "$nvjet"
  echo '========= Error: Potential hazard in nvjet_sm90_tst_128x128_64x6_2x1_v_bz_bias_TNT'
  echo '========='
  echo '========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)'
} >"$tmp/unknown.log"
expect 1 '^racecheck-filter: 3 reports: 2 filtered .*, 1 not$' "${allow[@]}" "$tmp/unknown.log"

# The summary counts more reports than were read.
sed 's/RACECHECK SUMMARY: 2 hazards/RACECHECK SUMMARY: 5 hazards/' "$nvjet" >"$tmp/more.log"
expect 1 'the summary counts 5 reports but 2 were read' "${allow[@]}" "$tmp/more.log"

# The print limit reached: reports past it were never printed.
expect 1 'the print limit of 2 was reached' "${allow[@]}" --print-limit 2 "$nvjet"

# One access in an allow-listed kernel and one elsewhere: not filtered.
sed 's/and Read access at 0x2e40 in nvjet_sm90_tst_128x128_64x6_2x1_v_bz_bias_TNT/and Read access at 0x2e40 in lwo::pack_kernel(char *)/' \
  "$nvjet" >"$tmp/half.log"
expect 1 '^racecheck-filter: 2 reports: 1 filtered .*, 1 not$' "${allow[@]}" "$tmp/half.log"

# A name that only contains an allow-listed one is not allow-listed.
sed 's/nvjet_sm90_tst_128x128_64x6_2x1_v_bz_bias_TNT/my_nvjet_sm90_copy/g' "$nvjet" >"$tmp/lookalike.log"
expect 1 '^racecheck-filter: 2 reports: 0 filtered .*, 2 not$' "${allow[@]}" "$tmp/lookalike.log"

# Hazard-mode reports (thread lines) of an allow-listed kernel are filtered.
{
  echo '========= Error: Potential WAW hazard detected at __shared__ 0x0 in block (0, 0, 0) :'
  echo '=========     Write Thread (31, 0, 0) at 0x170 in nvjet_sm90_tst_128x128_64x6_2x1_v_bz_bias_TNT'
  echo '=========     Write Thread (0, 0, 0) at 0x170 in nvjet_sm90_tst_128x128_64x6_2x1_v_bz_bias_TNT'
  echo '=========     Current Value : 0, Incoming Value : 0'
  echo '========='
  echo '========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)'
} >"$tmp/hazard.log"
expect 0 '^racecheck-filter: 1 reports: 1 filtered .*, 0 not$' "${allow[@]}" "$tmp/hazard.log"

# Usage errors.
expect 2 'kernel-name glob' --allow 'nvjet.*' "$nvjet"
expect 2 'not a count' --print-limit x "$nvjet"
expect 2 'cannot read' "$tmp/absent.log"

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
