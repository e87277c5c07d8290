#!/usr/bin/env bash
# lwo info over malformed checkpoint files (no GPU needed: lwo info estimates
# the ring without one). A file problem is a runtime failure: exit 1, one
# message on stderr that says what is wrong, never a usage error (exit 2).
set -u
LWO="$1"
# In a sanitized build a report aborts the program (a signal, not an exit
# status a case expects).
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}abort_on_error=1"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:+$UBSAN_OPTIONS:}halt_on_error=1:abort_on_error=1"
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
fails=0
# st_file PATH HEADER: a safetensors file of that header and no data.
st_file() {
  local n=${#2} len="" i
  for i in 0 1 2 3 4 5 6 7; do len+=$(printf '\\x%02x' $(( (n >> (8 * i)) & 255 ))); done
  printf "$len" >"$1"
  printf '%s' "$2" >>"$1"
}
# check WANT_RC WANT_TEXT [NOT_TEXT] -- ARGS...
check() {
  local want_rc="$1" want="$2" not="$3"
  shift 4
  local err rc
  err=$(timeout 60 "$LWO" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -ne "$want_rc" ]; then
    echo "FAIL: lwo $* exited $rc, not $want_rc: $err"; fails=$((fails + 1)); return
  fi
  if [[ "$err" != *"$want"* ]]; then
    echo "FAIL: lwo $*: stderr does not say '$want': $err"; fails=$((fails + 1)); return
  fi
  if [ -n "$not" ] && [[ "$err" == *"$not"* ]]; then
    echo "FAIL: lwo $*: stderr says '$not': $err"; fails=$((fails + 1)); return
  fi
  echo "ok: lwo $*: $want"
}
e='{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
# Tensors far apart: every gap under 2^20, millions of layers in all.
h='{'
for k in 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15; do
  h+="\"blocks.$((k << 20)).w\":$e,"
done
st_file "$DIR/far.safetensors" "${h%,}}"
check 1 "beyond the 1048576 layers" "" -- info --quiet --pattern 'blocks.{i}.' "$DIR/far.safetensors"
# An index beyond 64 bits: named as the file spells it.
st_file "$DIR/huge.safetensors" "{\"blocks.0.w\":$e,\"blocks.99999999999999999999999999.w\":$e}"
check 1 "layer index 99999999999999999999999999 " "18446744073709551615" -- \
  info --quiet --pattern 'blocks.{i}.' "$DIR/huge.safetensors"
# --json FILE: a run that fails leaves FILE as it was (the JSON is written
# to a temporary file beside it, renamed at success), and leaves nothing else.
mkdir "$DIR/j"
printf 'keep' >"$DIR/j/out.json"
check 1 "beyond the 1048576 layers" "" -- info --quiet --json "$DIR/j/out.json" \
  --pattern 'blocks.{i}.' "$DIR/far.safetensors"
if [ "$(cat "$DIR/j/out.json" 2>/dev/null)" != keep ]; then
  echo "FAIL: a failed lwo info --json changed the file: '$(cat "$DIR/j/out.json" 2>&1)'"
  fails=$((fails + 1))
fi
if [ "$(ls -A "$DIR/j")" != out.json ]; then
  echo "FAIL: a failed lwo info --json left files: $(ls -A "$DIR/j")"; fails=$((fails + 1))
fi
st_file "$DIR/good.safetensors" "{\"blocks.0.w\":$e}"
if "$LWO" info --quiet --json "$DIR/j/out.json" "$DIR/good.safetensors" >/dev/null 2>&1 &&
   grep -q '"tensors"' "$DIR/j/out.json" && [ "$(ls -A "$DIR/j")" = out.json ]; then
  echo "ok: lwo info --json replaces the file at success"
else
  echo "FAIL: lwo info --json at success: $(ls -A "$DIR/j"): $(head -c 200 "$DIR/j/out.json")"
  fails=$((fails + 1))
fi
if [ "$fails" -ne 0 ]; then
  echo "$fails failure(s)"
  exit 1
fi
