#!/usr/bin/env bash
# lwo info and lwo stream over a corpus of malformed checkpoints, generated
# here into a temporary folder (no GPU needed: lwo info estimates the ring
# without one, and lwo stream opens and maps every file before it touches the
# GPU, which is hidden from it with CUDA_VISIBLE_DEVICES=""). For each file:
# the exit status docs/CLI.md gives (1: a file that cannot be read, 2: a
# pattern or names file that does not fit the checkpoint, 0: success), one
# message on stderr that names the command, the file and the problem, and no
# crash (a signal, or a sanitizer's report in a sanitized build).
#
#   tests/cli/malformed.sh LWO PYTHON3
set -u
LWO="$1"
PY="${2:-python3}"
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
# In a sanitized build a report aborts the program (a signal, caught below as
# a crash) rather than exiting with 1, the status a malformed file expects.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}abort_on_error=1"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:+$UBSAN_OPTIONS:}halt_on_error=1:abort_on_error=1"
fails=0 n=0
name_file=1  # 0: the message is not about the file (no GPU)

# The corpus: each file a tiny safetensors file (8-byte little-endian header
# length, header, data) or an index with its shards.
"$PY" - "$DIR" <<'EOF' || { echo "FAIL: the corpus generator failed"; exit 1; }
import os, struct, sys

d = sys.argv[1]


def st(header, data=b"", length=None):
    h = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def t(dtype, shape, begin, end):
    return ('{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}'
            % (dtype, ",".join(str(x) for x in shape), begin, end))


def write(name, content):
    path = os.path.join(d, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content)


files = {
    "good.safetensors": st('{"__metadata__":{"format":"pt"},"blocks.0.w":' + t("BF16", [2, 2], 0, 8)
                           + ',"blocks.1.w":' + t("BF16", [2, 2], 8, 16) + '}', bytes(range(16))),
    "gaps.safetensors": st('{"h.0.w":' + t("F32", [1], 0, 4) + ',"h.7.w":' + t("F32", [1], 4, 8) + '}',
                           bytes(8)),
    "empty.safetensors": b"",
    "short.safetensors": b"\x05\x00\x00",
    "zero_length.safetensors": st("", length=0),
    "cut_header.safetensors": st('{"blocks.0.w":', length=100),
    "past_file.safetensors": st("{}", length=1 << 40),
    "huge_length.safetensors": st("{}", length=(1 << 64) - 1),
    "bad_json.safetensors": st('{"blocks.0.w":{"dtype":"F32",'),
    "not_object.safetensors": st('[1,2,3]'),
    "nul_byte.safetensors": st(b'{"blocks.0.w\x00":' + t("U8", [1], 0, 1).encode() + b'}', bytes(1)),
    "nul_escape.safetensors": st('{"blocks.0.w\\u0000x":' + t("U8", [1], 0, 1) + '}', bytes(1)),
    "bad_utf8.safetensors": st(b'{"\xff":1}'),
    "no_offsets.safetensors": st('{"blocks.0.w":{"dtype":"F32","shape":[1]}}', bytes(4)),
    "bad_dtype.safetensors": st('{"blocks.0.w":' + t("Q8", [1], 0, 1) + '}', bytes(1)),
    "lower_dtype.safetensors": st('{"blocks.0.w":' + t("f32", [1], 0, 4) + '}', bytes(4)),
    "shape_mismatch.safetensors": st('{"blocks.0.w":' + t("F32", [3], 0, 8) + '}', bytes(8)),
    "shape_overflow.safetensors": st('{"blocks.0.w":' + t("F32", [4611686018427387904, 8], 0, 8)
                                     + '}', bytes(8)),
    "float_shape.safetensors": st('{"blocks.0.w":{"dtype":"F32","shape":[1.5],'
                                  '"data_offsets":[0,4]}}', bytes(4)),
    "past_data.safetensors": st('{"blocks.0.w":' + t("F32", [4], 0, 16) + '}', bytes(9)),
    "offsets_64bit.safetensors": st('{"blocks.0.w":{"dtype":"U8","shape":[1],'
                                    '"data_offsets":[0,99999999999999999999]}}', bytes(1)),
    "reversed.safetensors": st('{"blocks.0.w":' + t("U8", [4], 8, 4) + '}', bytes(8)),
    "overlap.safetensors": st('{"blocks.0.a":' + t("U8", [8], 0, 8) + ',"blocks.0.b":'
                              + t("U8", [8], 4, 12) + '}', bytes(12)),
    "duplicate.safetensors": st('{"blocks.0.w":' + t("U8", [1], 0, 1) + ',"blocks.0.w":'
                                + t("U8", [1], 1, 2) + '}', bytes(2)),
    # Layer indices 2^20 apart: the listing would need millions of layers.
    "far.safetensors": st("{" + ",".join('"blocks.%d.w":%s' % (k << 20, t("U8", [0], 0, 0))
                                         for k in range(16)) + "}"),
    "no_layers.safetensors": st('{"embed.weight":' + t("U8", [1], 0, 1) + '}', bytes(1)),
}
for name, content in files.items():
    write(name, content)

