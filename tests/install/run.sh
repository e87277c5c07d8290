#!/usr/bin/env bash
# The install-and-consume test (ctest: install_and_consume, label unit): lwo as
# a user gets it from `cmake --install`. Needs no GPU.
#
#   1. installs the build tree BUILD_DIR to a fresh temporary prefix;
#   2. configures, builds and runs consumer.c with find_package(lwo 0.5)
#      (find_package/CMakeLists.txt), against that prefix only;
#   3. builds and runs consumer.c with pkg-config, as README.md says
#      (`-Wl,-rpath,$(pkg-config --variable=libdir lwo)` for the run time);
#   4. runs the installed lwo program (`lwo help`) with no LD_LIBRARY_PATH:
#      its relative run path ($ORIGIN/../lib) must find the installed liblwo.
# Each program must load liblwo from the temporary prefix, not from the build
# tree or the system. A failing step prints its command and its whole output.
#
#   tests/install/run.sh BUILD_DIR     # ctest passes the settings below
#   LWO_CMAKE, LWO_CC, LWO_GENERATOR, LWO_PKG_CONFIG, LWO_LIBDIR, LWO_BINDIR,
#   LWO_VERSION_STRING (e.g. 0.2.0), LWO_WITH_PROGRAM (1: lwo was built)
#   LWO_KEEP_TMP=1                     # keep the temporary folder
set -euo pipefail
if [ $# -ne 1 ] || [ ! -d "$1" ]; then
  echo "usage: $0 BUILD_DIR" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$1" && pwd)
cmake=${LWO_CMAKE:-cmake}
cc=${LWO_CC:-cc}
generator=${LWO_GENERATOR:-Ninja}
pkg_config=${LWO_PKG_CONFIG:-pkg-config}
libdir=${LWO_LIBDIR:-lib}
bindir=${LWO_BINDIR:-bin}
with_program=${LWO_WITH_PROGRAM:-1}
unset LD_LIBRARY_PATH PKG_CONFIG_PATH CMAKE_PREFIX_PATH

tmp=$(mktemp -d "${TMPDIR:-/tmp}/lwo-install-test.XXXXXX")
cleanup() {
  if [ "${LWO_KEEP_TMP:-0}" = 1 ]; then echo "kept: $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
prefix=$tmp/prefix

fail() {
  echo "install test FAILED: $*" >&2
  exit 1
}
# step NAME COMMAND...: runs COMMAND, its output to $tmp/NAME.log; on failure
# prints the command and the log.
step() {
  local name=$1
  shift
  if ! "$@" >"$tmp/$name.log" 2>&1; then
    {
      echo "install test FAILED at step '$name':"
      printf '  $'; printf ' %q' "$@"; echo
      sed 's/^/  | /' "$tmp/$name.log"
    } >&2
    exit 1
  fi
  echo "ok: $name"
}
# loads_installed_liblwo PROGRAM: the liblwo PROGRAM loads is the prefix's.
loads_installed_liblwo() {
  local lib
  lib=$(ldd "$1" | awk '$1 ~ /^liblwo\.so/ { print $3 }')
  if [ -z "$lib" ] || [ ! -e "$lib" ]; then ldd "$1" >&2; fail "$1 does not find liblwo"; fi
  [ "$(dirname "$(realpath "$lib")")" = "$(realpath "$prefix/$libdir")" ] ||
    fail "$1 loads $lib, not the liblwo installed in $prefix/$libdir"
  echo "ok: $(basename "$1") loads $lib"
}
# expect_consumer_output LOG: the consumer printed the version it checked.
expect_consumer_output() {
  local v=${LWO_VERSION_STRING:-}
  grep -q 'lwo_status_string(LWO_OK) = LWO_OK' "$1" || fail "unexpected output: $(cat "$1")"
  if [ -n "$v" ]; then
    grep -q "($v)" "$1" || fail "expected version $v, got: $(cat "$1")"
  fi
  sed 's/^/   /' "$1"
}

# 1. Install.
step install "$cmake" --install "$build" --prefix "$prefix"
[ -f "$prefix/include/lwo.h" ] || fail "no include/lwo.h in $prefix"
ls "$prefix/$libdir"/liblwo.so* >/dev/null 2>&1 || fail "no liblwo.so in $prefix/$libdir"

# 2. find_package(lwo 0.5).
step cmake-configure "$cmake" -S "$here/find_package" -B "$tmp/cmake-consumer" -G "$generator" \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
found=$(sed -n 's/^lwo_DIR:PATH=//p' "$tmp/cmake-consumer/CMakeCache.txt")
[ "$(realpath "$found")" = "$(realpath "$prefix/$libdir/cmake/lwo")" ] ||
  fail "find_package(lwo) found $found, not the package in $prefix"
step cmake-build "$cmake" --build "$tmp/cmake-consumer"
step cmake-run "$tmp/cmake-consumer/consumer"
expect_consumer_output "$tmp/cmake-run.log"
loads_installed_liblwo "$tmp/cmake-consumer/consumer"

# 3. pkg-config, with the run path README.md gives.
export PKG_CONFIG_PATH=$prefix/$libdir/pkgconfig
step pkg-config-modversion "$pkg_config" --modversion lwo
if [ -n "${LWO_VERSION_STRING:-}" ]; then
  [ "$(cat "$tmp/pkg-config-modversion.log")" = "$LWO_VERSION_STRING" ] ||
    fail "pkg-config says lwo $(cat "$tmp/pkg-config-modversion.log"), expected $LWO_VERSION_STRING"
fi
pc_libdir=$("$pkg_config" --variable=libdir lwo)
[ "$(realpath "$pc_libdir")" = "$(realpath "$prefix/$libdir")" ] ||
  fail "lwo.pc's libdir is $pc_libdir, not $prefix/$libdir"
# shellcheck disable=SC2046  # pkg-config's flags are meant to split
step pkg-config-build "$cc" -std=c11 -Wall -Wextra -pedantic -Werror "$here/consumer.c" \
  $("$pkg_config" --cflags --libs lwo) "-Wl,-rpath,$pc_libdir" -o "$tmp/pc-consumer"
step pkg-config-run "$tmp/pc-consumer"
expect_consumer_output "$tmp/pkg-config-run.log"
loads_installed_liblwo "$tmp/pc-consumer"

# 4. The installed program, by its relative run path.
if [ "$with_program" = 1 ]; then
  program=$prefix/$bindir/lwo
  [ -x "$program" ] || fail "no $program (lwo was built, so it must be installed)"
  step lwo-help "$program" help
  [ -s "$tmp/lwo-help.log" ] || fail "'lwo help' printed nothing"
  loads_installed_liblwo "$program"
else
  echo "skip: the lwo program (not built: LWO_BUILD_TOOLS=OFF)"
fi
echo "install test passed (prefix $prefix, removed after)"
