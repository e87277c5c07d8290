"""The ctypes mirrors against the C compiler's view of include/lwo.h: every
struct's size, alignment and field offsets and sizes, every enum value and
macro, and every function's parameter count and pointer-ness."""

import ctypes
import re
import subprocess

import lwo
from lwo import _capi as C

from conftest import HEADER


def _header_text():
    text = HEADER.read_text()
    return re.sub(r"/\*.*?\*/", " ", text, flags=re.S)


def header_structs():
    """{struct name: [field names]} of every struct defined in lwo.h."""
    out = {}
    for name, body, tail in re.findall(r"typedef struct (\w+) \{(.*?)\}\s*(\w+)\s*;",
                                       _header_text(), flags=re.S):
        assert name == tail
        fields = []
        for decl in body.split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            for i, piece in enumerate(decl.split(",")):
                m = re.search(r"(\w+)\s*(\[[^\]]*\])?\s*$", piece)
                assert m, (name, decl)
                fields.append(m.group(1))
        out[name] = fields
    return out


def header_constants():
    """Names of every enum member and every object-like LWO_ macro of lwo.h
    (not the _INIT initialisers, the include guard or LWO_API)."""
    text = _header_text()
    names = []
    for body in re.findall(r"typedef enum \w+ \{(.*?)\}", text, flags=re.S):
        names += re.findall(r"\b(LWO_\w+)\s*=", body)
    for name in re.findall(r"^#define (LWO_\w+)[ \t]+\S", text, flags=re.M):
        if name.endswith("_INIT") or name in ("LWO_API", "LWO_H_"):
            continue
        names.append(name)
    return sorted(set(names))


def header_functions():
    """{function name: (return type, [parameter declarations])}."""
    out = {}
    for ret, name, params in re.findall(r"LWO_API\s+([\w\s\*]+?)\s*\b(lwo_\w+)\s*\(([^)]*)\)\s*;",
                                        _header_text()):
        params = " ".join(params.split())
        plist = [] if params in ("", "void") else [p.strip() for p in params.split(",")]
        out[name] = (" ".join(ret.split()), plist)
    return out


def _c_program():
    structs = header_structs()
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "lwo.h"',
             "int main(void) {"]
    for s, fields in structs.items():
        lines.append('  printf("S %s %%zu %%zu\\n", sizeof(%s), _Alignof(%s));' % (s, s, s))
        for f in fields:
            lines.append('  printf("F %s %s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s*)0)->%s));'
                         % (s, f, s, f, s, f))
    for c in header_constants():
        # Signed and unsigned 64-bit values alike (LWO_HOST_LIMIT_NONE is UINT64_MAX).
        lines.append('  printf("C %s %%s%%llu\\n", (%s) < 0 ? "-" : "", (%s) < 0 ? '
                     '0ull - (unsigned long long)(%s) : (unsigned long long)(%s));'
                     % (c, c, c, c, c))
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def c_view(cc, tmp_path):
    src = tmp_path / "layout.c"
    exe = tmp_path / "layout"
    src.write_text(_c_program())
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", str(HEADER.parent), str(src),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    sizes, fields, consts = {}, {}, {}
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "S":
            sizes[rest[0]] = (int(rest[1]), int(rest[2]))
        elif kind == "F":
            fields[(rest[0], rest[1])] = (int(rest[2]), int(rest[3]))
        else:
            consts[rest[0]] = int(rest[1])
    return sizes, fields, consts


def test_every_struct_is_mirrored_field_by_field():
    structs = header_structs()
    assert len(structs) >= 21
    assert sorted(structs) == sorted(C.STRUCTS)
    for name, fields in structs.items():
        assert [f[0] for f in C.STRUCTS[name]._fields_] == fields, name


def test_struct_layouts_match_the_c_compiler(cc, tmp_path):
    sizes, fields, _ = c_view(cc, tmp_path)
    assert sorted(sizes) == sorted(C.STRUCTS)
    problems = []
    for name, cls in C.STRUCTS.items():
        if (ctypes.sizeof(cls), ctypes.alignment(cls)) != sizes[name]:
            problems.append("%s: ctypes size/align %s, C %s"
                            % (name, (ctypes.sizeof(cls), ctypes.alignment(cls)), sizes[name]))
        for fname, _t in cls._fields_:
            desc = getattr(cls, fname)
            if (desc.offset, desc.size) != fields[(name, fname)]:
                problems.append("%s.%s: ctypes offset/size %s, C %s"
                                % (name, fname, (desc.offset, desc.size), fields[(name, fname)]))
    assert not problems, "\n".join(problems)


def test_constants_match_the_c_compiler(cc, tmp_path):
    _, _, consts = c_view(cc, tmp_path)
    assert len(consts) > 80
    missing = [n for n in consts if not hasattr(lwo, n)]
    assert not missing, "not in the lwo package: %s" % missing
    wrong = {n: (getattr(lwo, n), v) for n, v in consts.items() if getattr(lwo, n) != v}
    assert not wrong, "python vs C: %s" % wrong


def test_status_and_dtype_tables_are_complete():
    consts = header_constants()
    assert sorted(C.STATUSES) == sorted(
        n for n in consts if n in ("LWO_OK", "LWO_END") or n.startswith("LWO_ERR_"))
    assert sorted(C.DTYPES) == sorted(
        n for n in consts if n.startswith("LWO_DTYPE_") and n != "LWO_DTYPE_FORCE_32")


def _is_pointer(t):
    return t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, ctypes._Pointer)


def test_every_function_is_declared():
    funcs = header_functions()
    assert len(funcs) >= 80
    assert sorted(funcs) == sorted(C.FUNCTIONS)
    lib = C.lib
    by_value_struct = {"lwo_ticket"}
    for name, (ret, params) in funcs.items():
        restype, argtypes = C.FUNCTIONS[name]
        fn = getattr(lib, name)
        assert fn.restype is restype and list(fn.argtypes) == argtypes, name
        assert len(argtypes) == len(params), (name, params, argtypes)
        if ret == "void":
            assert restype is None, name
        elif ret == "lwo_status_t":
            assert restype is C.lwo_status_t, name
        elif "*" in ret:
            assert _is_pointer(restype), name
        for p, t in zip(params, argtypes):
            ptype = p.rsplit(" ", 1)[0] if "*" not in p else p
            if "*" in p or ptype in ("lwo_stream_t", "lwo_nccl_comm_t"):
                assert _is_pointer(t), (name, p, t)
            elif ptype in by_value_struct:
                assert t is C.STRUCTS[ptype], (name, p, t)
            else:
                assert not _is_pointer(t), (name, p, t)
