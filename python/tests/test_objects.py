"""The Python objects' parts that need no device: streams, pointers, views
and their __cuda_array_interface__, host buffers, handles."""

import ctypes
import os

import pytest

import lwo
from lwo import _core


class _Proto:
    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class _TorchLike:  # what torch.cuda.Stream offers
    cuda_stream = 0x5678


def test_streams():
    assert lwo.stream_handle(None) is None
    assert lwo.stream_handle(0) is None
    assert lwo.stream_handle(0x1234) == 0x1234
    assert lwo.stream_handle(_Proto(0xABC)) == 0xABC
    assert lwo.stream_handle(_TorchLike()) == 0x5678
    assert lwo.stream_handle(ctypes.c_void_p(0x99)) == 0x99
    with pytest.raises(TypeError):
        lwo.stream_handle("stream")
    with pytest.raises(TypeError):
        lwo.stream_handle(True)

    class Bad:
        def __cuda_stream__(self):
            return 7
    with pytest.raises(TypeError):
        lwo.stream_handle(Bad())


def test_device_pointers():
    class CAI:
        __cuda_array_interface__ = {"data": (0x1000, False), "shape": (1,),
                                    "typestr": "<f4", "version": 3}

    class TorchLike:
        def data_ptr(self):
            return 0x2000

    assert lwo.device_pointer(None) is None
    assert lwo.device_pointer(0x10) == 0x10
    assert lwo.device_pointer(CAI()) == 0x1000
    assert lwo.device_pointer(TorchLike()) == 0x2000
    with pytest.raises(TypeError):
        lwo.device_pointer(object())


class _FakePool:
    def __init__(self, infos):
        self.infos = infos

    def tensors(self, layer):
        return self.infos


def _fake_view(layer, addrs, nbytes, dtypes):
    n = len(addrs)
    t = (ctypes.c_void_p * n)(*addrs)
    b = (ctypes.c_uint64 * n)(*nbytes)
    d = (ctypes.c_int * n)(*dtypes)
    v = lwo.lwo_layer_view()
    v.layer, v.n_tensors, v.base, v.record_bytes = layer, n, addrs[0], 1024
    v.tensors = ctypes.cast(t, ctypes.POINTER(ctypes.c_void_p))
    v.tensor_bytes = ctypes.cast(b, ctypes.POINTER(ctypes.c_uint64))
    v.tensor_dtypes = ctypes.cast(d, ctypes.POINTER(ctypes.c_int))
    return v, (t, b, d)


def test_layer_view_and_cuda_array_interface():
    infos = [lwo.TensorInfo("w", lwo.LWO_DTYPE_BF16, (4, 8), 0, 64),
             lwo.TensorInfo("b", lwo.LWO_DTYPE_F32, (4,), 256, 16),
             lwo.TensorInfo("s", lwo.LWO_DTYPE_I64, (), 512, 8)]
    base = 0x7F0000000000
    v, keep = _fake_view(3, [base, base + 256, base + 512], [64, 16, 8],
                         [lwo.LWO_DTYPE_BF16, lwo.LWO_DTYPE_F32, lwo.LWO_DTYPE_I64])
    owner = object()
    view = lwo.LayerView(owner, _FakePool(infos), v, device=1)
    del keep
    assert view.layer == 3 and len(view) == 3 and view.names == ["w", "b", "s"]
    assert view.base == base and view.record_bytes == 1024 and view.owner is owner
    w, b, s = view
    assert view["b"] is b and view.tensor(0) is w
    with pytest.raises(KeyError):
        view.tensor("nope")
    assert w.__cuda_array_interface__ == {"shape": (4, 8), "typestr": "<V2",
                                          "data": (base, False), "strides": None,
                                          "version": 3}
    assert b.__cuda_array_interface__["typestr"] == "<f4"
    assert b.__cuda_array_interface__["data"][0] == base + 256
    assert s.__cuda_array_interface__["shape"] == ()
    assert s.__cuda_array_interface__["typestr"] == "<i8"
    assert w.device == 1 and w.bytes == 64


def test_typestr_of_every_dtype():
    for value in lwo.capi.DTYPES.values():
        t = _core.TensorView("x", value, (1,), 0, 0, 0, None)
        ts = t.__cuda_array_interface__["typestr"]
        assert ts[0] in "<|" and int(ts[2:]) == lwo.dtype_size(value)


