#!/usr/bin/env bash
# The lwo program's usage errors (no GPU needed: flags are checked before any
# device is opened). Each case: the arguments, then a piece of the message;
# the program must exit with 2 (a usage error) and say it on stderr, with
# nothing on stdout.
set -u
LWO="$1"
# In a sanitized build a report aborts the program (a signal, not an exit
# status a case expects).
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}abort_on_error=1"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:+$UBSAN_OPTIONS:}halt_on_error=1:abort_on_error=1"
ERR=$(mktemp)
trap 'rm -f "$ERR"' EXIT
fails=0
check() {
  local want="$1"
  shift
  local out err rc
  out=$("$LWO" "$@" 2>"$ERR")
  rc=$?
  err=$(cat "$ERR")
  if [ "$rc" -ne 2 ]; then
    echo "FAIL: lwo $* exited $rc, not 2 (stderr: $err)"; fails=$((fails + 1)); return
  fi
  if [[ "$err" != *"$want"* ]]; then
    echo "FAIL: lwo $*: stderr does not say '$want': $err"; fails=$((fails + 1)); return
  fi
  if [ -n "$out" ]; then
    echo "FAIL: lwo $*: wrote to stdout: $out"; fails=$((fails + 1)); return
  fi
  echo "ok: ${LWO##*/} $*: $want"
}
check "need --optimizer" train --optimizer-threads 3
check "need --optimizer" train --optimizer-state bf16
check "need --optimizer" train --delayed
check "--optimizer-threads 65 is not in 0..64" train --optimizer adamw --optimizer-threads 65
check "exclude each other" train --optimizer adamw --delayed --max-norm 1
check "--frozen layers have no gradients" train --optimizer sgd --frozen
check "--max-norm 0 is not a number above 0" train --optimizer adamw --max-norm 0
check "--optimizer-state f16 is neither f32 nor bf16" train --optimizer adamw --optimizer-state f16
# values checked while the flags are parsed, before the GPU is touched (on a
# machine without one these would otherwise fail with exit 1 at the device)
check 'is not a size' run --budget abc
check "--budget -5%: a share is a number in (0, 100]" train --budget -5%
check "--fwd-ms abc is not a time in ms >= 0" plan --fwd-ms abc
check "--bwd-ms -1 is not a time in ms >= 0" plan --train --bwd-ms -1
# the no-argument message names every command of the table, plan included
"$LWO" 2>"$ERR" >/dev/null
for c in probe run train stream info plan help version; do
  if ! grep -q "$c" "$ERR"; then
    echo "FAIL: lwo with no argument does not name $c: $(cat "$ERR")"; fails=$((fails + 1))
  fi
done
# help of the dispatcher's own commands
for c in help version; do
  out=$("$LWO" help "$c" 2>"$ERR")
  rc=$?
  if [ "$rc" -ne 0 ] || [[ "$out" != "usage: lwo $c"* ]]; then
    echo "FAIL: lwo help $c exited $rc: $out $(cat "$ERR")"; fails=$((fails + 1))
  else
    echo "ok: lwo help $c"
  fi
done
# results that cannot be written are a failure (exit 1, with a message)
if [ -w /dev/full ]; then
  "$LWO" help >/dev/full 2>"$ERR"
  rc=$?
  if [ "$rc" -ne 1 ] || ! grep -q "cannot write the results to stdout" "$ERR"; then
    echo "FAIL: lwo help >/dev/full exited $rc: $(cat "$ERR")"; fails=$((fails + 1))
  else
    echo "ok: lwo help >/dev/full exits 1"
  fi
fi
# bench_shard (the second argument, where built): the same parser and exit
# statuses, its messages and help under its own name.
if [ -n "${2:-}" ]; then
  LWO="$2"
  check "bench_shard: --ranks 0 is not in 1..1024" --ranks 0
  check "--ranks and --ranks-list exclude each other" --ranks 1 --ranks-list 1,2
  check "--device does not apply to bench_shard" --device 1
  check "run 'bench_shard --help' for the flags" --bogus
  out=$("$LWO" --help 2>"$ERR")
  if [ $? -ne 0 ] || [[ "$out" != "usage: bench_shard [flags]"* ]]; then
    echo "FAIL: bench_shard --help: $out $(cat "$ERR")"; fails=$((fails + 1))
  else
    echo "ok: bench_shard --help"
  fi
fi
if [ "$fails" -ne 0 ]; then echo "$fails usage case(s) failed"; exit 1; fi
echo "every usage case exited 2 with its message"
