"""The Python objects over the C handles: Engine, Pool, Ring, Schedule,
Grads, Checkpoint, NcclComm, and the views, dtypes and streams they use."""

import collections
import contextlib
import ctypes
import os

from . import _capi as C
from ._errors import ArgumentError, check

_lib = C.lib  # set by lwo/__init__ (load) before this module is imported
_byref = ctypes.byref


def _enc(s):
    if s is None:
        return None
    b = s if isinstance(s, bytes) else \
        os.fsencode(s) if isinstance(s, os.PathLike) else str(s).encode()
    if b"\0" in b:  # C would take the part before it
        raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, "lwo: %r holds a NUL character (C "
                            "strings end there)" % (s,))
    return b


def _fit(value, bits, signed, what):
    """int(value), or ArgumentError if it does not fit the C integer (ctypes
    would wrap it silently)."""
    v = int(value)
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if not lo <= v <= hi:
        raise ArgumentError(C.LWO_ERR_OUT_OF_RANGE, "lwo: %s %d is outside [%d, %d] (a %s%d)"
                            % (what, v, lo, hi, "int" if signed else "uint", bits))
    return v


def _dec(b):
    return None if b is None else b.decode(errors="replace")


def _done(query, handle):
    """A lwo_*_query of `handle` (gradients, optimizer): whether its work is done."""
    done = ctypes.c_uint32()
    check(query(handle, _byref(done)))
    return bool(done.value)


# --------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------
_DTYPE_BY_NAME = {}
for _v in C.DTYPES.values():
    _DTYPE_BY_NAME[_lib.lwo_dtype_name(_v).decode()] = _v
_DTYPE_ALIASES = {
    "float32": C.LWO_DTYPE_F32, "float": C.LWO_DTYPE_F32, "bfloat16": C.LWO_DTYPE_BF16,
    "float16": C.LWO_DTYPE_F16, "half": C.LWO_DTYPE_F16, "float8_e4m3fn": C.LWO_DTYPE_F8_E4M3,
    "float8_e5m2": C.LWO_DTYPE_F8_E5M2, "int8": C.LWO_DTYPE_I8, "uint8": C.LWO_DTYPE_U8,
    "bool": C.LWO_DTYPE_BOOL, "int16": C.LWO_DTYPE_I16, "uint16": C.LWO_DTYPE_U16,
    "int32": C.LWO_DTYPE_I32, "uint32": C.LWO_DTYPE_U32, "int64": C.LWO_DTYPE_I64,
    "uint64": C.LWO_DTYPE_U64, "float64": C.LWO_DTYPE_F64, "double": C.LWO_DTYPE_F64,
    "float8_e8m0fnu": C.LWO_DTYPE_F8_E8M0, "complex64": C.LWO_DTYPE_C64,
}
# safetensors' names ("BF16", "F8_E4M3", ...), as lwo_checkpoint_tensor's dtype_name.
for _k, _v in list(C.DTYPES.items()):
    _DTYPE_ALIASES[_k[len("LWO_DTYPE_"):].lower()] = _v

# __cuda_array_interface__ typestr per dtype; 'V' where numpy has no type.
_TYPESTR = {
    C.LWO_DTYPE_F32: "<f4", C.LWO_DTYPE_BF16: "<V2", C.LWO_DTYPE_F16: "<f2",
    C.LWO_DTYPE_F8_E4M3: "|V1", C.LWO_DTYPE_F8_E5M2: "|V1", C.LWO_DTYPE_I8: "|i1",
    C.LWO_DTYPE_U8: "|u1", C.LWO_DTYPE_BOOL: "|b1", C.LWO_DTYPE_I16: "<i2",
    C.LWO_DTYPE_U16: "<u2", C.LWO_DTYPE_I32: "<i4", C.LWO_DTYPE_U32: "<u4",
    C.LWO_DTYPE_I64: "<i8", C.LWO_DTYPE_U64: "<u8", C.LWO_DTYPE_F64: "<f8",
    C.LWO_DTYPE_F8_E8M0: "|V1", C.LWO_DTYPE_C64: "<c8",
}
_TORCH_DTYPE = {
    C.LWO_DTYPE_F32: "float32", C.LWO_DTYPE_BF16: "bfloat16", C.LWO_DTYPE_F16: "float16",
    C.LWO_DTYPE_F8_E4M3: "float8_e4m3fn", C.LWO_DTYPE_F8_E5M2: "float8_e5m2",
    C.LWO_DTYPE_I8: "int8", C.LWO_DTYPE_U8: "uint8", C.LWO_DTYPE_BOOL: "bool",
    C.LWO_DTYPE_I16: "int16", C.LWO_DTYPE_U16: "uint16", C.LWO_DTYPE_I32: "int32",
    C.LWO_DTYPE_U32: "uint32", C.LWO_DTYPE_I64: "int64", C.LWO_DTYPE_U64: "uint64",
    C.LWO_DTYPE_F64: "float64", C.LWO_DTYPE_F8_E8M0: "float8_e8m0fnu",
    C.LWO_DTYPE_C64: "complex64",
}
_RAW_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


def dtype(value):
    """An lwo_dtype_t from an int, an lwo name ("bf16"), a C name
    ("LWO_DTYPE_BF16"), a safetensors name ("BF16"), or a torch/numpy dtype
    or its name ("bfloat16", torch.bfloat16, numpy.float32)."""
    if isinstance(value, bool):
        raise TypeError("lwo.dtype: %r is not a dtype" % (value,))
    if isinstance(value, int):
        return int(value)
    name = str(value)
    for prefix in ("torch.", "LWO_DTYPE_", "<class 'numpy.", "numpy."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    name = name.rstrip("'>")
    key = name.lower()
    if key in _DTYPE_BY_NAME:
        return _DTYPE_BY_NAME[key]
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    raise ValueError("lwo.dtype: unknown dtype %r (lwo names: %s)"
                     % (value, ", ".join(sorted(_DTYPE_BY_NAME))))


_to_dtype = dtype  # for functions whose dtype= parameter hides it


def dtype_name(value):
    """lwo_dtype_name: "bf16", or "unknown"."""
    return _lib.lwo_dtype_name(dtype(value)).decode()


def dtype_size(value):
    """lwo_dtype_size: bytes of one element, or 0 for an unknown dtype."""
    return _lib.lwo_dtype_size(dtype(value))


def version():
    """(major, minor, patch) of the loaded liblwo."""
    v = _lib.lwo_version()
    return (v // 10000, v // 100 % 100, v % 100)


# --------------------------------------------------------------------------
# Pointers and streams
# --------------------------------------------------------------------------
_NOT_RAW = object()


def _raw_address(obj, what):
    """The address that None, an int (0 is None) or a ctypes.c_void_p stands
    for; _NOT_RAW for any other object. A bool is refused (TypeError)."""
    if obj is None:
        return None
    if isinstance(obj, bool):
        raise TypeError("lwo: a %s cannot be a bool" % what)
    if isinstance(obj, int):
        return obj or None
    if isinstance(obj, ctypes.c_void_p):
        return obj.value
    return _NOT_RAW


def stream_handle(stream):
    """The cudaStream_t (an int, or None for the legacy default stream) of a
    torch.cuda.Stream (.cuda_stream), an object with __cuda_stream__ (returns
    (version, handle)), a raw integer, a ctypes.c_void_p, or None."""
    raw = _raw_address(stream, "stream")
    if raw is not _NOT_RAW:
        return raw
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        got = proto() if callable(proto) else proto
        try:
            _version, handle = got
        except (TypeError, ValueError):
            raise TypeError("lwo: %r.__cuda_stream__() returned %r, not (version, handle)"
                            % (stream, got))
        return int(handle) or None
    handle = getattr(stream, "cuda_stream", None)
    if handle is not None:
        return int(handle) or None
    raise TypeError("lwo: %r is not a stream (give a torch.cuda.Stream, an object with "
                    "__cuda_stream__, an integer cudaStream_t, or None)" % (stream,))


def device_pointer(obj):
    """A device address from an int, an object with __cuda_array_interface__,
    a torch tensor (data_ptr()), a TensorView, or None."""
    raw = _raw_address(obj, "device pointer")
    if raw is not _NOT_RAW:
        return raw
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0]) or None
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr):
        return int(data_ptr()) or None
    raise TypeError("lwo: %r is not device memory (give an integer address, an object "
                    "with __cuda_array_interface__ or a torch tensor)" % (obj,))


def _host_buffer(data, nbytes=None):
    """(address, bytes, keep-alive) of host memory: an int address (with
    nbytes), a ctypes object, an object with __array_interface__, or any
    C-contiguous buffer (bytes, bytearray, memoryview, numpy array)."""
    if isinstance(data, int) and not isinstance(data, bool):
        if nbytes is None:
            raise TypeError("lwo: an integer host address needs its byte count")
        return data, int(nbytes), None
    if isinstance(data, ctypes.c_void_p):
        if nbytes is None:
            raise TypeError("lwo: a c_void_p host address needs its byte count")
        return data.value or 0, int(nbytes), None
    if isinstance(data, ctypes._SimpleCData) or isinstance(data, (ctypes.Array, ctypes.Structure)):
        n = ctypes.sizeof(data) if nbytes is None else int(nbytes)
        return ctypes.addressof(data), n, data
    if isinstance(data, bytes):
        n = len(data) if nbytes is None else int(nbytes)
        return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0, n, data
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("lwo: host buffer is not C-contiguous")
    mv = mv.cast("B")
    n = mv.nbytes if nbytes is None else int(nbytes)
    if mv.readonly:
        ai = getattr(data, "__array_interface__", None)
        if ai is not None:
            return int(ai["data"][0]), n, data
        copy = bytes(mv)
        return ctypes.cast(ctypes.c_char_p(copy), ctypes.c_void_p).value or 0, n, copy
    if mv.nbytes == 0:
        return 0, 0, None
    arr = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return ctypes.addressof(arr), n, (arr, mv, data)


