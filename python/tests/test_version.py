"""One version: include/lwo.h's LWO_VERSION_MAJOR/MINOR/PATCH. CMake reads it
from there; the Python package states it in three places (pyproject.toml,
lwo.__version__, the binding's constants), each checked against it here.
No GPU, no library needed beyond the package's import."""

import re

import lwo
from lwo import _capi as C

from conftest import HEADER, REPO


def header_version():
    text = HEADER.read_text()
    parts = []
    for part in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(r"^#define LWO_VERSION_%s +([0-9]+)" % part, text, re.M)
        assert m, "no LWO_VERSION_%s in lwo.h" % part
        parts.append(int(m.group(1)))
    return tuple(parts)


def test_the_package_states_the_headers_version():
    v = header_version()
    text = "%d.%d.%d" % v
    assert lwo.__version__ == text
    assert (C.LWO_VERSION_MAJOR, C.LWO_VERSION_MINOR, C.LWO_VERSION_PATCH) == v
    assert C.LWO_VERSION == v[0] * 10000 + v[1] * 100 + v[2]
    m = re.search(r'^version = "([^"]+)"$', (REPO / "python" / "pyproject.toml").read_text(),
                  re.M)
    assert m and m.group(1) == text
    # the loaded library is of the same minor (load() refuses others)
    assert lwo.version()[:2] == v[:2]


def test_cmake_reads_the_version_from_the_header():
    text = (REPO / "CMakeLists.txt").read_text()
    m = re.search(r"^project\(lwo VERSION ([^ \n]+)", text, re.M)
    assert m, "no project(lwo VERSION ...) in CMakeLists.txt"
    assert not re.match(r"[0-9]", m.group(1)), (
        "CMakeLists.txt states the version itself (%s): it reads include/lwo.h's" % m.group(1))
    assert "include/lwo.h" in text and "LWO_VERSION_" in text


def test_the_docs_state_the_headers_version():
    v = header_version()
    api = (REPO / "docs" / "API.md").read_text()
    m = re.search(r"This guide describes\s+version ([0-9.]+) \(`LWO_VERSION` ([0-9]+)\)", api)
    assert m, "docs/API.md does not say which version it describes"
    assert m.group(1) == "%d.%d.%d" % v and int(m.group(2)) == v[0] * 10000 + v[1] * 100 + v[2]
    assert "`liblwo.so.%d.%d`" % v[:2] in api
    py = (REPO / "docs" / "PYTHON.md").read_text()
    m = re.search(r"refuses a library that is not ([0-9]+)\.([0-9]+)\.x", py)
    assert m and (int(m.group(1)), int(m.group(2))) == v[:2]
    readme = (REPO / "README.md").read_text()
    for m in re.finditer(r"find_package\(lwo ([0-9]+)\.([0-9]+)", readme):
        assert (int(m.group(1)), int(m.group(2))) == v[:2], m.group(0)
