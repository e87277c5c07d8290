#!/usr/bin/env bash
# scripts/setup's two roles, with apt-get replaced by one that always fails
# (as on a machine that reaches no package registry): a missing tool of the
# tests is reported and setup goes on (exit 0); a missing need of the build
# stops it (exit 1). The checks are made to miss by pointing them at a file
# that does not exist, in a copy of the script. Needs no GPU, installs nothing.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/bin"
printf '#!/bin/sh\necho "E: Unable to locate package $*" >&2\nexit 100\n' >"$tmp/bin/apt-get"
chmod +x "$tmp/bin/apt-get"
# the Python step is left out: its check passes or fails by what this machine has
fail=0
check() {  # NAME PATTERN REPLACEMENT WANT_RC WANT_TEXT
  sed "s|$2|$3|" "$root/scripts/setup" >"$tmp/setup"
  if ! grep -q "$3" "$tmp/setup"; then echo "FAIL $1: pattern not found"; fail=1; return; fi
  out=$(cd "$root" && PATH="$tmp/bin:$PATH" LWO_SETUP_NO_PYTHON=1 bash "$tmp/setup" 2>&1)
  rc=$?
  if [ "$rc" != "$4" ] || ! grep -q "$5" <<<"$out"; then
    echo "FAIL $1: exit $rc (want $4), output:"; echo "$out"; fail=1
  else
    echo "ok $1"
  fi
}
check "a test tool missing" '"libclang-rt-dev    tests have_fuzzer"' \
  '"libclang-rt-dev    tests have_file /nonexistent-lwo"' 0 "the build goes on without libclang-rt-dev"
check "a build need missing" '"nlohmann-json3-dev build have_file /usr/include/nlohmann/json.hpp"' \
  '"nlohmann-json3-dev build have_file /nonexistent-lwo"' 1 "apt-get failed"
exit $fail