def test_torch_helper_imports_torch_lazily():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c",
                        "import sys, lwo; print('torch' in sys.modules)"],
                       capture_output=True, text=True, cwd=os.path.dirname(lwo.capi._PACKAGE_DIR))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_host_buffers():
    addr, n, keep = _core._host_buffer(b"abcd")
    assert n == 4 and ctypes.string_at(addr, 4) == b"abcd"
    ba = bytearray(b"xyz")
    addr, n, keep = _core._host_buffer(ba)
    assert n == 3 and ctypes.string_at(addr, 3) == b"xyz"
    arr = (ctypes.c_float * 2)(1.0, 2.0)
    addr, n, keep = _core._host_buffer(arr)
    assert addr == ctypes.addressof(arr) and n == 8
    addr, n, keep = _core._host_buffer(memoryview(b"12345678").cast("B")[2:6])
    assert n == 4 and ctypes.string_at(addr, 4) == b"3456"
    assert _core._host_buffer(0x1000, 16)[:2] == (0x1000, 16)
    with pytest.raises(TypeError):
        _core._host_buffer(0x1000)
    mem = lwo.HostMemory(ctypes.addressof(arr), 8)
    assert mem.memoryview().tobytes() == bytes(arr)
    shard = lwo.TensorShard(ctypes.addressof(arr), 0, 2)
    assert shard.memoryview().tolist() == [1.0, 2.0]


def test_tickets():
    t = lwo.Ticket(5, layer=2)
    assert int(t) == 5 and t == 5 and t == lwo.Ticket(5) and hash(t) == hash(5)
    assert _core._ticket(t).id == 5 and _core._ticket(7).id == 7


def test_pool_is_made_by_its_constructors():
    with pytest.raises(TypeError):
        lwo.Pool()
    engine = object.__new__(lwo.Engine)  # a closed engine
    assert engine.closed
    with pytest.raises(ValueError):
        lwo.Pool.create_pinned(engine, [[("w", "f32", [4])]])
    engine.close()  # idempotent on a closed object
    with pytest.raises(ValueError):  # a closed object cannot be entered
        with engine:
            pass


def test_tensor_specs():
    specs = _core._layer_tensors({"tensors": [("w", "bf16", [2, 3]),
                                              {"name": "b", "dtype": "f32", "shape": [3]}]})
    assert specs[0] == lwo.TensorSpec("w", "bf16", (2, 3), None)
    assert specs[1] == lwo.TensorSpec("b", "f32", (3,), None)
    with pytest.raises(ValueError):
        _core._layer_tensors([("w", "f32")])
    with pytest.raises(ValueError):  # host_data only for registered pools
        _core._layer_descs([[("w", "f32", [1], b"1234")]])


def test_descriptors():
    d = lwo.linear_desc(256, 512, dtype="f16", bias=True)
    assert (d.size, d.dtype, d.flags, d.in_features, d.out_features) == (
        ctypes.sizeof(lwo.lwo_linear_desc), lwo.LWO_DTYPE_F16, lwo.LWO_LINEAR_BIAS, 256, 512)
    c = lwo.conv2d_desc(3, 8, (3, 5), layout="nchw", bias=True, tf32=True, groups=1)
    assert (c.kernel_h, c.kernel_w, c.layout, c.flags) == (
        3, 5, lwo.LWO_LAYOUT_NCHW, lwo.LWO_CONV_BIAS | lwo.LWO_CONV_TF32)
    assert (c.stride_h, c.dilation_w, c.pad_h) == (1, 1, 0)
    uid = lwo.lwo_nccl_unique_id.from_buffer_copy(bytes(range(128)))
    assert bytes(uid) == bytes(range(128))


def test_torch_helper_with_a_stand_in_torch(monkeypatch):
    """.torch() without torch or a GPU: a stand-in module records what it is
    given (the raw integer interface, the device) and what it is viewed as."""
    import types

    seen = {}

    class FakeTensor:
        def __init__(self, cai, device):
            seen["cai"], seen["device"] = cai, device

        def view(self, dt):
            seen["view"] = dt
            return self

    fake = types.ModuleType("torch")
    fake.__version__ = "0-stand-in"
    for name in set(_core._TORCH_DTYPE.values()) - {"float8_e8m0fnu"}:
        setattr(fake, name, "torch." + name)
    fake.as_tensor = lambda obj, device: FakeTensor(obj.__cuda_array_interface__, device)
    monkeypatch.setitem(__import__("sys").modules, "torch", fake)

    t = _core.TensorView("w", lwo.LWO_DTYPE_BF16, (2, 3), 12, 0x4000, 2, None)
    t.torch()
    assert seen["device"] == "cuda:2" and seen["view"] == "torch.bfloat16"
    assert seen["cai"]["typestr"] == "<i2" and seen["cai"]["shape"] == (2, 3)
    assert seen["cai"]["data"] == (0x4000, False) and seen["cai"]["version"] == 3
    _core.TensorView("c", lwo.LWO_DTYPE_C64, (4,), 32, 0x8000, 0, None).torch()
    assert seen["cai"]["typestr"] == "<i8" and seen["view"] == "torch.complex64"
    with pytest.raises(TypeError):  # this stand-in has no float8_e8m0fnu
        _core.TensorView("e", lwo.LWO_DTYPE_F8_E8M0, (4,), 4, 0x8000, 0, None).torch()