class HostMemory(collections.namedtuple("HostMemory", "address bytes")):
    """Host bytes owned by lwo (a pool's record or tensor)."""
    __slots__ = ()

    def memoryview(self):
        """A memoryview of the bytes (writable; do not write a checkpoint
        pool's, which are a read-only mapping)."""
        if not self.bytes:
            return memoryview(b"")
        return memoryview((ctypes.c_char * self.bytes).from_address(self.address)).cast("B")


class ShardMemory(collections.namedtuple("ShardMemory", "address record_offset bytes")):
    """This rank's shard of a record (lwo_pool_shard_host)."""
    __slots__ = ()

    def memoryview(self):
        return HostMemory(self.address, self.bytes).memoryview()


class TensorShard(collections.namedtuple("TensorShard", "address first_element n_elements")):
    """Elements [first_element, first_element + n_elements) of a tensor in host
    memory (lwo_pool_shard_tensor, lwo_grads_shard: f32)."""
    __slots__ = ()

    def memoryview(self, format="f", itemsize=4):
        if not self.n_elements:
            return memoryview(b"").cast(format)
        raw = (ctypes.c_char * (self.n_elements * itemsize)).from_address(self.address)
        return memoryview(raw).cast("B").cast(format)


# --------------------------------------------------------------------------
# Descriptors
# --------------------------------------------------------------------------
# quant (since 0.4.0): None, or the format the tensor is stored in (see
# quant_format): the tensor gets an lwo_tensor_quant_ext, dtype is then its
# logical dtype (f32, bf16 or f16) and shape its 2-D [rows, cols].
TensorSpec = collections.namedtuple("TensorSpec", "name dtype shape host_data quant",
                                    defaults=(None, None))


def _tensor_spec(t):
    if isinstance(t, TensorSpec):
        return t
    if isinstance(t, dict):
        return TensorSpec(t["name"], t["dtype"], tuple(t.get("shape", ())),
                          t.get("host_data", t.get("data")), t.get("quant"))
    t = tuple(t)
    if len(t) == 3:
        return TensorSpec(t[0], t[1], tuple(t[2]), None)
    if len(t) == 4:
        return TensorSpec(t[0], t[1], tuple(t[2]), t[3])
    raise ValueError("lwo: a tensor is (name, dtype, shape[, host_data]), a dict with "
                     "name, dtype, shape[, host_data][, quant] or a TensorSpec; got %r" % (t,))


def _layer_tensors(layer):
    if isinstance(layer, dict):
        layer = layer["tensors"]
    return [_tensor_spec(t) for t in layer]


def _tensor_descs(specs, keep, registered):
    arr = (C.lwo_tensor_desc * max(len(specs), 1))()
    for i, s in enumerate(specs):
        shape = [int(d) for d in s.shape]
        if len(shape) > C.LWO_MAX_DIMS:
            raise ValueError("lwo: tensor %r has %d dimensions, more than LWO_MAX_DIMS (%d)"
                             % (s.name, len(shape), C.LWO_MAX_DIMS))
        name = _enc(s.name)
        keep.append(name)
        d = arr[i]
        d.name = name
        d.dtype = dtype(s.dtype)
        d.n_dims = len(shape)
        for j, n in enumerate(shape):
            d.shape[j] = n
        if s.host_data is not None:
            if not registered:
                raise ValueError("lwo: tensor %r has host_data, which only registered pools "
                                 "take" % (s.name,))
            addr, _n, k = _host_buffer(s.host_data, 0)
            keep.append(k)
            d.host_data = addr
        fmt = quant_format(s.quant)
        if fmt != C.LWO_QUANT_NONE:
            ext = C.lwo_tensor_quant_ext()
            ext.header.type = C.LWO_EXT_TENSOR_QUANT
            ext.format = fmt
            keep.append(ext)
            d.next = ctypes.addressof(ext)
    keep.append(arr)
    return arr


def _layer_descs(layers, registered=False):
    """(lwo_layer_desc array, n_layers, keep-alive) of Python layer specs: each
    layer a list of tensors, each (name, dtype, shape[, host_data]) or a dict."""
    layers = list(layers)
    keep = []
    arr = (C.lwo_layer_desc * max(len(layers), 1))()
    for i, layer in enumerate(layers):
        specs = _layer_tensors(layer)
        arr[i].tensors = _tensor_descs(specs, keep, registered)
        arr[i].n_tensors = len(specs)
    keep.append(arr)
    return arr, len(layers), keep


def record_layout(layer):
    """lwo_record_layout of one layer (a list of (name, dtype, shape) tuples,
    dicts or TensorSpecs; quantized ones take their quantized bytes): returns
    (offsets, record_bytes)."""
    arr, _n, keep = _layer_descs([layer], registered=True)
    n = arr[0].n_tensors
    offsets = (ctypes.c_uint64 * max(n, 1))()
    record = ctypes.c_uint64()
    check(_lib.lwo_record_layout(arr, offsets, _byref(record)))
    del keep
    return [offsets[i] for i in range(n)], record.value


def _pool_config(n_threads):
    cfg = C.lwo_pool_config()
    _lib.lwo_pool_config_init(cfg)
    cfg.n_threads = int(n_threads)
    return cfg


def linear_desc(in_features, out_features, dtype="bf16", bias=False, tf32=False, flags=0,
                weight_format=None):
    """An lwo_linear_desc (lwo_linear_desc_init's defaults, then these);
    weight_format (since 0.4.0): None for a dense weight, else its quantized
    format (see quant_format): the weight is then a quantized tensor
    [out_features, in_features], frozen."""
    d = C.lwo_linear_desc()
    _lib.lwo_linear_desc_init(d)
    d.dtype = _to_dtype(dtype)
    d.flags = int(flags) | (C.LWO_LINEAR_BIAS if bias else 0) | (C.LWO_LINEAR_TF32 if tf32 else 0)
    d.in_features = int(in_features)
    d.out_features = int(out_features)
    d.weight_format = quant_format(weight_format)
    return d


def conv2d_desc(in_channels, out_channels, kernel, dtype="bf16", stride=1, padding=0,
                dilation=1, groups=1, bias=False, tf32=False, layout="nhwc", flags=0,
                weight_format=None):
    """An lwo_conv2d_desc (lwo_conv2d_desc_init's defaults, then these);
    kernel, stride, padding and dilation are an int or an (h, w) pair.
    weight_format (since 0.5.0): None for a dense weight, else its quantized
    format (see quant_format): the weight is then a quantized
    [out_channels, in_channels / groups * kh * kw] tensor, frozen."""
    def pair(v):
        return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))
    d = C.lwo_conv2d_desc()
    _lib.lwo_conv2d_desc_init(d)
    d.dtype = _to_dtype(dtype)
    d.flags = int(flags) | (C.LWO_CONV_BIAS if bias else 0) | (C.LWO_CONV_TF32 if tf32 else 0)
    if isinstance(layout, str):
        layout = {"nchw": C.LWO_LAYOUT_NCHW, "nhwc": C.LWO_LAYOUT_NHWC}[layout.lower()]
    d.layout = int(layout)
    d.in_channels, d.out_channels = int(in_channels), int(out_channels)
    d.kernel_h, d.kernel_w = pair(kernel)
    d.stride_h, d.stride_w = pair(stride)
    d.pad_h, d.pad_w = pair(padding)
    d.dilation_h, d.dilation_w = pair(dilation)
    d.groups = int(groups)
    d.weight_format = quant_format(weight_format)
    return d


def conv2d_output_size(desc, h, w):
    """lwo_conv2d_output_size: (out_h, out_w). Needs no engine."""
    oh, ow = ctypes.c_int32(), ctypes.c_int32()
    check(_lib.lwo_conv2d_output_size(desc, int(h), int(w), _byref(oh), _byref(ow)))
    return oh.value, ow.value


def nccl_get_unique_id():
    """lwo_nccl_get_unique_id: an lwo_nccl_unique_id (bytes(id) gives its
    128 bytes; lwo_nccl_unique_id.from_buffer_copy(b) makes one back)."""
    uid = C.lwo_nccl_unique_id()
    check(_lib.lwo_nccl_get_unique_id(_byref(uid)))
    return uid


# --------------------------------------------------------------------------
# Quantized weights (the formats of lwo_quant_format_t; since 0.4.0 here)
# --------------------------------------------------------------------------
_QUANT_FORMATS = (C.LWO_QUANT_FP8_E4M3_CHANNEL, C.LWO_QUANT_FP8_E4M3_BLOCK128,
                  C.LWO_QUANT_INT8_CHANNEL, C.LWO_QUANT_INT4_GROUP128)
# The spellings of the lwo program's --quant flag (tools/cli.cc, docs/CLI.md).
_QUANT_SPELLINGS = {"fp8": C.LWO_QUANT_FP8_E4M3_CHANNEL, "fp8-block": C.LWO_QUANT_FP8_E4M3_BLOCK128,
                    "int8": C.LWO_QUANT_INT8_CHANNEL, "int4": C.LWO_QUANT_INT4_GROUP128}
