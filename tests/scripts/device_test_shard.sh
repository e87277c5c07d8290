#!/usr/bin/env bash
# scripts/device-test refuses a malformed LWO_SANITIZER_SHARD before it builds
# or runs anything: exit 2 and a message naming the variable and the value
# (no GPU needed; a time budget of 1 s leaves every step unrun should one pass).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
failures=0
bads=(2/2 1/0 x 1 -1/2 0/2/3 " 0/2")
for bad in "${bads[@]}"; do
  rm -rf "${out:?}"/*
  rc=0
  msg=$(LWO_TIME_BUDGET=1 LWO_SANITIZER_SHARD="$bad" "$root/scripts/device-test" "$out" 2>&1 >/dev/null) || rc=$?
  if [ "$rc" -ne 2 ] || [[ "$msg" != *"LWO_SANITIZER_SHARD=$bad:"* ]]; then
    echo "FAIL: LWO_SANITIZER_SHARD='$bad': exit $rc, message: $msg"
    failures=$((failures + 1))
  fi
  if [ -s "$out/build.log" ]; then
    echo "FAIL: LWO_SANITIZER_SHARD='$bad': device-test wrote build.log before refusing"
    failures=$((failures + 1))
  fi
done
[ "$failures" -eq 0 ] && echo "device_test_shard: ${#bads[@]} malformed values refused before any step"
exit $((failures > 0))