# Indexes; their shards lie beside them.
good_shard = st('{"blocks.0.w":' + t("U8", [4], 0, 4) + '}', bytes(4))
write("idx/good/a.safetensors", good_shard)
write("idx/good/b.safetensors", st('{"blocks.1.w":' + t("U8", [4], 0, 4) + '}', bytes(4)))
write("idx/good/model.safetensors.index.json",
      b'{"metadata":{"total_size":8},"weight_map":{"blocks.0.w":"a.safetensors",'
      b'"blocks.1.w":"b.safetensors"}}')
write("idx/missing/model.safetensors.index.json",
      b'{"weight_map":{"blocks.0.w":"absent-00001.safetensors"}}')
write("idx/dotdot/model.safetensors.index.json",
      b'{"weight_map":{"blocks.0.w":"../good/a.safetensors"}}')
write("idx/absolute/model.safetensors.index.json",
      b'{"weight_map":{"blocks.0.w":"/etc/passwd"}}')
write("idx/empty/model.safetensors.index.json", b'{"metadata":{},"weight_map":{}}')
write("idx/no_map/model.safetensors.index.json", b'{"metadata":{"total_size":0}}')
write("idx/bad_json/model.safetensors.index.json", b'{"weight_map":{"blocks.0.w":')
write("idx/not_in_shard/a.safetensors", good_shard)
write("idx/not_in_shard/model.safetensors.index.json",
      b'{"weight_map":{"blocks.0.w":"a.safetensors","blocks.9.w":"a.safetensors"}}')
write("idx/bad_shard/a.safetensors", st('{"blocks.0.w":' + t("Q8", [1], 0, 1) + '}', bytes(1)))
write("idx/bad_shard/model.safetensors.index.json",
      b'{"weight_map":{"blocks.0.w":"a.safetensors"}}')
write("outside/x.safetensors", good_shard)
os.makedirs(os.path.join(d, "idx/symlink"), exist_ok=True)
os.symlink("../../outside/x.safetensors", os.path.join(d, "idx/symlink/a.safetensors"))
write("idx/symlink/model.safetensors.index.json", b'{"weight_map":{"blocks.0.w":"a.safetensors"}}')
# A names file naming a tensor the checkpoint does not have.
write("names.txt", b"blocks.0.w\nblocks.1.nothing\n")
EOF
mkdir "$DIR/folder.safetensors"
mkfifo "$DIR/pipe.safetensors" 2>/dev/null || true