QUANT_FORMATS = tuple(_QUANT_SPELLINGS)  # ("fp8", "fp8-block", "int8", "int4")
_QUANT_BY_NAME = {"none": C.LWO_QUANT_NONE}
for _v in _QUANT_FORMATS:  # lwo_quant_format_name's names: "fp8_e4m3_channel", ...
    _QUANT_BY_NAME[_lib.lwo_quant_format_name(_v).decode()] = _v


def quant_format(value):
    """An lwo_quant_format_t from None or "none" (LWO_QUANT_NONE), the lwo
    program's --quant spellings ("fp8": e4m3 with a scale per output channel,
    "fp8-block": e4m3 with a scale per 128 x 128 block, "int8": a scale per
    output channel, "int4": a scale per 128 elements of a row), the names of
    lwo_quant_format_name ("fp8_e4m3_channel"), the C names
    ("LWO_QUANT_INT8_CHANNEL") or an int (passed on as it is: the C calls
    check it)."""
    if value is None:
        return C.LWO_QUANT_NONE
    if isinstance(value, bool):
        raise TypeError("lwo.quant_format: %r is not a format" % (value,))
    if isinstance(value, int):
        return int(value)
    key = str(value)
    if key.startswith("LWO_QUANT_"):
        key = key[len("LWO_QUANT_"):]
    key = key.lower()
    if key.replace("_", "-") in _QUANT_SPELLINGS:
        return _QUANT_SPELLINGS[key.replace("_", "-")]
    if key in _QUANT_BY_NAME:
        return _QUANT_BY_NAME[key]
    raise ValueError("lwo.quant_format: unknown quantized format %r (give one of %s, None, "
                     "an lwo name such as 'fp8_e4m3_channel' or an LWO_QUANT_* value)"
                     % (value, ", ".join(repr(k) for k in QUANT_FORMATS)))


def quant_format_name(value):
    """lwo_quant_format_name: "fp8_e4m3_channel", "none", or "unknown"."""
    return _lib.lwo_quant_format_name(quant_format(value)).decode()


def quant_spelling(value):
    """The --quant spelling of a format ("fp8-block"), "none" for
    LWO_QUANT_NONE, None for a value that is no format."""
    fmt = quant_format(value)
    if fmt == C.LWO_QUANT_NONE:
        return "none"
    for k, v in _QUANT_SPELLINGS.items():
        if v == fmt:
            return k
    return None


def _quant_desc(fmt, dtype_, rows, cols):
    d = C.lwo_quant_desc()
    _lib.lwo_quant_desc_init(d)
    d.format = quant_format(fmt)
    d.dtype = dtype(dtype_)
    d.rows, d.cols = int(rows), int(cols)
    return d


def _rows_cols(shape, what):
    shape = tuple(int(n) for n in shape)
    if len(shape) != 2:
        raise ValueError("lwo.%s: shape %r is not 2-D: a quantized tensor is [rows, cols] "
                         "(rows the output channels)" % (what, shape))
    return shape


class QuantLayout(collections.namedtuple(
        "QuantLayout", "format dtype rows cols data_offset data_bytes scale_offset scale_bytes "
        "scale_rows scale_cols total_bytes")):
    """lwo_quant_layout of one quantized tensor (byte offsets from its start:
    the codes at 0, the f32 scales [scale_rows x scale_cols] at
    scale_offset; total_bytes a multiple of LWO_RECORD_ALIGN)."""
    __slots__ = ()

    @property
    def dense_bytes(self):
        """Bytes of the tensor it stands for, dense in its dtype."""
        return self.rows * self.cols * dtype_size(self.dtype)

    @property
    def saved_bytes(self):
        """dense_bytes - total_bytes (negative for tensors too small to gain)."""
        return self.dense_bytes - self.total_bytes


def quant_layout(format, shape, dtype="bf16"):
    """lwo_quant_layout: the QuantLayout of a quantized tensor of `format`,
    2-D `shape` (rows, cols) and logical `dtype` (f32, bf16 or f16). Needs no
    engine."""
    rows, cols = _rows_cols(shape, "quant_layout")
    d = _quant_desc(format, dtype, rows, cols)
    info = C.lwo_quant_layout_info()
    info.size = ctypes.sizeof(info)
    check(_lib.lwo_quant_layout(_byref(d), _byref(info)))
    return QuantLayout(d.format, d.dtype, rows, cols, info.data_offset, info.data_bytes,
                       info.scale_offset, info.scale_bytes, info.scale_rows, info.scale_cols,
                       info.total_bytes)


def _host_array(data, nbytes=None):
    """(address, bytes, keep-alive, lwo dtype or None, shape or None) of host
    data: a CPU torch tensor (contiguous; any dtype torch has), a numpy array
    or any buffer _host_buffer takes. The dtype is the array's (uint16 and
    int16: bf16, as lwo hands bf16 to numpy); None for untyped bytes."""
    if hasattr(data, "data_ptr") and hasattr(data, "element_size") and hasattr(data, "device"):
        if str(data.device) != "cpu":
            raise ValueError("lwo: %s tensor: host data must be a CPU tensor" % (data.device,))
        if not data.is_contiguous():
            raise ValueError("lwo: the tensor is not contiguous")
        n = data.numel() * data.element_size() if nbytes is None else int(nbytes)
        dt = str(data.dtype)
        lwo_dt = C.LWO_DTYPE_BF16 if dt in ("torch.int16", "torch.uint16") else dtype(dt)
        return data.data_ptr(), n, data, lwo_dt, tuple(data.shape)
    addr, n, keep = _host_buffer(data, nbytes)
    npdt = getattr(data, "dtype", None)
    lwo_dt = None
    if npdt is not None and getattr(npdt, "kind", None) is not None:
        name = str(npdt)
        if name in ("uint16", "int16"):
            lwo_dt = C.LWO_DTYPE_BF16
        else:
            try:
                lwo_dt = dtype(name)
            except ValueError:
                lwo_dt = None
    shape = getattr(data, "shape", None)
    return addr, n, keep, lwo_dt, (tuple(shape) if shape is not None else None)


# numpy dtypes of the dense results (bf16 as its bits, uint16: numpy has no bf16)
_NP_DENSE = {C.LWO_DTYPE_F32: "float32", C.LWO_DTYPE_F16: "float16",
             C.LWO_DTYPE_BF16: "uint16"}


