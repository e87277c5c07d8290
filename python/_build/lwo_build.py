"""The lwo package's build backend (PEP 517, in the tree: pyproject.toml's
backend-path): setuptools' own, with liblwo built by CMake from the source
tree beside python/ and put inside the wheel, next to the package, where
`import lwo` looks first after LWO_LIBRARY.

Where liblwo comes from, in order:
- LWO_PREBUILT_LIBRARY: a liblwo.so built already (copied as it is);
- the source tree's build folder, when it is configured (build/CMakeCache.txt:
  `cmake --build build` of the library alone, nothing to do when it is up to
  date),
  or LWO_BUILD_DIR;
- else a build folder of its own (python/build/liblwo), configured with the
  tests, benchmarks, program and examples left out.
Without a source tree (an sdist) and without LWO_PREBUILT_LIBRARY the wheel
cannot hold a liblwo, and the build fails saying so. The library is copied
into the package only for the wheel's build and removed after it, so that no
copy is left in the source tree to shadow a later build.
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401  (the hooks this backend keeps as they are)
    build_sdist, get_requires_for_build_sdist, get_requires_for_build_wheel,
    prepare_metadata_for_build_wheel,
)

_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REPO = os.path.dirname(_PYTHON)
_PKG = os.path.join(_PYTHON, "lwo")


def _say(msg):
    print("lwo build: %s" % msg, file=sys.stderr, flush=True)


def _run(cmd, env):
    _say(" ".join(cmd))
    r = subprocess.run(cmd, env=env)
    if r.returncode != 0:
        raise RuntimeError("lwo build: %s failed (exit %d); the build's own messages are above"
                           % (cmd[0], r.returncode))


def _built_library():
    """The path of a liblwo.so to put in the wheel (building it if needed)."""
    given = os.environ.get("LWO_PREBUILT_LIBRARY")
    if given:
        if not os.path.isfile(given):
            raise RuntimeError("lwo build: LWO_PREBUILT_LIBRARY=%s: no such file" % given)
        return given
    if not (os.path.isfile(os.path.join(_REPO, "CMakeLists.txt")) and
            os.path.isfile(os.path.join(_REPO, "include", "lwo.h"))):
        raise RuntimeError(
            "lwo build: no lwo source tree beside %s (CMakeLists.txt, include/lwo.h) to build "
            "liblwo from, and LWO_PREBUILT_LIBRARY is not set: build from the repository "
            "(pip install ./python) or name a built liblwo.so" % _PYTHON)
    env = dict(os.environ)
    if shutil.which("nvcc", path=env.get("PATH")) is None and \
            os.path.isfile("/usr/local/cuda/bin/nvcc"):
        env["PATH"] = "/usr/local/cuda/bin" + os.pathsep + env.get("PATH", "")
    build = os.environ.get("LWO_BUILD_DIR")
    if not build:
        repo_build = os.path.join(_REPO, "build")
        build = repo_build if os.path.isfile(os.path.join(repo_build, "CMakeCache.txt")) \
            else os.path.join(_PYTHON, "build", "liblwo")
    if not os.path.isfile(os.path.join(build, "CMakeCache.txt")):
        cmd = ["cmake", "-S", _REPO, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
               "-DLWO_BUILD_TESTS=OFF", "-DLWO_BUILD_BENCH=OFF", "-DLWO_BUILD_TOOLS=OFF",
               "-DLWO_BUILD_EXAMPLES=OFF"]
        if shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
        _run(cmd, env)
    # Ninja names the library by its file (its target name, lwo, is also the
    # file of the lwo program there); other generators by the target.
    target = "liblwo.so" if os.path.isfile(os.path.join(build, "build.ninja")) else "lwo"
    _run(["cmake", "--build", build, "--target", target, "-j", str(os.cpu_count() or 2)], env)
    lib = os.path.join(build, "liblwo.so")
    if not os.path.exists(lib):
        raise RuntimeError("lwo build: %s was not made by the build" % lib)
    return os.path.realpath(lib)


def _with_library(build):
    def hook(wheel_directory, config_settings=None, metadata_directory=None):
        src = _built_library()
        stale = glob.glob(os.path.join(_PKG, "liblwo.so*"))
        if stale:
            raise RuntimeError("lwo build: %s already holds %s; remove it (the build puts "
                               "liblwo there itself)" % (_PKG, ", ".join(stale)))
        dst = os.path.join(_PKG, "liblwo.so")
        shutil.copyfile(src, dst)
        _say("liblwo: %s -> the wheel's lwo/liblwo.so" % src)
        try:
            return build(wheel_directory, config_settings, metadata_directory)
        finally:
            os.remove(dst)
    hook.__name__ = build.__name__
    return hook


build_wheel = _with_library(_setuptools.build_wheel)
if hasattr(_setuptools, "build_editable"):
    # an editable install runs the package of the tree, which finds the
    # tree's build folder itself: nothing to put in it
    build_editable = _setuptools.build_editable
    get_requires_for_build_editable = _setuptools.get_requires_for_build_editable
    prepare_metadata_for_build_editable = _setuptools.prepare_metadata_for_build_editable