# run_lwo ARGS...: lwo ARGS with no GPU visible, its stdout and stderr kept
# in $DIR/.out and $DIR/.err.
run_lwo() {
  CUDA_VISIBLE_DEVICES="" timeout 60 "$LWO" "$@" >"$DIR/.out" 2>"$DIR/.err"
}
# check CMD WANT_RC FILE WORD [EXTRA ARGS...]: lwo CMD --quiet EXTRA... FILE
# must exit WANT_RC, with no signal and no sanitizer report, and its output
# say WORD; on failure (WANT_RC != 0) stderr must begin with "lwo CMD: " and
# name FILE (an index by its folder).
check() {
  local cmd="$1" want_rc="$2" file="$3" word="$4"
  shift 4
  local args=("$cmd" --quiet "$@" "$DIR/$file") rc err what
  n=$((n + 1))
  run_lwo "${args[@]}"
  rc=$?
  err=$(cat "$DIR/.err")
  what="lwo $cmd ${*:+$* }$file"
  if [ "$rc" -ge 124 ]; then
    echo "FAIL: $what crashed or hung: exit $rc: $err"; fails=$((fails + 1)); return
  fi
  if grep -qE 'Sanitizer|runtime error:' "$DIR/.err"; then
    echo "FAIL: $what: a sanitizer report: $err"; fails=$((fails + 1)); return
  fi
  if [ "$rc" -ne "$want_rc" ]; then
    echo "FAIL: $what exited $rc, not $want_rc: $err"; fails=$((fails + 1)); return
  fi
  if [ "$want_rc" -ne 0 ]; then
    if [[ "$err" != "lwo $cmd: "* ]]; then
      echo "FAIL: $what: stderr does not begin with 'lwo $cmd: ': $err"; fails=$((fails + 1)); return
    fi
    # A plain file by its name; an index by its folder, which the shard
    # paths its messages give hold too.
    local named="${file##*/}"
    [[ "$file" == idx/*/model.safetensors.index.json ]] && named="${file%/*}"
    if [ "$name_file" = 1 ] && [[ "$err" != *"$named"* ]]; then
      echo "FAIL: $what: stderr does not name $named: $err"; fails=$((fails + 1)); return
    fi
  fi
  # A usage error is two lines, the error and a hint; a file that cannot be
  # read is one line (the no-device message has a hint line too).
  local lines
  lines=$(wc -l <"$DIR/.err")
  if [ "$want_rc" -eq 2 ] && { [ "$lines" -ne 2 ] || [[ "$(tail -1 "$DIR/.err")" != "run 'lwo "* ]]; }; then
    echo "FAIL: $what: not an error line and a hint line: $err"; fails=$((fails + 1)); return
  fi
  if [ "$want_rc" -eq 1 ] && [ "$name_file" = 1 ] && [ "$lines" -ne 1 ]; then
    echo "FAIL: $what: $lines lines on stderr, not 1: $err"; fails=$((fails + 1)); return
  fi
  if [[ "$err$(cat "$DIR/.out")" != *"$word"* ]]; then
    echo "FAIL: $what: the output does not say '$word': $err"; fails=$((fails + 1)); return
  fi
  echo "ok: $what: exit $rc, '$word'"
}
# bad FILE WORD: a file that cannot be read: lwo info and lwo stream exit 1
# with the library's message, lwo stream before it reaches the GPU.
bad() {
  check info 1 "$1" "$2"
  check stream 1 "$1" "$2"
  if grep -q "no CUDA device" "$DIR/.err"; then
    echo "FAIL: lwo stream $1 reached the GPU: $(cat "$DIR/.err")"; fails=$((fails + 1))
  fi
}

bad empty.safetensors "shorter than the 8-byte header length"
bad short.safetensors "LWO_ERR_TRUNCATED"
bad zero_length.safetensors "header length is 0"
bad cut_header.safetensors "the file holds only"
bad past_file.safetensors "LWO_ERR_BAD_HEADER_SIZE"
bad huge_length.safetensors "above the limit"
bad bad_json.safetensors "not valid JSON"
bad not_object.safetensors "not a JSON object"
bad nul_byte.safetensors "LWO_ERR_BAD_JSON"
bad nul_escape.safetensors "NUL character"
bad bad_utf8.safetensors "LWO_ERR_BAD_JSON"
bad no_offsets.safetensors "has no"
bad bad_dtype.safetensors "unknown dtype"
bad lower_dtype.safetensors "unknown dtype"
bad shape_mismatch.safetensors "LWO_ERR_SHAPE_MISMATCH"
bad shape_overflow.safetensors "LWO_ERR_SHAPE_OVERFLOW"
bad float_shape.safetensors "not a non-negative integer"
bad past_data.safetensors "LWO_ERR_TRUNCATED"
bad offsets_64bit.safetensors "beyond 64 bits"
bad reversed.safetensors "begin after their end"
bad overlap.safetensors "LWO_ERR_OVERLAP"
bad duplicate.safetensors "appears twice"
bad missing.safetensors "No such file"
bad folder.safetensors "is a folder"
[ -p "$DIR/pipe.safetensors" ] && bad pipe.safetensors "is a named pipe"
bad idx/missing/model.safetensors.index.json "absent-00001.safetensors"
bad idx/dotdot/model.safetensors.index.json '".." component'
bad idx/absolute/model.safetensors.index.json "is absolute"
bad idx/empty/model.safetensors.index.json "names no tensor"
bad idx/no_map/model.safetensors.index.json 'no "weight_map"'
bad idx/bad_json/model.safetensors.index.json "not valid JSON"
bad idx/not_in_shard/model.safetensors.index.json "is not in shard"
bad idx/bad_shard/model.safetensors.index.json "unknown dtype"
bad idx/symlink/model.safetensors.index.json "lies outside the index's folder"
# Layers 2^20 apart: lwo info lists gaps, but not millions of them; lwo stream
# refuses the gap, a usage error.
check info 1 far.safetensors "beyond the 1048576 layers" --pattern 'blocks.{i}.'
check stream 2 far.safetensors "has no tensor matching" --pattern 'blocks.{i}.'
# Gaps: lwo info lists them, lwo stream refuses them (exit 2, with the hint).
check info 0 gaps.safetensors "gaps"
check stream 2 gaps.safetensors "run 'lwo info"
# Patterns and names that do not fit the checkpoint: usage errors.
check info 2 good.safetensors "matches the layer pattern" --pattern 'nothing.{i}.'
check stream 2 good.safetensors "matches the layer pattern" --pattern 'nothing.{i}.'
check info 2 good.safetensors "blocks.1.nothing" --names "$DIR/names.txt"
check stream 2 good.safetensors "blocks.1.nothing" --names "$DIR/names.txt"
check info 0 no_layers.safetensors "no default pattern"
check stream 2 no_layers.safetensors "no default pattern"
# Valid files: lwo info succeeds (its JSON too), lwo stream reads them and
# stops at the GPU it cannot see (exit 1, the no-device message and its hint).
check info 0 good.safetensors "blocks.1.w"
check info 0 idx/good/model.safetensors.index.json "b.safetensors"
check info 0 good.safetensors "blocks.0.w" --json "$DIR/good.json"
if ! "$PY" -c 'import json, sys; j = json.load(open(sys.argv[1])); assert j["tool"] == "lwo" and len(j["tensors"]) == 2, j' \
     "$DIR/good.json"; then
  echo "FAIL: lwo info --json wrote no valid JSON of two tensors"; fails=$((fails + 1))
fi
name_file=0
check stream 1 good.safetensors "no CUDA device"
check stream 1 idx/good/model.safetensors.index.json "lwo info and lwo help need no GPU"

if [ "$fails" -ne 0 ]; then
  echo "$fails of $n case(s) failed"
  exit 1
fi
echo "all $n cases: the documented exit status and message, no crash"
