"""Loading, version, statuses, errors, dtypes and record layouts: no GPU."""

import ctypes
import os
import subprocess
import sys

import pytest

import lwo
from lwo import _capi as C

from conftest import REPO

ALIGN = lwo.LWO_RECORD_ALIGN


def _run_python(code, **env):
    full = dict(os.environ)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, cwd=str(REPO / "python"))


# ---- loading and version --------------------------------------------------
def test_library_loads_and_version_matches():
    assert lwo.capi.lib is not None
    assert lwo.version()[:2] == (lwo.LWO_VERSION_MAJOR, lwo.LWO_VERSION_MINOR) == (0, 5)
    assert lwo.capi.lib.lwo_version() // 100 == lwo.LWO_VERSION // 100
    if os.environ.get("LWO_LIBRARY"):
        assert lwo.capi.path == os.environ["LWO_LIBRARY"]


def test_missing_library_names_the_place_looked_at(tmp_path):
    missing = str(tmp_path / "nope" / "liblwo.so")
    r = _run_python("import lwo", LWO_LIBRARY=missing)
    assert r.returncode != 0
    assert "LibraryNotFound" in r.stderr and "LWO_LIBRARY" in r.stderr and missing in r.stderr


def test_no_library_anywhere_names_every_place(tmp_path):
    import shutil
    pkg = tmp_path / "python" / "lwo"
    shutil.copytree(str(REPO / "python" / "lwo"), str(pkg),
                    ignore=shutil.ignore_patterns("liblwo.so*", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("LWO_LIBRARY", "LD_LIBRARY_PATH")}
    r = subprocess.run([sys.executable, "-c", "import lwo"], env=env, capture_output=True,
                       text=True, cwd=str(pkg.parent))
    if r.returncode == 0:
        pytest.skip("a liblwo is installed where the system loader finds it")
    assert "LibraryNotFound" in r.stderr
    for place in ("next to the package", str(pkg / "liblwo.so*"),
                  "the system loader", "liblwo.so.0.5", "LWO_LIBRARY"):
        assert place in r.stderr, place
    # a copy outside the source tree (an installed package) has no build
    # folder beside it to name
    assert "the repository's build folder" not in r.stderr
    assert str(tmp_path / "build" / "liblwo.so") not in r.stderr


def test_a_bare_name_is_the_system_loaders(tmp_path):
    import shutil
    lib = os.environ.get("LWO_LIBRARY") or str(REPO / "build" / "liblwo.so")
    if not os.path.exists(lib):
        pytest.skip("no built liblwo to copy")
    shutil.copy(lib, str(tmp_path / "liblwo.so"))
    code = "import sys; sys.path.insert(0, %r); import lwo; print(lwo.version())" % (
        str(REPO / "python"))
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["LWO_LIBRARY"] = "liblwo.so"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=str(tmp_path))
    assert r.returncode != 0  # not looked up in the current folder
    assert "looked up by the system loader" in r.stderr and "./liblwo.so" in r.stderr
    env["LD_LIBRARY_PATH"] = str(tmp_path)  # where the system loader looks
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(lwo.version())


def test_search_order_without_the_variable():
    # _capi.py alone, so that no library needs to load
    code = ("import importlib.util as u\n"
            "s = u.spec_from_file_location('c', 'lwo/_capi.py')\n"
            "c = u.module_from_spec(s); s.loader.exec_module(c)\n"
            "for where, p in c.candidates(): print(where, '|', p)\n")
    env = {k: v for k, v in os.environ.items() if k != "LWO_LIBRARY"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=str(REPO / "python"))
    assert r.returncode == 0, r.stderr
    places = [line.split(" | ")[0] for line in r.stdout.splitlines()]
    assert places[0] == "next to the package"
    assert "the repository's build folder" in places
    assert places[-1] == "the system loader"
    assert places.index("the repository's build folder") < places.index("the system loader")
    assert str(REPO / "build" / "liblwo.so") in r.stdout
    assert "liblwo.so.0.5" in r.stdout


def test_other_minor_version_is_refused(cc, tmp_path):
    src = tmp_path / "fake.c"
    src.write_text("unsigned lwo_version(void) { return 601; }\n")
    so = tmp_path / "libfake.so"
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    r = _run_python("import lwo", LWO_LIBRARY=str(so))
    assert r.returncode != 0
    assert "VersionMismatch" in r.stderr and "0.6.1" in r.stderr and "0.5" in r.stderr