class QuantizedTensor:
    """A quantized tensor in host memory, as lwo_quantize writes it and
    lwo_pool_write takes it: `data` (numpy uint8 [layout.total_bytes]), its
    `format`, logical `dtype` and `shape` (rows, cols), and `layout`."""

    __slots__ = ("data", "format", "dtype", "shape", "layout")

    def __init__(self, data, format, shape, dtype="bf16"):
        import numpy as np

        rows, cols = _rows_cols(shape, "QuantizedTensor")
        self.layout = quant_layout(format, (rows, cols), dtype)
        self.format, self.dtype, self.shape = self.layout.format, self.layout.dtype, (rows, cols)
        arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else \
            data.reshape(-1).view(np.uint8)
        if arr.nbytes < self.layout.total_bytes:
            raise ValueError("lwo.QuantizedTensor: %d bytes, less than the %d of a %s tensor "
                             "[%d, %d]" % (arr.nbytes, self.layout.total_bytes,
                                           quant_format_name(self.format), rows, cols))
        self.data = arr[:self.layout.total_bytes]

    @property
    def nbytes(self):
        return self.layout.total_bytes

    @property
    def dense_bytes(self):
        return self.layout.dense_bytes

    @property
    def saved_bytes(self):
        return self.layout.saved_bytes

    @property
    def codes(self):
        """The codes (a view): fp8 e4m3 bits as uint8 [rows, cols], int8
        [rows, cols], int4 packed as uint8 [rows, cols / 2] (element 2k in
        the low nibble, each code + 8)."""
        import numpy as np

        rows, cols = self.shape
        raw = self.data[self.layout.data_offset:self.layout.data_offset + self.layout.data_bytes]
        if self.format == C.LWO_QUANT_INT8_CHANNEL:
            return raw.view(np.int8).reshape(rows, cols)
        if self.format == C.LWO_QUANT_INT4_GROUP128:
            return raw.reshape(rows, cols // 2)
        return raw.reshape(rows, cols)

    @property
    def scales(self):
        """The f32 scales (a view) [scale_rows, scale_cols]."""
        import numpy as np

        lo = self.layout
        raw = self.data[lo.scale_offset:lo.scale_offset + lo.scale_bytes]
        return raw.view(np.float32).reshape(lo.scale_rows, lo.scale_cols)

    def dequantize(self, dtype=None, n_threads=0):
        """lwo_dequantize_host into a new numpy array (see lwo.dequantize)."""
        return dequantize(self, dtype=dtype, n_threads=n_threads)

    def __repr__(self):
        return "<lwo.QuantizedTensor %s %s[%d, %d], %d bytes (dense %d)>" % (
            quant_spelling(self.format), dtype_name(self.dtype), self.shape[0], self.shape[1],
            self.nbytes, self.dense_bytes)


def quantize(array, format, dtype=None, shape=None, n_threads=0):
    """lwo_quantize on the host: a QuantizedTensor of `array` (a 2-D numpy
    array [rows, cols] of float32, float16 or bf16, a CPU torch tensor, or
    any buffer with dtype= and shape=) in `format` ("fp8", "fp8-block",
    "int8", "int4" or see quant_format). bf16 comes as uint16 (its bits) or
    as a bfloat16 dtype; dtype= overrides what the array says. n_threads:
    host threads, 0 one per core. A bad format, dtype or shape, or a NaN or
    infinity in the data, raises ArgumentError (a ValueError)."""
    import numpy as np

    if isinstance(array, np.ndarray) and not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    addr, n, keep, arr_dt, arr_shape = _host_array(array)
    src_dt = _to_dtype(dtype) if dtype is not None else arr_dt
    if src_dt is None:
        raise TypeError("lwo.quantize: %r has no dtype: give dtype= (f32, bf16 or f16)"
                        % (type(array).__name__,))
    if shape is None:
        if arr_shape is None:
            raise TypeError("lwo.quantize: %r has no shape: give shape=(rows, cols)"
                            % (type(array).__name__,))
        shape = arr_shape
    rows, cols = _rows_cols(shape, "quantize")
    d = _quant_desc(format, src_dt, rows, cols)
    layout = quant_layout(d.format, (rows, cols), src_dt)
    out = np.zeros(layout.total_bytes, dtype=np.uint8)
    check(_lib.lwo_quantize(_byref(d), addr, n, out.ctypes.data, out.nbytes, int(n_threads)))
    del keep
    return QuantizedTensor(out, d.format, (rows, cols), src_dt)


def dequantize(q, format=None, shape=None, dtype=None, n_threads=0):
    """lwo_dequantize_host: a new numpy array [rows, cols] of the dense
    tensor (float32, float16, or uint16 holding bf16 bits). q is a
    QuantizedTensor (format, shape and dtype default to its own) or the bytes
    of one (a buffer, with format= and shape=; dtype default bf16)."""
    import numpy as np

    if isinstance(q, QuantizedTensor):
        format = q.format if format is None else format
        shape = q.shape if shape is None else shape
        dtype = q.dtype if dtype is None else dtype
        src = q.data
    else:
        if format is None or shape is None:
            raise TypeError("lwo.dequantize: raw bytes need format= and shape=")
        src = q
    dtype = "bf16" if dtype is None else dtype
    rows, cols = _rows_cols(shape, "dequantize")
    d = _quant_desc(format, dtype, rows, cols)
    np_dt = _NP_DENSE.get(d.dtype)
    if np_dt is None:  # let the C call name the dtype it refuses
        np_dt = "uint8"
    out = np.empty((rows, cols), dtype=np_dt)
    addr, n, keep = _host_buffer(src)
    check(_lib.lwo_dequantize_host(_byref(d), addr, n, out.ctypes.data, out.nbytes,
                                   int(n_threads)))
    del keep
    return out


# --------------------------------------------------------------------------
# Handles
# --------------------------------------------------------------------------
class _Handle:
    """A C handle owned by a Python object: close() destroys it (idempotent);
    a context manager; __del__ destroys it as a last resort, never raising."""

    _destroy = None  # name of the C destroy function
    _handle = None

    def _h(self):
        if self._handle is None:
            raise ValueError("lwo: %s is closed" % type(self).__name__)
        return self._handle

    @property
    def handle(self):
        """The C handle as an int (None once closed)."""
        return self._handle

    @property
    def closed(self):
        return self._handle is None

    def close(self):
        """Destroys the C object (a failure, such as LWO_ERR_BUSY, raises and
        leaves it open); closing a closed object does nothing."""
        if self._handle is None:
            return
        check(getattr(_lib, self._destroy)(self._handle))
        self._handle = None
        self._closed_hook()

    def _closed_hook(self):
        pass

    def __enter__(self):
        self._h()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            if self._handle is not None:
                self._last_resort()
                getattr(_lib, self._destroy)(self._handle)
                self._handle = None
        except Exception:
            pass

    def _last_resort(self):
        pass

    def __repr__(self):
        state = "closed" if self._handle is None else "0x%x" % self._handle
        return "<lwo.%s %s>" % (type(self).__name__, state)


def _new_handle(fn, *args):
    out = ctypes.c_void_p()
    check(fn(*(args + (_byref(out),))))
    return out.value


class Engine(_Handle):
    """lwo_engine: one CUDA device, with its transfer and gradient streams."""

    _destroy = "lwo_engine_destroy"

    def __init__(self, device=0, check_collectives=False, flags=0, budget_bytes=0,
                 budget_share=0.0, budget_headroom=0, checking=False, host_limit_bytes=0):
        cfg = C.lwo_engine_config()
        _lib.lwo_engine_config_init(cfg)
        cfg.device = _fit(device, 32, True, "device")
        cfg.flags = _fit(flags, 32, False, "flags") | (C.LWO_ENGINE_CHECK_COLLECTIVES if check_collectives else 0)
        # checking: LWO_ENGINE_CHECKING, released slots and unlanded gradients hold NaN
        cfg.flags |= C.LWO_ENGINE_CHECKING if checking else 0
        cfg.budget_bytes = int(budget_bytes)  # since 0.4.0: the device memory budget
        cfg.budget_share = float(budget_share)
        cfg.budget_headroom = int(budget_headroom)
        # since 0.6.0: the host memory limit (0: derived; LWO_HOST_LIMIT_NONE: none)
        cfg.host_limit_bytes = _fit(host_limit_bytes, 64, False, "host_limit_bytes")
        self._handle = _new_handle(_lib.lwo_engine_create, _byref(cfg))

    # since 0.4.0: the device memory budget
    def set_budget(self, budget_bytes=0, budget_share=0.0, budget_headroom=0):
        check(_lib.lwo_engine_set_budget(self._h(), int(budget_bytes), float(budget_share),
                                         int(budget_headroom)))

    # since 0.6.0: the host memory limit
    def set_host_limit(self, host_limit_bytes=0):
        """lwo_engine_set_host_limit (0: derive it again; LWO_HOST_LIMIT_NONE: none)."""
        check(_lib.lwo_engine_set_host_limit(self._h(), _fit(host_limit_bytes, 64, False,
                                                               "host_limit_bytes")))

    def host_usage(self):
        """lwo_engine_host_usage as (limit_bytes, charged_bytes); limit 0: none."""
        limit, charged = ctypes.c_uint64(), ctypes.c_uint64()
        check(_lib.lwo_engine_host_usage(self._h(), _byref(limit), _byref(charged)))
        return limit.value, charged.value

    def memory(self):
        """lwo_engine_get_memory as a dict (budget, used, left, by use, device free/total)."""
        m = C.lwo_engine_memory()
        check(_lib.lwo_engine_get_memory(self._h(), _byref(m)))
        return {f[0]: getattr(m, f[0]) for f in m._fields_ if f[0] != "size"}

    @property
    def device(self):
        d = ctypes.c_int32()
        check(_lib.lwo_engine_device(self._h(), _byref(d)))
        return d.value

    @property
    def transfer_stream(self):
        s = ctypes.c_void_p()
        check(_lib.lwo_engine_transfer_stream(self._h(), _byref(s)))
        return s.value

    def check(self):
        check(_lib.lwo_engine_check(self._h()))

    def synchronize(self):
        check(_lib.lwo_engine_synchronize(self._h()))

    # pools
    def pool_pinned(self, layers, n_threads=0):
        return Pool.create_pinned(self, layers, n_threads=n_threads)

    def pool_registered(self, layers, regions, n_threads=0):
        return Pool.create_registered(self, layers, regions, n_threads=n_threads)

    def pool_from_checkpoint(self, checkpoint, **mapping):
        return Pool.from_checkpoint(self, checkpoint, **mapping)

    # compute
    def linear_forward(self, desc, tokens, x, weight, bias, y, stream=None):
        check(_lib.lwo_linear_forward(self._h(), _byref(desc), int(tokens), device_pointer(x),
                                      device_pointer(weight), device_pointer(bias),
                                      device_pointer(y), stream_handle(stream)))

    def linear_backward(self, desc, tokens, x, dy, weight, dx=None, dweight=None, dbias=None,
                        grad_dtype="f32", stream=None):
        check(_lib.lwo_linear_backward(
            self._h(), _byref(desc), int(tokens), device_pointer(x), device_pointer(dy),
            device_pointer(weight), device_pointer(dx), device_pointer(dweight),
            device_pointer(dbias), dtype(grad_dtype), stream_handle(stream)))

    def dequantize(self, format, shape, src, dst, dtype="bf16", stream=None):
        """lwo_dequantize (since 0.4.0 here): the quantized tensor of `format`
        and 2-D `shape` at device address src into the dense [rows, cols]
        buffer dst of `dtype` (f32, bf16 or f16), stream-ordered on stream."""
        rows, cols = _rows_cols(shape, "Engine.dequantize")
        d = _quant_desc(format, dtype, rows, cols)
        check(_lib.lwo_dequantize(self._h(), _byref(d), device_pointer(src),
                                  device_pointer(dst), stream_handle(stream)))

    def conv2d_forward(self, desc, n, h, w, x, weight, bias, y, stream=None):
        check(_lib.lwo_conv2d_forward(
            self._h(), _byref(desc), int(n), int(h), int(w), device_pointer(x),
            device_pointer(weight), device_pointer(bias), device_pointer(y),
            stream_handle(stream)))

    def conv2d_backward(self, desc, n, h, w, x, dy, weight, dx=None, dweight=None, dbias=None,
                        grad_dtype="f32", stream=None):
        check(_lib.lwo_conv2d_backward(
            self._h(), _byref(desc), int(n), int(h), int(w), device_pointer(x),
            device_pointer(dy), device_pointer(weight), device_pointer(dx),
            device_pointer(dweight), device_pointer(dbias), dtype(grad_dtype),
            stream_handle(stream)))

    # nccl
    def nccl_comm_create(self, unique_id, n_ranks, rank):
        return NcclComm(self, unique_id, n_ranks, rank)

    def nccl_comm_split(self, parent, color=0, key=0):
        """lwo_nccl_comm_split (since 0.6.0): a private communicator split
        from `parent` (an NcclComm, or the integer address of a ncclComm_t
        the caller owns, which lwo never destroys); a collective of the
        parent's ranks."""
        return NcclComm.split(self, parent, color, key)


class NcclComm(_Handle):
    """An ncclComm_t made by lwo_nccl_comm_create or lwo_nccl_comm_split;
    close() destroys it (after every pool and ring that uses it)."""

    _destroy = "lwo_nccl_comm_destroy"

    def __init__(self, engine, unique_id, n_ranks, rank):
        if isinstance(unique_id, (bytes, bytearray)):
            unique_id = C.lwo_nccl_unique_id.from_buffer_copy(bytes(unique_id))
        self.engine = engine
        comm = ctypes.c_void_p()
        check(_lib.lwo_nccl_comm_create(engine._h(), _byref(unique_id), int(n_ranks),
                                        int(rank), _byref(comm)))
        self._handle = comm.value

    @classmethod
    def split(cls, engine, parent, color=0, key=0):
        parent_ptr = parent._h() if isinstance(parent, NcclComm) else parent
        comm = ctypes.c_void_p()
        check(_lib.lwo_nccl_comm_split(engine._h(), parent_ptr, int(color), int(key),
                                       _byref(comm)))
        self = cls.__new__(cls)
        self.engine = engine
        self._handle = comm.value
        return self


PoolInfo = collections.namedtuple(
    "PoolInfo", "n_layers kind total_bytes max_record_bytes rank n_ranks")
class TensorInfo(collections.namedtuple("TensorInfo",
                                         "name dtype shape offset bytes quant_format",
                                         defaults=(0,))):
    """Where one tensor sits in its layer's record (lwo_pool_tensor_info).
    quant_format (since 0.4.0): an LWO_QUANT_* value, 0 for a dense tensor;
    a quantized tensor's dtype is its logical dtype and `bytes` its quantized
    bytes (codes and scales)."""
    __slots__ = ()

    @property
    def quant(self):
        """The format's --quant spelling ("fp8", ...), None for a dense tensor."""
        return None if not self.quant_format else quant_spelling(self.quant_format)

    @property
    def dense_bytes(self):
        """Bytes of the tensor dense in its dtype (its shape's elements)."""
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * dtype_size(self.dtype)

    @property
    def saved_bytes(self):
        """dense_bytes - bytes for a quantized tensor (what the bus does not
        move), 0 for a dense one."""
        return self.dense_bytes - self.bytes if self.quant_format else 0


def _checkpoint_config(pattern=None, patterns=None, names=None, allow_gaps=False,
                       staged=False, flags=0):
    given = sum(x is not None for x in (pattern, patterns, names))
    if given != 1:
        raise TypeError("lwo: give exactly one of pattern=, patterns= or names=")
    cfg = C.lwo_checkpoint_pool_config()
    _lib.lwo_checkpoint_pool_config_init(cfg)
    keep = []
    if pattern is not None:
        cfg.pattern = _enc(pattern)
        keep.append(cfg.pattern)
    elif patterns is not None:
        enc = [_enc(p) for p in patterns]
        arr = (ctypes.c_char_p * max(len(enc), 1))(*enc)
        keep += [enc, arr]
        cfg.patterns = arr
        cfg.n_patterns = len(enc)
    else:
        groups = [list(g) for g in names]
        flat = [_enc(n) for g in groups for n in g]
        arr = (ctypes.c_char_p * max(len(flat), 1))(*flat)
        counts = (ctypes.c_uint32 * max(len(groups), 1))(*[len(g) for g in groups])
        keep += [flat, arr, counts]
        cfg.names = arr
        cfg.n_names = counts
        cfg.n_layers = len(groups)
    cfg.flags = (int(flags) | (C.LWO_CHECKPOINT_ALLOW_GAPS if allow_gaps else 0)
                 | (C.LWO_CHECKPOINT_STAGED if staged else 0))
    return cfg, keep


class Pool(_Handle):
    """lwo_pool: the host bytes of every layer. Make one with create_pinned,
    create_registered, from_checkpoint or create_sharded; it keeps its engine
    (and the caller memory of a registered pool) alive."""

    _destroy = "lwo_pool_destroy"

    def __init__(self, *args, **kwargs):
        raise TypeError("lwo.Pool: use Pool.create_pinned, create_registered, "
                        "from_checkpoint or create_sharded")

    @classmethod
    def _make(cls, engine, handle, keep=None, source=None):
        self = object.__new__(cls)
        self.engine = engine
        self._keep = keep
        self._source = source
        self._handle = handle
        self._tensor_cache = {}
        return self

    @classmethod
    def create_pinned(cls, engine, layers, n_threads=0):
        """lwo_pool_create_pinned: layers is a list of layers, each a list of
        tensors (name, dtype, shape) or dicts {"name", "dtype", "shape"}."""
        arr, n, keep = _layer_descs(layers)
        cfg = _pool_config(n_threads)
        h = _new_handle(_lib.lwo_pool_create_pinned, engine._h(), arr, n, _byref(cfg))
        return cls._make(engine, h)

    @classmethod
    def create_registered(cls, engine, layers, regions, n_threads=0):
        """lwo_pool_create_registered: tensors are (name, dtype, shape,
        host_data), host_data an address or a buffer inside one of the
        regions; regions are buffers or (address-or-buffer, bytes) pairs. The
        pool keeps the buffers alive."""
        arr, n, keep = _layer_descs(layers, registered=True)
        regions = list(regions)
        rarr = (C.lwo_host_region * max(len(regions), 1))()
        for i, r in enumerate(regions):
            if isinstance(r, tuple) and len(r) == 2:
                addr, nbytes, k = _host_buffer(r[0], r[1])
            else:
                addr, nbytes, k = _host_buffer(r)
            keep.append(k)
            rarr[i].data = addr
            rarr[i].bytes = nbytes
        keep.append(rarr)
        cfg = _pool_config(n_threads)
        h = _new_handle(_lib.lwo_pool_create_registered, engine._h(), arr, n, rarr,
                        len(regions), _byref(cfg))
        return cls._make(engine, h, keep=keep)

    @classmethod
    def from_checkpoint(cls, engine, checkpoint, pattern=None, patterns=None, names=None,
                        allow_gaps=False, staged=False):
        """lwo_pool_create_from_checkpoint, mapping tensors to layers by one of
        pattern= ("blocks.{i}."), patterns= (a list of them) or names= (a list
        of lists of full tensor names)."""
        cfg, keep = _checkpoint_config(pattern, patterns, names, allow_gaps, staged)
        h = _new_handle(_lib.lwo_pool_create_from_checkpoint, engine._h(), checkpoint._h(),
                        _byref(cfg))
        return cls._make(engine, h, source=checkpoint)

    @classmethod
    def create_sharded(cls, engine, layers, comm, n_threads=0):
        """lwo_pool_create_sharded (collective: every rank calls it alike)."""
        arr, n, keep = _layer_descs(layers)
        cfg = _pool_config(n_threads)
        comm_h = comm._h() if isinstance(comm, NcclComm) else comm
        h = _new_handle(_lib.lwo_pool_create_sharded, engine._h(), arr, n, comm_h,
                        _byref(cfg))
        return cls._make(engine, h, source=comm)

    def info(self):
        i = C.lwo_pool_info()
        check(_lib.lwo_pool_get_info(self._h(), _byref(i)))
        return PoolInfo(i.n_layers, i.kind, i.total_bytes, i.max_record_bytes, i.rank,
                        i.n_ranks)

    @property
    def n_layers(self):
        return self.info().n_layers

    def __len__(self):
        return self.n_layers

    def tensor_count(self, layer):
        n = ctypes.c_uint32()
        check(_lib.lwo_pool_layer_tensor_count(self._h(), int(layer), _byref(n)))
        return n.value

    def tensor_info(self, layer, index):
        i = C.lwo_tensor_info()
        check(_lib.lwo_pool_tensor_info(self._h(), int(layer), int(index), _byref(i)))
        return TensorInfo(_dec(i.name), i.dtype, tuple(i.shape[:i.n_dims]), i.offset, i.bytes,
                          i.quant_format)

    def tensors(self, layer):
        """The TensorInfo of every tensor of a layer, in record order (cached:
        a pool's layout never changes)."""
        layer = int(layer)
        got = self._tensor_cache.get(layer)
        if got is None:
            got = [self.tensor_info(layer, i) for i in range(self.tensor_count(layer))]
            self._tensor_cache[layer] = got
        return got

    def find_tensor(self, layer, name):
        i = ctypes.c_uint32()
        check(_lib.lwo_pool_find_tensor(self._h(), int(layer), _enc(name), _byref(i)))
        return i.value

    def record_bytes(self, layer):
        n = ctypes.c_uint64()
        check(_lib.lwo_pool_record_bytes(self._h(), int(layer), _byref(n)))
        return n.value

    def write(self, layer, name, data, nbytes=None):
        """lwo_pool_write: data is a buffer (or an address with nbytes) of
        exactly the tensor's size."""
        addr, n, keep = _host_buffer(data, nbytes)
        check(_lib.lwo_pool_write(self._h(), int(layer), _enc(name), addr, n))
        del keep

    def write_quantized(self, layer, name, data, src_dtype=None, nbytes=None, n_threads=0):
        """lwo_pool_write_quantized (since 0.4.0): quantizes data (rows x cols
        elements of f32, bf16 or f16: a numpy array, a CPU torch tensor, any
        buffer, or an address with nbytes) into the quantized tensor `name`
        of `layer` (pinned pools). src_dtype: the data's dtype; by default the
        array's (float32, float16, bfloat16, or uint16 / int16 holding bf16
        bits), else, for untyped bytes (and uint8 / int8 arrays), the
        tensor's logical dtype. n_threads: 0 one per core."""
        addr, n, keep, arr_dt, _shape = _host_array(data, nbytes)
        if src_dtype is not None:
            src = dtype(src_dtype)
        elif arr_dt is not None and arr_dt not in (C.LWO_DTYPE_U8, C.LWO_DTYPE_I8):
            src = arr_dt  # f64 and the like: the call refuses it, naming it
        else:  # untyped bytes
            src = self.tensor_info(layer, self.find_tensor(layer, name)).dtype
        check(_lib.lwo_pool_write_quantized(self._h(), int(layer), _enc(name), addr, src, n,
                                            int(n_threads)))
        del keep

    def saved_bytes(self, layer=None):
        """Bytes the quantized tensors save against their dense dtype: of one
        layer, or (layer None) of the whole pool."""
        layers = range(self.n_layers) if layer is None else [int(layer)]
        return sum(t.saved_bytes for i in layers for t in self.tensors(i))

    def write_range(self, layer, name, offset, data, nbytes=None):
        addr, n, keep = _host_buffer(data, nbytes)
        check(_lib.lwo_pool_write_range(self._h(), int(layer), _enc(name), int(offset),
                                        addr, n))
        del keep

    def layer_host(self, layer):
        p, n = ctypes.c_void_p(), ctypes.c_uint64()
        check(_lib.lwo_pool_layer_host(self._h(), int(layer), _byref(p), _byref(n)))
        return HostMemory(p.value or 0, n.value)

    def layer_changed(self, layer):
        check(_lib.lwo_pool_layer_changed(self._h(), int(layer)))

    def tensor_host(self, layer, name):
        p, n = ctypes.c_void_p(), ctypes.c_uint64()
        check(_lib.lwo_pool_tensor_host(self._h(), int(layer), _enc(name), _byref(p),
                                        _byref(n)))
        return HostMemory(p.value or 0, n.value)

    def shard_host(self, layer):
        p, off, n = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_uint64()
        check(_lib.lwo_pool_shard_host(self._h(), int(layer), _byref(p), _byref(off),
                                       _byref(n)))
        return ShardMemory(p.value or 0, off.value, n.value)

    def shard_tensor(self, layer, name):
        p, first, n = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_uint64()
        check(_lib.lwo_pool_shard_tensor(self._h(), int(layer), _enc(name), _byref(p),
                                         _byref(first), _byref(n)))
        return TensorShard(p.value or 0, first.value, n.value)

    def ring(self, depth=2, timing=False, resident=()):
        return Ring(self, depth=depth, timing=timing, resident=resident)

    def grads(self, trainable=None, depth=2, native_wire=False, n_threads=0, replica_comm=None):
        return Grads(self, trainable=trainable, depth=depth, native_wire=native_wire,
                     n_threads=n_threads, replica_comm=replica_comm)

    def _closed_hook(self):
        self._keep = None
        self._tensor_cache = {}


# --------------------------------------------------------------------------
# Views
# --------------------------------------------------------------------------
class TensorView:
    """One tensor of a view in device memory, with __cuda_array_interface__
    (version 3; typestr from the dtype, 'V' of the element size where numpy
    has no such type: bf16, the f8 types). Valid as long as its ticket (or
    gradient layer) is."""

    __slots__ = ("name", "dtype", "shape", "bytes", "data", "device", "_owner")

    def __init__(self, name, dtype_, shape, nbytes, data, device, owner):
        self.name, self.dtype, self.shape = name, dtype_, tuple(shape)
        self.bytes, self.data, self.device, self._owner = nbytes, data, device, owner

    @property
    def typestr(self):
        return _TYPESTR.get(self.dtype, "|V%d" % max(dtype_size(self.dtype), 1))

    def _interface(self, typestr):
        return {"shape": self.shape, "typestr": typestr, "data": (self.data or 0, False),
                "strides": None, "version": 3}

    @property
    def __cuda_array_interface__(self):
        return self._interface(self.typestr)

    def torch(self):
        """A torch tensor on the view's device over the same memory (no
        copy). Imports torch on first use."""
        import torch  # lazily: the package needs no torch

        name = _TORCH_DTYPE.get(self.dtype)
        tdtype = getattr(torch, name, None) if name else None
        if tdtype is None:
            raise TypeError("lwo: torch %s has no dtype for lwo's %s"
                            % (torch.__version__, dtype_name(self.dtype)))
        size = dtype_size(self.dtype)

        class _Raw:  # the bytes as integers of the element size, then .view
            __cuda_array_interface__ = self._interface(_RAW_TYPESTR[size])

        t = torch.as_tensor(_Raw(), device="cuda:%d" % self.device)
        return t.view(tdtype)

    def __repr__(self):
        return "<lwo.TensorView %s %s%s at 0x%x>" % (self.name, dtype_name(self.dtype),
                                                    list(self.shape), self.data or 0)


class LayerView:
    """The device addresses of an acquired layer (lwo_ring_acquire,
    lwo_schedule_next) or a gradient slot (lwo_grads_begin); valid until its
    ticket is released (the gradient layer ended). Holds its ring (or grads)
    alive."""

    def __init__(self, owner, pool, view, device, ticket=None):
        self.owner = owner
        self.ticket = ticket
        self.layer = view.layer
        self.base = view.base or 0
        self.record_bytes = view.record_bytes
        infos = pool.tensors(view.layer)
        self.tensors = []
        for i in range(view.n_tensors):
            info = infos[i]
            self.tensors.append(TensorView(info.name, view.tensor_dtypes[i], info.shape,
                                           view.tensor_bytes[i], view.tensors[i] or 0,
                                           device, self))

    def __len__(self):
        return len(self.tensors)

    def __iter__(self):
        return iter(self.tensors)

    @property
    def names(self):
        return [t.name for t in self.tensors]

    def tensor(self, key):
        """A tensor by index or by name."""
        if isinstance(key, int):
            return self.tensors[key]
        for t in self.tensors:
            if t.name == key:
                return t
        raise KeyError("lwo: layer %d has no tensor %r" % (self.layer, key))

    __getitem__ = tensor

    def torch(self, key):
        return self.tensor(key).torch()

    def __repr__(self):
        return "<lwo.LayerView layer %d, %d tensors, %d bytes at 0x%x>" % (
            self.layer, len(self.tensors), self.record_bytes, self.base)


# --------------------------------------------------------------------------
# Rings and schedules
# --------------------------------------------------------------------------
class Ticket:
    """An lwo_ticket: one occupancy of one slot of one ring."""

    __slots__ = ("id", "layer")

    def __init__(self, id_, layer=None):
        self.id, self.layer = int(id_), layer

    def __int__(self):
        return self.id

    __index__ = __int__

    def __eq__(self, other):
        return isinstance(other, (Ticket, int)) and int(other) == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return "<lwo.Ticket %d%s>" % (self.id, "" if self.layer is None else
                                      " layer %d" % self.layer)


def _ticket(t):
    if isinstance(t, C.lwo_ticket):
        return t
    return C.lwo_ticket(id=int(t))


RingInfo = collections.namedtuple("RingInfo", "depth n_free slot_bytes")
RingStats = collections.namedtuple(
    "RingStats", "n_stages n_hits n_copies bytes_copied copy_ms wait_ms bandwidth_gbps")


class Ring(_Handle):
    """lwo_ring: depth device slots serving the layers of a pool (kept alive)."""

    _destroy = "lwo_ring_destroy"

    def __init__(self, pool, depth=2, timing=False, flags=0, resident=()):
        cfg = C.lwo_ring_config()
        _lib.lwo_ring_config_init(cfg)
        cfg.depth = int(depth)
        cfg.flags = int(flags) | (C.LWO_RING_TIMING if timing else 0)
        # since 0.4.0: layers kept on the device (the list is copied by the call)
        resident = [int(l) for l in resident]
        if resident:
            arr = (ctypes.c_uint32 * len(resident))(*resident)
            cfg.resident_layers = arr
            cfg.n_resident = len(resident)
        self.pool = pool
        self._handle = _new_handle(_lib.lwo_ring_create, pool._h(), _byref(cfg))
        self._device = None

    @property
    def device(self):
        if self._device is None:
            self._device = self.pool.engine.device
        return self._device

    def stage(self, layer):
        t = C.lwo_ticket()
        check(_lib.lwo_ring_stage(self._h(), int(layer), _byref(t)))
        return Ticket(t.id, int(layer))

    def acquire(self, ticket, stream=None):
        v = C.lwo_layer_view()
        check(_lib.lwo_ring_acquire(self._h(), _ticket(ticket), stream_handle(stream),
                                    _byref(v)))
        return LayerView(self, self.pool, v, self.device, ticket)

    def tensor(self, ticket, name):
        p = ctypes.c_void_p()
        check(_lib.lwo_ring_tensor(self._h(), _ticket(ticket), _enc(name), _byref(p)))
        return p.value or 0

    def query(self, ticket):
        landed = ctypes.c_uint32()
        check(_lib.lwo_ring_query(self._h(), _ticket(ticket), _byref(landed)))
        return bool(landed.value)

    def ticket_state(self, ticket):
        s = C.lwo_ticket_state_t()
        check(_lib.lwo_ring_ticket_state(self._h(), _ticket(ticket), _byref(s)))
        return s.value

    def release(self, ticket, stream=None):
        check(_lib.lwo_ring_release(self._h(), _ticket(ticket), stream_handle(stream)))

    def release_all(self, stream=None):
        n = ctypes.c_uint32()
        check(_lib.lwo_ring_release_all(self._h(), stream_handle(stream), _byref(n)))
        return n.value

    @contextlib.contextmanager
    def layer(self, layer, stream=None):
        """Stages and acquires a layer on stream; releases it on stream at the
        end of the with block."""
        t = self.stage(layer)
        try:
            yield self.acquire(t, stream)
        finally:
            self.release(t, stream)

    def info(self):
        i = C.lwo_ring_info()
        check(_lib.lwo_ring_get_info(self._h(), _byref(i)))
        return RingInfo(i.depth, i.n_free, i.slot_bytes)

    def stats(self):
        s = C.lwo_ring_stats()
        check(_lib.lwo_ring_get_stats(self._h(), _byref(s)))
        return RingStats(s.n_stages, s.n_hits, s.n_copies, s.bytes_copied, s.copy_ms,
                         s.wait_ms, s.bandwidth_gbps)

    def reset_stats(self):
        check(_lib.lwo_ring_reset_stats(self._h()))

    def schedule(self, layers, stream=None):
        return Schedule(self, layers, stream=stream)

    def _last_resort(self):
        _lib.lwo_ring_release_all(self._handle, None, None)


class Schedule(_Handle):
    """lwo_schedule: a pass over a list of layers of a ring (kept alive).
    Iterating yields one LayerView per layer (lwo_schedule_next on `stream`),
    and ends at LWO_END."""

    _destroy = "lwo_schedule_destroy"

    def __init__(self, ring, layers, stream=None):
        ids = [int(x) for x in layers]
        arr = (ctypes.c_uint32 * max(len(ids), 1))(*ids)
        self.ring = ring
        self.stream = stream
        self._handle = _new_handle(_lib.lwo_schedule_create, ring._h(), arr, len(ids))

    def next(self, stream=None):
        """The next layer's view, or None after the last (LWO_END)."""
        v = C.lwo_layer_view()
        status = check(_lib.lwo_schedule_next(self._h(), stream_handle(stream), _byref(v)))
        if status == C.LWO_END:
            return None
        return LayerView(self, self.ring.pool, v, self.ring.device)

    def __iter__(self):
        return self

    def __next__(self):
        view = self.next(self.stream)
        if view is None:
            raise StopIteration
        return view

    @property
    def position(self):
        p = ctypes.c_uint32()
        check(_lib.lwo_schedule_position(self._h(), _byref(p)))
        return p.value

    def reset(self, stream=None):
        check(_lib.lwo_schedule_reset(self._h(), stream_handle(
            self.stream if stream is None else stream)))


# --------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------
GradsStats = collections.namedtuple(
    "GradsStats", "n_transfers bytes n_accumulated accumulated_bytes accumulate_ns")


class GradTensor(collections.namedtuple("GradTensor", "address dtype first_element n_elements")):
    """Elements [first_element, first_element + n_elements) of a tensor's host
    gradient, of `dtype` (lwo_grads_tensor)."""
    __slots__ = ()

    @property
    def nbytes(self):
        return self.n_elements * dtype_size(self.dtype)

    def memoryview(self):
        """The raw bytes (f32 buffers: cast("f") gives the floats)."""
        return HostMemory(self.address, self.nbytes).memoryview()


class Grads(_Handle):
    """lwo_grads: host gradient buffers of the trainable layers of a pool
    (kept alive), in each tensor's dtype (f32=True: f32 on the wire and on
    the host; native_wire=True: the tensor's dtype on the wire, f32 on the
    host). trainable: None (every layer) or one bool per layer.
    replica_comm (since 0.6.0, sharded pools): None, or the NcclComm (or the
    integer address of a ncclComm_t) of the ranks that hold this rank's
    shard on the other nodes: each gradient part is summed over it too
    (lwo_grads_config.replica_comm); it is kept alive with the set."""

    _destroy = "lwo_grads_destroy"

    def __init__(self, pool, trainable=None, depth=2, native_wire=False, n_threads=0, flags=0,
                 f32=False, replica_comm=None):
        cfg = C.lwo_grads_config()
        _lib.lwo_grads_config_init(cfg)
        cfg.depth = int(depth)
        cfg.flags = (int(flags) | (C.LWO_GRADS_NATIVE_WIRE if native_wire else 0)
                     | (C.LWO_GRADS_F32 if f32 else 0))
        cfg.n_threads = int(n_threads)
        cfg.replica_comm = (replica_comm._h() if isinstance(replica_comm, NcclComm)
                            else replica_comm)
        self.replica_comm = replica_comm
        mask = None
        if trainable is not None:
            flags_ = [1 if t else 0 for t in trainable]
            mask = (ctypes.c_uint8 * max(len(flags_), 1))(*flags_)
        self.pool = pool
        self._handle = _new_handle(_lib.lwo_grads_create, pool._h(), mask, _byref(cfg))

    def begin(self, layer, stream=None):
        v = C.lwo_layer_view()
        check(_lib.lwo_grads_begin(self._h(), int(layer), stream_handle(stream), _byref(v)))
        return LayerView(self, self.pool, v, self.pool.engine.device)

    def end(self, layer, stream=None):
        check(_lib.lwo_grads_end(self._h(), int(layer), stream_handle(stream)))

    def wait(self):
        check(_lib.lwo_grads_wait(self._h()))

    def zero(self):
        check(_lib.lwo_grads_zero(self._h()))

    def query(self):
        return _done(_lib.lwo_grads_query, self._h())

    def tensor(self, layer, name):
        """lwo_grads_tensor: the host gradient this rank holds, in its buffer's
        dtype (read after wait())."""
        t = C.lwo_grad_tensor()
        check(_lib.lwo_grads_tensor(self._h(), int(layer), _enc(name), _byref(t)))
        return GradTensor(t.data or 0, int(t.dtype), t.first_element, t.n_elements)

    def shard(self, layer, name):
        """lwo_grads_shard: the f32 host gradient this rank holds (read after
        wait()); .memoryview() gives the floats. Buffers of another dtype raise
        FormatError (LWO_ERR_BAD_DTYPE): use tensor()."""
        p = ctypes.POINTER(ctypes.c_float)()
        first, n = ctypes.c_uint64(), ctypes.c_uint64()
        check(_lib.lwo_grads_shard(self._h(), int(layer), _enc(name), _byref(p),
                                   _byref(first), _byref(n)))
        addr = ctypes.cast(p, ctypes.c_void_p).value or 0
        return TensorShard(addr, first.value, n.value)

    def stats(self):
        s = C.lwo_grads_stats()
        check(_lib.lwo_grads_get_stats(self._h(), _byref(s)))
        return GradsStats(s.n_transfers, s.bytes, s.n_accumulated, s.accumulated_bytes,
                          s.accumulate_ns)


# --------------------------------------------------------------------------
# The optimizer step on the host (since 0.4.0)
# --------------------------------------------------------------------------
OptimStats = collections.namedtuple(
    "OptimStats", "n_steps n_layer_updates n_params_updated update_ns landing_wait_ns "
    "last_step_ns last_tail_ns n_clipped n_redone last_norm")
OptimInfo = collections.namedtuple(
    "OptimInfo", "kind state_dtype flags n_threads n_numa_nodes n_params state_bytes last_step "
    "vector_level")

_OPTIM_STATES = {"master": 0, "m": 1, "v": 2}


class Optimizer(_Handle):
    """lwo_optim: AdamW (kind="adamw") or SGD with momentum (kind="sgd") over
    the trainable layers of a gradient set (kept alive) and its pool, on host
    threads, each layer updated as its gradients land. state: "f32" or
    "bf16" moments; stochastic: bf16 moments rounded stochastically from
    `seed`; clipping: allows max_norm in step() (keeps a second copy of the
    state); delayed: the one-step-delayed update (LWO_OPTIM_DELAYED)."""

    _destroy = "lwo_optim_destroy"

    def __init__(self, grads, kind="adamw", state="f32", stochastic=False, clipping=False,
                 n_threads=0, seed=0, delayed=False):
        cfg = C.lwo_optim_config()
        _lib.lwo_optim_config_init(cfg)
        if kind not in ("adamw", "sgd"):
            raise ValueError("lwo: optimizer kind %r is neither 'adamw' nor 'sgd'" % (kind,))
        cfg.kind = C.LWO_OPTIM_ADAMW if kind == "adamw" else C.LWO_OPTIM_SGD
        cfg.state_dtype = dtype(state)
        cfg.flags = ((C.LWO_OPTIM_STOCHASTIC_ROUNDING if stochastic else 0)
                     | (C.LWO_OPTIM_CLIPPING if clipping else 0)
                     | (C.LWO_OPTIM_DELAYED if delayed else 0))
        cfg.n_threads = int(n_threads)
        cfg.seed = int(seed)
        self.grads = grads
        self._handle = _new_handle(_lib.lwo_optim_create, grads._h(), _byref(cfg))

    def step(self, step, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, momentum=0.0,
             dampening=0.0, max_norm=0.0, extra_sumsq=0.0):
        """lwo_optim_step: returns at once; call it once the backward's last
        Grads.end of every layer is enqueued. extra_sumsq: the squares of
        gradients held elsewhere, in the clipping norm."""
        p = C.lwo_optim_step_params()
        _lib.lwo_optim_step_params_init(p)
        p.step, p.lr, p.beta1, p.beta2, p.eps = int(step), lr, beta1, beta2, eps
        p.weight_decay, p.momentum, p.dampening, p.max_norm = (
            weight_decay, momentum, dampening, max_norm)
        p.extra_sumsq = extra_sumsq
        check(_lib.lwo_optim_step(self._h(), _byref(p)))

    @staticmethod
    def _groups(step, groups, max_norm, extra_sumsq):
        n = len(groups)
        arr = (C.lwo_optim_step_params * max(n, 1))()
        for i, g in enumerate(groups):
            p = arr[i]
            _lib.lwo_optim_step_params_init(p)
            p.step = int(step)
            for k, v in g.items():
                setattr(p, k, v)
        arr[0].max_norm, arr[0].extra_sumsq = max_norm, extra_sumsq
        return arr, n

    def step_groups(self, step, groups, max_norm=0.0, extra_sumsq=0.0):
        """lwo_optim_step_groups: `groups` a list of dicts, one per group, of
        lr, beta1, beta2, eps, weight_decay, momentum, dampening (missing
        keys: lwo_optim_step_params_init's); max_norm and extra_sumsq go
        with group 0."""
        arr, n = self._groups(step, groups, max_norm, extra_sumsq)
        check(_lib.lwo_optim_step_groups(self._h(), arr, n))

    def step_open(self, step, groups):
        """lwo_optim_step_open: a step that step_add gives layers as their
        gradients are ended, each updated once it lands, until step_close;
        `groups` as step_groups'."""
        arr, n = self._groups(step, groups, 0.0, 0.0)
        check(_lib.lwo_optim_step_open(self._h(), arr, n))

    def step_add(self, layer):
        """lwo_optim_step_add: `layer`'s gradients of the open step are all
        ended."""
        check(_lib.lwo_optim_step_add(self._h(), int(layer)))

    def step_close(self):
        """lwo_optim_step_close: the open step takes the other layers ended
        since their last update, and runs on as an ordinary step."""
        check(_lib.lwo_optim_step_close(self._h()))

    def set_group(self, layer, name, group):
        """lwo_optim_set_group: the tensor's hyperparameter group."""
        check(_lib.lwo_optim_set_group(self._h(), int(layer), _enc(name), int(group)))

    def wait(self):
        check(_lib.lwo_optim_wait(self._h()))

    def query(self):
        return _done(_lib.lwo_optim_query, self._h())

    def read(self, layer, name, which, nbytes):
        """lwo_optim_read: one tensor's "master", "m" or "v" as bytes."""
        buf = (ctypes.c_uint8 * max(int(nbytes), 1))()
        check(_lib.lwo_optim_read(self._h(), int(layer), _enc(name), _OPTIM_STATES[which], buf,
                                  int(nbytes)))
        return bytes(buf)[:int(nbytes)]

    def write(self, layer, name, which, data):
        """lwo_optim_write: one tensor's "master", "m" or "v" from bytes."""
        data = bytes(data)
        buf = (ctypes.c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        check(_lib.lwo_optim_write(self._h(), int(layer), _enc(name), _OPTIM_STATES[which], buf,
                                   len(data)))

    def info(self):
        i = C.lwo_optim_info()
        check(_lib.lwo_optim_get_info(self._h(), _byref(i)))
        return OptimInfo(i.kind, i.state_dtype, i.flags, i.n_threads, i.n_numa_nodes, i.n_params,
                         i.state_bytes, i.last_step,
                         i.vector_level.decode() if i.vector_level else None)

    def stats(self):
        s = C.lwo_optim_stats()
        check(_lib.lwo_optim_get_stats(self._h(), _byref(s)))
        return OptimStats(s.n_steps, s.n_layer_updates, s.n_params_updated, s.update_ns,
                          s.landing_wait_ns, s.last_step_ns, s.last_tail_ns, s.n_clipped,
                          s.n_redone, s.last_norm)


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------
CheckpointTensor = collections.namedtuple(
    "CheckpointTensor", "name dtype dtype_name shape bytes file_offset file")
CheckpointFile = collections.namedtuple("CheckpointFile", "path bytes n_tensors")
MetadataEntry = collections.namedtuple("MetadataEntry", "file key value")
MappedTensor = collections.namedtuple("MappedTensor", "name layer layer_name")


class TensorMap:
    """lwo_checkpoint_map_tensors: for each checkpoint tensor (in
    Checkpoint.tensors() order) its layer (None: no layer) and its name in
    the layer; n_layers the layer count; unmatched the names of no layer."""

    def __init__(self, n_layers, entries):
        self.n_layers = n_layers
        self.entries = entries

    def layer(self, i):
        """The (layer_name, checkpoint name) pairs of layer i, in file order."""
        return [(e.layer_name, e.name) for e in self.entries if e.layer == i]

    def layers(self):
        out = [[] for _ in range(self.n_layers)]
        for e in self.entries:
            if e.layer is not None:
                out[e.layer].append((e.layer_name, e.name))
        return out

    @property
    def unmatched(self):
        return [e.name for e in self.entries if e.layer is None]

    def __repr__(self):
        return "<lwo.TensorMap %d layers, %d tensors>" % (self.n_layers, len(self.entries))


class Checkpoint(_Handle):
    """lwo_checkpoint: a safetensors file (or the shards of an index) mapped
    read-only. Needs no engine and no GPU."""

    _destroy = "lwo_checkpoint_destroy"

    def __init__(self, path):
        self.path = os.fspath(path)
        self._handle = _new_handle(_lib.lwo_checkpoint_open, _enc(self.path))

    @classmethod
    def open(cls, path):
        return cls(path)

    def tensor_count(self):
        n = ctypes.c_uint32()
        check(_lib.lwo_checkpoint_tensor_count(self._h(), _byref(n)))
        return n.value

    def tensor(self, index):
        t = C.lwo_checkpoint_tensor()
        check(_lib.lwo_checkpoint_tensor_info(self._h(), _fit(index, 32, False, "tensor index"),
                                              _byref(t)))
        nd = min(t.n_dims, C.LWO_MAX_DIMS)
        return CheckpointTensor(_dec(t.name), None if t.dtype < 0 else t.dtype,
                                _dec(t.dtype_name), tuple(t.shape[:nd]), t.bytes,
                                t.file_offset, t.file)

    def tensors(self):
        return [self.tensor(i) for i in range(self.tensor_count())]

    def file_count(self):
        n = ctypes.c_uint32()
        check(_lib.lwo_checkpoint_file_count(self._h(), _byref(n)))
        return n.value

    def files(self):
        out = []
        for i in range(self.file_count()):
            f = C.lwo_checkpoint_file()
            check(_lib.lwo_checkpoint_file_info(self._h(), i, _byref(f)))
            out.append(CheckpointFile(_dec(f.path), f.bytes, f.n_tensors))
        return out

    def metadata(self):
        """Every "__metadata__" entry: MetadataEntry(file, key, value), file by
        file, key by key."""
        n = ctypes.c_uint32()
        check(_lib.lwo_checkpoint_metadata_count(self._h(), _byref(n)))
        out = []
        for i in range(n.value):
            f, k, v = ctypes.c_uint32(), ctypes.c_char_p(), ctypes.c_char_p()
            check(_lib.lwo_checkpoint_metadata(self._h(), i, _byref(f), _byref(k), _byref(v)))
            out.append(MetadataEntry(f.value, _dec(k.value), _dec(v.value)))
        return out

    def map_tensors(self, pattern=None, patterns=None, names=None, allow_gaps=False,
                    staged=False):
        """Which layer each tensor becomes under pattern=, patterns= or names=,
        exactly as Pool.from_checkpoint would map it: a TensorMap."""
        cfg, keep = _checkpoint_config(pattern, patterns, names, allow_gaps, staged)
        n = self.tensor_count()
        layers = (ctypes.c_uint32 * max(n, 1))()
        lnames = (ctypes.c_char_p * max(n, 1))()
        n_layers = ctypes.c_uint32()
        check(_lib.lwo_checkpoint_map_tensors(self._h(), _byref(cfg), n, layers, lnames,
                                              _byref(n_layers)))
        entries = []
        for i in range(n):
            t = C.lwo_checkpoint_tensor()
            check(_lib.lwo_checkpoint_tensor_info(self._h(), i, _byref(t)))
            layer = None if layers[i] == C.LWO_NO_LAYER else layers[i]
            entries.append(MappedTensor(_dec(t.name), layer, _dec(lnames[i])))
        return TensorMap(n_layers.value, entries)

    def unmatched(self, pattern=None, patterns=None, names=None, allow_gaps=False,
                  staged=False):
        """lwo_checkpoint_unmatched_count/_name: the tensors the mapping leaves out."""
        cfg, keep = _checkpoint_config(pattern, patterns, names, allow_gaps, staged)
        n = ctypes.c_uint32()
        check(_lib.lwo_checkpoint_unmatched_count(self._h(), _byref(cfg), _byref(n)))
        out = []
        for i in range(n.value):
            s = ctypes.c_char_p()
            check(_lib.lwo_checkpoint_unmatched_name(self._h(), _byref(cfg), i, _byref(s)))
            out.append(_dec(s.value))
        return out