# ---- statuses and errors --------------------------------------------------
def test_every_status_name():
    assert len(C.STATUSES) == 36  # LWO_ERR_QUANTIZED_WEIGHT, LWO_ERR_OVER_BUDGET since 0.4.0,
    # LWO_ERR_CAPTURING since 0.6.0
    for name, value in C.STATUSES.items():
        assert lwo.status_string(value) == name
    assert lwo.status_string(999) == "unknown status"
    assert lwo.status_string(lwo.LWO_STATUS_FORCE_32) == "unknown status"


EXPECTED_CLASS = {1: lwo.ArgumentError, 2: lwo.StateError, 3: lwo.ResourceError,
                  4: lwo.DeviceError, 5: lwo.FormatError, 6: lwo.CollectiveError,
                  9: lwo.InternalError}


def test_error_classes_by_status_class():
    for name, value in C.STATUSES.items():
        if value in (lwo.LWO_OK, lwo.LWO_END):
            assert lwo.check(value) == value
            continue
        cls = lwo.error_class(value)
        if value == lwo.LWO_ERR_OVER_BUDGET:  # its own class, within its status class
            assert cls is lwo.OverBudgetError and issubclass(cls, lwo.ResourceError)
        else:
            assert cls is EXPECTED_CLASS[value // 100], name
        assert issubclass(cls, lwo.Error)
        err = cls(value, "lwo_x: why")
        assert err.status == value and err.status_name == name and err.message == "lwo_x: why"
        assert name in str(err) and "lwo_x: why" in str(err)
    assert issubclass(lwo.ArgumentError, ValueError)
    assert issubclass(lwo.ResourceError, OSError)


def test_argument_error_names_the_c_function():
    with pytest.raises(lwo.ArgumentError) as info:
        lwo.Engine(device=-2)
    e = info.value
    assert e.status == lwo.LWO_ERR_INVALID_ARGUMENT
    assert e.status_name == "LWO_ERR_INVALID_ARGUMENT"
    assert e.message.startswith("lwo_engine_create")
    assert "-2" in e.message
    assert lwo.last_error_message().startswith("lwo_engine_create")


def test_checking_is_an_engine_flag_the_library_accepts(monkeypatch):
    seen = []
    real = lwo._core._lib.lwo_engine_create

    def spy(cfg, out):
        seen.append(cfg._obj.flags)  # the config passed by reference
        return real(cfg, out)

    monkeypatch.setattr(lwo._core._lib, "lwo_engine_create", spy)
    for checking in (False, True):
        with pytest.raises(lwo.ArgumentError) as info:
            lwo.Engine(device=-2, checking=checking)
        # The flag passed the check of the flags: the device is what is refused.
        assert "device -2" in info.value.message
    assert seen == [0, C.LWO_ENGINE_CHECKING]
    with pytest.raises(lwo.ArgumentError) as info:
        lwo.Engine(device=0, flags=0x80000000)
    assert "unknown flags" in info.value.message


def test_no_device_is_a_device_error_that_says_why():
    try:
        engine = lwo.Engine()
    except lwo.DeviceError as e:
        assert e.status == lwo.LWO_ERR_NO_DEVICE
        assert e.message.startswith("lwo_engine_create: ")
        assert len(e.message) > len("lwo_engine_create: ") + 10
        return
    engine.close()
    pytest.skip("this machine has a CUDA device")


def test_success_clears_the_message():
    with pytest.raises(lwo.ArgumentError):
        lwo.Engine(device=-2)
    lwo.record_layout([("w", "f32", [4])])
    assert lwo.last_error_message() == ""


# ---- dtypes ---------------------------------------------------------------
DTYPES = {  # C name: (lwo name, bytes)
    "LWO_DTYPE_F32": ("f32", 4), "LWO_DTYPE_BF16": ("bf16", 2), "LWO_DTYPE_F16": ("f16", 2),
    "LWO_DTYPE_F8_E4M3": ("f8_e4m3", 1), "LWO_DTYPE_F8_E5M2": ("f8_e5m2", 1),
    "LWO_DTYPE_I8": ("i8", 1), "LWO_DTYPE_U8": ("u8", 1), "LWO_DTYPE_BOOL": ("bool", 1),
    "LWO_DTYPE_I16": ("i16", 2), "LWO_DTYPE_U16": ("u16", 2), "LWO_DTYPE_I32": ("i32", 4),
    "LWO_DTYPE_U32": ("u32", 4), "LWO_DTYPE_I64": ("i64", 8), "LWO_DTYPE_U64": ("u64", 8),
    "LWO_DTYPE_F64": ("f64", 8), "LWO_DTYPE_F8_E8M0": ("f8_e8m0", 1),
    "LWO_DTYPE_C64": ("c64", 8),
}


def test_every_dtype_name_and_size():
    assert sorted(DTYPES) == sorted(C.DTYPES)
    for cname, (name, size) in DTYPES.items():
        value = getattr(lwo, cname)
        assert lwo.dtype_name(value) == name
        assert lwo.dtype_size(value) == size
        assert lwo.dtype(name) == value
        assert lwo.dtype(cname) == value
        assert lwo.dtype(name.upper()) == value  # safetensors-style
    assert lwo.dtype_name(99) == "unknown" and lwo.dtype_size(99) == 0


def test_dtype_aliases():
    assert lwo.dtype("bfloat16") == lwo.LWO_DTYPE_BF16
    assert lwo.dtype("torch.float16") == lwo.LWO_DTYPE_F16
    assert lwo.dtype("float32") == lwo.LWO_DTYPE_F32
    assert lwo.dtype("float8_e4m3fn") == lwo.LWO_DTYPE_F8_E4M3
    with pytest.raises(ValueError):
        lwo.dtype("float128")
    with pytest.raises(TypeError):
        lwo.dtype(True)


# ---- record layout --------------------------------------------------------
def _expected_layout(tensors):
    offsets, at = [], 0
    for _name, dt, shape in tensors:
        n = 1
        for d in shape:
            n *= d
        offsets.append(at)
        at += -(-n * lwo.dtype_size(dt) // ALIGN) * ALIGN
    return offsets, at


@pytest.mark.parametrize("layer", [
    [("w", "f32", [3])],
    [("w", "bf16", [256, 128]), ("b", "bf16", [256])],
    [("a", "f32", [3]), ("z", "f32", [0]), ("b", "bf16", [300]), ("s", "f64", [])],
    [("q", "f8_e4m3", [7, 9]), ("k", "i64", [1, 1, 33]), ("c", "c64", [2, 2, 2, 2])],
    [],
])
def test_record_layout_follows_the_alignment_rule(layer):
    offsets, record = lwo.record_layout(layer)
    assert (offsets, record) == _expected_layout(layer)
    assert record % ALIGN == 0 and all(o % ALIGN == 0 for o in offsets)


def test_record_layout_takes_dicts():
    layer = [{"name": "w", "dtype": lwo.LWO_DTYPE_F16, "shape": (10, 10)},
             {"name": "b", "dtype": "f16", "shape": [10]}]
    assert lwo.record_layout(layer) == ([0, 256], 512)


def test_record_layout_errors_name_the_c_function():
    with pytest.raises(lwo.ArgumentError) as info:
        lwo.record_layout([("w", "f32", [-1])])
    assert info.value.message.startswith("lwo_record_layout")
    with pytest.raises(lwo.ArgumentError) as info:
        lwo.record_layout([("w", 77, [1])])
    assert info.value.message.startswith("lwo_record_layout")
    with pytest.raises(lwo.ArgumentError):
        lwo.record_layout([("w", "f32", [1]), ("w", "f32", [1])])
    with pytest.raises(ValueError):
        lwo.record_layout([("w", "f32", [1] * 9)])


def test_conv2d_output_size_needs_no_device():
    d = lwo.conv2d_desc(3, 8, 3, dtype="f32", stride=2, padding=1)
    assert d.size == ctypes.sizeof(lwo.lwo_conv2d_desc)
    assert lwo.conv2d_output_size(d, 32, 32) == (16, 16)
    with pytest.raises(lwo.ArgumentError) as info:
        lwo.conv2d_output_size(lwo.conv2d_desc(3, 8, 5), 2, 2)
    assert info.value.message.startswith("lwo_conv2d_output_size")


def test_conv2d_desc_takes_a_weight_format():
    # Since 0.5.0: the weight quantized as [out_channels, in_channels / groups * kh * kw].
    d = lwo.conv2d_desc(32, 16, 2, weight_format="int4")
    assert d.weight_format == C.LWO_QUANT_INT4_GROUP128
    assert d.size == ctypes.sizeof(lwo.lwo_conv2d_desc)
    assert lwo.conv2d_output_size(d, 9, 9) == (8, 8)  # 32 * 2 * 2 = 128 cols: valid
    assert lwo.conv2d_desc(32, 16, 2).weight_format == C.LWO_QUANT_NONE
    with pytest.raises(lwo.ArgumentError) as info:  # 8 * 3 * 3 = 72 cols
        lwo.conv2d_output_size(lwo.conv2d_desc(8, 16, 3, weight_format="int4"), 9, 9)
    assert info.value.status == C.LWO_ERR_INVALID_ARGUMENT, info.value
    assert info.value.message.startswith("lwo_conv2d_output_size"), info.value.message
    assert "out_channels 16 and 72 cols" in info.value.message, info.value.message
