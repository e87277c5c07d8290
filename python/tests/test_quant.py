"""Quantized weights from Python, without a device: the format names, the
layouts (lwo.quant_layout, lwo.record_layout of quantized TensorSpecs)
against the layout rule, lwo.quantize / lwo.dequantize against a numpy
reference of each format's codec (the codes, the scales and the dequantized
values bit for bit, on fresh random data with heavy-tailed outliers), and
the refusals (each with the exception its status maps to). Pool's quantized
calls on a NULL handle: the arguments convert and the status raises.

The reference follows lwo.h's rule: an integer format's scale is
max(amax / M, 2^-126) in f32 (M = 127, 7), an fp8 format's the smallest power
of two s with amax / s <= 464 (at least 2^-126), a code is value / scale (f32)
rounded to nearest even
(e4m3 saturating to +-448, the integer codes clamped to +-M), a dequantized
element code x scale (one f32 multiply) rounded to nearest even to the
output dtype. Needs numpy (skipped without it)."""

import os

import pytest

np = pytest.importorskip("numpy")

import lwo  # noqa: E402
from lwo import _capi as C  # noqa: E402
from lwo import _core  # noqa: E402

ALIGN = C.LWO_RECORD_ALIGN
FORMATS = {"fp8": C.LWO_QUANT_FP8_E4M3_CHANNEL, "fp8-block": C.LWO_QUANT_FP8_E4M3_BLOCK128,
           "int8": C.LWO_QUANT_INT8_CHANNEL, "int4": C.LWO_QUANT_INT4_GROUP128}
MAX = {"fp8": 448.0, "fp8-block": 448.0, "int8": 127.0, "int4": 7.0}
MIN_SCALE = np.float32(2.0 ** -126)


def rng():
    """A fresh generator; its seed goes into the failure messages."""
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


def heavy_tailed(g, rows, cols):
    """Normal weights with a few large outliers per row (x 30 .. x 300)."""
    w = g.standard_normal((rows, cols)).astype(np.float32) * np.float32(0.02)
    for r in range(rows):
        idx = g.integers(0, cols, size=3)
        w[r, idx] *= g.uniform(30, 300, size=3).astype(np.float32) * g.choice([-1, 1], 3)
    return w


# ---- the numpy reference of the formats --------------------------------------

def round_up(n, a=ALIGN):
    return (n + a - 1) // a * a


def bf16_bits(x):
    """f32 -> bf16 bits, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def bf16_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def e4m3_table():
    """The 256 e4m3 codes as f32 (NaN for 0x7f and 0xff)."""
    out = np.empty(256, dtype=np.float32)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
        if e == 0xF and m == 7:
            v = np.nan
        elif e == 0:
            v = m * 2.0 ** -9
        else:
            v = (1 + m / 8.0) * 2.0 ** (e - 7)
        out[b] = -v if s else v
    return out


E4M3 = e4m3_table()
_POS = np.arange(0x7F)  # the non-negative finite codes 0x00..0x7e, in increasing value


def e4m3_encode(v):
    """Nearest e4m3 code of each f32 value (ties to the even code), saturating."""
    a = np.abs(v).astype(np.float64)
    vals = E4M3[_POS].astype(np.float64)
    hi = np.clip(np.searchsorted(vals, a, side="left"), 0, len(vals) - 1)
    lo = np.clip(hi - 1, 0, len(vals) - 1)
    d_hi, d_lo = np.abs(vals[hi] - a), np.abs(a - vals[lo])
    pick = np.where(d_lo < d_hi, lo, hi)
    tie = d_lo == d_hi
    pick = np.where(tie, np.where(lo % 2 == 0, lo, hi), pick)
    pick = np.where(a >= 448.0, 0x7E, pick)
    sign = (np.signbit(v).astype(np.uint8) << 7)
    return (pick.astype(np.uint8) | sign).astype(np.uint8)


def scale_map(fmt, rows, cols):
    """(scale_rows, scale_cols, function (r, c) -> scale index arrays)."""
    if fmt == "fp8-block":
        sr, sc = -(-rows // 128), -(-cols // 128)
        return sr, sc, lambda r, c: (r // 128) * sc + c // 128
    if fmt == "int4":
        return rows, cols // 128, lambda r, c: r * (cols // 128) + c // 128
    return rows, 1, lambda r, c: r


def reference_quantize(fmt, x32):
    """(codes as stored, scales [sr, sc]) of an f32 array, by lwo.h's rule."""
    rows, cols = x32.shape
    sr, sc, index = scale_map(fmt, rows, cols)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    idx = index(r, c)
    amax = np.zeros(sr * sc, dtype=np.float32)
    np.maximum.at(amax, idx.ravel(), np.abs(x32).ravel())
    if fmt.startswith("fp8"):
        # the smallest k with 464 x 2^k >= amax (exact in f64), k >= -126
        k = np.ceil(np.log2(amax.astype(np.float64) / 464.0, where=amax > 0,
                            out=np.full(amax.shape, -126.0)))
        k = np.maximum(k, -126)
        k = np.where(np.ldexp(464.0, (k - 1).astype(np.int32)) >= amax, k - 1, k)
        k = np.where(np.ldexp(464.0, k.astype(np.int32)) < amax, k + 1, k)
        scales = np.ldexp(np.float32(1), np.maximum(k, -126).astype(np.int32)).astype(np.float32)
    else:
        scales = np.maximum(amax / np.float32(MAX[fmt]), MIN_SCALE).astype(np.float32)
    v = (x32 / scales[idx]).astype(np.float32)
    if fmt.startswith("fp8"):
        codes = e4m3_encode(v)
    else:
        q = np.rint(np.clip(v, -MAX[fmt], MAX[fmt])).astype(np.int32)
        if fmt == "int8":
            codes = q.astype(np.int8).view(np.uint8)
        else:
            n = (q + 8).astype(np.uint8)
            codes = (n[:, 0::2] | (n[:, 1::2] << 4)).astype(np.uint8)
    return codes, scales.reshape(sr, sc)


def reference_dequantize_f32(fmt, codes, scales, rows, cols):
    sr, sc, index = scale_map(fmt, rows, cols)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    s = scales.ravel()[index(r, c)]
    if fmt.startswith("fp8"):
        val = E4M3[codes]
    elif fmt == "int8":
        val = codes.view(np.int8).astype(np.float32)
    else:
        n = np.empty((rows, cols), dtype=np.int32)
        n[:, 0::2] = codes & 0xF
        n[:, 1::2] = codes >> 4
        val = (n - 8).astype(np.float32)
    return (val * s).astype(np.float32)


def as_dtype(x32, dt):
    """(the array as lwo takes it: f32, f16, or uint16 bf16 bits; its f32 values)."""
    if dt == "f32":
        return x32, x32
    if dt == "f16":
        h = x32.astype(np.float16)
        return h, h.astype(np.float32)
    b = bf16_bits(x32)
    return b, bf16_to_f32(b)


def to_out(v32, dt):
    if dt == "f32":
        return v32
    if dt == "f16":
        return v32.astype(np.float16)  # numpy rounds to nearest even
    return bf16_bits(v32)


# ---- names -------------------------------------------------------------------

def test_format_names():
    for spelling, value in FORMATS.items():
        assert lwo.quant_format(spelling) == value
        assert lwo.quant_format(spelling.upper()) == value
        assert lwo.quant_format(value) == value
        assert lwo.quant_spelling(value) == spelling
        name = lwo.quant_format_name(value)
        assert lwo.quant_format(name) == value
        assert lwo.quant_format("LWO_QUANT_" + name.upper()) == value
    assert lwo.quant_format("fp8_block") == C.LWO_QUANT_FP8_E4M3_BLOCK128
    assert lwo.quant_format_name("fp8") == "fp8_e4m3_channel"
    assert lwo.quant_format(None) == lwo.quant_format("none") == C.LWO_QUANT_NONE
    assert lwo.quant_spelling(None) == "none"
    assert lwo.QUANT_FORMATS == ("fp8", "fp8-block", "int8", "int4")
    with pytest.raises(ValueError, match="'nf4'"):
        lwo.quant_format("nf4")
    with pytest.raises(TypeError):
        lwo.quant_format(True)
    assert lwo.quant_format_name(77) == "unknown"


# ---- layouts -----------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", [(1, 128), (300, 256), (129, 384), (7, 1280)])
@pytest.mark.parametrize("dt", ["f32", "bf16", "f16"])
def test_layout_rule(fmt, shape, dt):
    rows, cols = shape
    lo = lwo.quant_layout(fmt, shape, dt)
    data = rows * cols // 2 if fmt == "int4" else rows * cols
    sr, sc, _ = scale_map(fmt, rows, cols)
    assert (lo.format, lo.dtype, lo.rows, lo.cols) == (FORMATS[fmt], lwo.dtype(dt), rows, cols)
    assert (lo.data_offset, lo.data_bytes) == (0, data)
    assert lo.scale_offset == round_up(data)
    assert (lo.scale_rows, lo.scale_cols, lo.scale_bytes) == (sr, sc, 4 * sr * sc)
    assert lo.total_bytes == round_up(lo.scale_offset + lo.scale_bytes)
    assert lo.dense_bytes == rows * cols * lwo.dtype_size(dt)
    assert lo.saved_bytes == lo.dense_bytes - lo.total_bytes


def test_fp8_block_any_shape():
    lo = lwo.quant_layout("fp8-block", (1, 1))
    assert (lo.scale_rows, lo.scale_cols, lo.total_bytes) == (1, 1, 2 * ALIGN)
    lo = lwo.quant_layout("fp8-block", (257, 129), "f32")
    assert (lo.scale_rows, lo.scale_cols) == (3, 2)


def test_record_layout_of_quantized_tensors():
    layer = [lwo.TensorSpec("w", "bf16", (384, 512), quant="int4"),
             {"name": "w2", "dtype": "f16", "shape": (100, 200), "quant": "fp8-block"},
             ("b", "bf16", (384,)),
             lwo.TensorSpec("w3", "f32", (64, 256), quant=C.LWO_QUANT_INT8_CHANNEL)]
    offsets, record = lwo.record_layout(layer)
    sizes = [lwo.quant_layout("int4", (384, 512)).total_bytes,
             lwo.quant_layout("fp8-block", (100, 200), "f16").total_bytes,
             384 * 2,
             lwo.quant_layout("int8", (64, 256), "f32").total_bytes]
    expect, at = [], 0
    for n in sizes:
        expect.append(at)
        at = round_up(at + n)
    assert offsets == expect
    assert record == at
    # the same tensors dense: each its elements' bytes
    dense = [lwo.TensorSpec(t.name, t.dtype, t.shape) for t in map(_core._tensor_spec, layer)]
    offsets, dense_record = lwo.record_layout(dense)
    sizes = [384 * 512 * 2, 100 * 200 * 2, 384 * 2, 64 * 256 * 4]
    expect, at = [], 0
    for n in sizes:
        expect.append(at)
        at = round_up(at + n)
    assert (offsets, dense_record) == (expect, at)
    assert dense_record > record


@pytest.mark.parametrize("spec, what", [
    (lwo.TensorSpec("w", "bf16", (64, 100), quant="int4"), "multiple"),
    (lwo.TensorSpec("w", "bf16", (64, 128, 2), quant="fp8"), "w"),
    (lwo.TensorSpec("w", "bf16", (4096,), quant="int8"), "w"),
    (lwo.TensorSpec("w", "i8", (64, 128), quant="int8"), "w"),
    (lwo.TensorSpec("w", "bf16", (64, 128), quant=9), "w"),
])
def test_record_layout_refuses_bad_quantized_tensors(spec, what):
    with pytest.raises(lwo.ArgumentError) as e:
        lwo.record_layout([("b", "f32", (16,)), spec])
    assert e.value.status == C.LWO_ERR_INVALID_ARGUMENT
    assert e.value.message.startswith("lwo_record_layout"), e.value.message
    assert what in e.value.message, e.value.message


def test_layout_refusals():
    for bad, status in [(("none", (8, 128), "bf16"), C.LWO_ERR_INVALID_ARGUMENT),
                        ((9, (8, 128), "bf16"), C.LWO_ERR_INVALID_ARGUMENT),
                        (("int4", (8, 130), "bf16"), C.LWO_ERR_INVALID_ARGUMENT),
                        (("int8", (8, 128), "f64"), C.LWO_ERR_INVALID_ARGUMENT),
                        (("fp8", (0, 128), "bf16"), C.LWO_ERR_INVALID_ARGUMENT),
                        (("fp8", (2 ** 31, 128), "bf16"), C.LWO_ERR_OUT_OF_RANGE)]:
        with pytest.raises(lwo.ArgumentError) as e:
            lwo.quant_layout(*bad)
        assert e.value.status == status, (bad, e.value)
        assert e.value.message.startswith("lwo_quant_layout"), e.value.message
    with pytest.raises(ValueError, match="2-D"):
        lwo.quant_layout("fp8", (8, 128, 1))


# ---- quantize / dequantize against the reference ---------------------------------

@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dt", ["f32", "bf16", "f16"])
def test_round_trip_against_reference(fmt, dt):
    g, seed = rng()
    rows, cols = (257, 384)
    x_in, x32 = as_dtype(heavy_tailed(g, rows, cols), dt)
    q = lwo.quantize(x_in, fmt, n_threads=2)
    assert isinstance(q, lwo.QuantizedTensor)
    assert (q.format, q.dtype, q.shape) == (FORMATS[fmt], lwo.dtype(dt), (rows, cols))
    assert q.layout == lwo.quant_layout(fmt, (rows, cols), dt)
    assert q.data.dtype == np.uint8 and q.data.nbytes == q.nbytes == q.layout.total_bytes
    assert q.saved_bytes == rows * cols * lwo.dtype_size(dt) - q.nbytes > 0

    codes, scales = reference_quantize(fmt, x32)
    assert np.array_equal(q.scales, scales), "seed %d: scales" % seed
    got_codes = q.codes.view(np.uint8) if fmt == "int8" else q.codes
    assert np.array_equal(got_codes, codes), "seed %d: codes differ at %s" % (
        seed, np.argwhere(got_codes != codes)[:5].tolist())
    # the padding after the codes and after the scales is zero
    lo = q.layout
    assert not q.data[lo.data_bytes:lo.scale_offset].any()
    assert not q.data[lo.scale_offset + lo.scale_bytes:].any()

    v32 = reference_dequantize_f32(fmt, codes, scales, rows, cols)
    for out in ("f32", "bf16", "f16"):
        got = lwo.dequantize(q, dtype=out, n_threads=1)
        want = to_out(v32, out)
        assert got.dtype == want.dtype and got.shape == (rows, cols)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), \
            "seed %d: %s -> %s differs at %s" % (seed, fmt, out,
                                                 np.argwhere(got != want)[:5].tolist())
    # the default output is the tensor's own dtype
    assert np.array_equal(q.dequantize().view(np.uint8), to_out(v32, dt).view(np.uint8))

    # the round-trip error, element by element: half a step of the code grid
    # (e4m3: 2^-4 of the value for normals, 2^-10 of the scale for subnormals),
    # plus the f32 roundings of x / scale and of code x scale (2^-22 of |x|)
    _, _, index = scale_map(fmt, rows, cols)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    s = scales.ravel()[index(r, c)].astype(np.float64)
    err = np.abs(v32.astype(np.float64) - x32.astype(np.float64))
    if fmt.startswith("fp8"):
        bound = np.maximum(np.abs(x32) * 2.0 ** -4, s * 2.0 ** -10)
    else:
        bound = s * 0.5
    bound = bound + np.abs(x32).astype(np.float64) * 2.0 ** -22
    assert (err <= bound).all(), "seed %d: %s error %g over its bound" % (
        seed, fmt, float((err - bound).max()))
    if fmt.startswith("fp8"):
        # each scale is a power of two that puts its unit's largest magnitude
        # in (232, 464] code units
        assert np.array_equal(scales, np.ldexp(np.float32(1), np.frexp(scales)[1] - 1))
        amax = np.zeros(scales.size, dtype=np.float64)
        np.maximum.at(amax, index(r, c).ravel(), np.abs(x32).astype(np.float64).ravel())
        u = amax / scales.ravel().astype(np.float64)
        assert ((u <= 464) & ((u > 232) | (scales.ravel() == MIN_SCALE))).all()
    else:
        # each unit's largest magnitude is exactly representable: it maps to +-M
        assert np.abs(v32).max() == pytest.approx(np.abs(x32).max(), rel=1e-6)


def test_dequantize_raw_bytes_and_nan_codes():
    g, seed = rng()
    w = g.standard_normal((4, 256)).astype(np.float32)
    q = lwo.quantize(w, "fp8")
    raw = bytearray(q.data.tobytes())
    raw[5] = 0x7F   # row 0, column 5: the fp8 NaN codes
    raw[256 + 9] = 0xFF
    for out, nan in (("f32", 0x7FC00000), ("bf16", 0x7FC0), ("f16", 0x7E00)):
        got = lwo.dequantize(bytes(raw), format="fp8", shape=(4, 256), dtype=out)
        bits = got.view({"f32": np.uint32, "bf16": np.uint16, "f16": np.uint16}[out])
        assert bits[0, 5] == nan and bits[1, 9] == nan
        ref = q.dequantize(out)
        mask = np.ones((4, 256), bool)
        mask[0, 5] = mask[1, 9] = False
        assert np.array_equal(bits[mask], ref.view(bits.dtype)[mask]), "seed %d" % seed
    # a strided array is quantized as its contiguous copy
    wt = g.standard_normal((256, 128)).astype(np.float32).T
    assert not wt.flags.c_contiguous
    assert np.array_equal(lwo.quantize(wt, "int8").data,
                          lwo.quantize(np.ascontiguousarray(wt), "int8").data)
    # a QuantizedTensor over bytes it did not make
    q2 = lwo.QuantizedTensor(bytes(q.data), "fp8", (4, 256), "f32")
    assert np.array_equal(q2.dequantize(), q.dequantize())
    assert np.array_equal(q2.scales, q.scales)


def test_bf16_inputs_agree():
    """uint16 bits, int16 bits, a CPU torch bfloat16 tensor and a raw buffer
    with dtype= are the same bf16 source."""
    g, seed = rng()
    bits = bf16_bits(heavy_tailed(g, 64, 256))
    ref = lwo.quantize(bits, "int4")
    assert ref.dtype == C.LWO_DTYPE_BF16
    assert np.array_equal(lwo.quantize(bits.view(np.int16), "int4").data, ref.data)
    raw = lwo.quantize(bits.tobytes(), "int4", dtype="bf16", shape=(64, 256))
    assert np.array_equal(raw.data, ref.data)
    try:
        import torch
    except ImportError:
        return
    t = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    assert np.array_equal(lwo.quantize(t, "int4").data, ref.data), "seed %d" % seed


def test_quantize_refusals():
    g, _ = rng()
    w = g.standard_normal((16, 256)).astype(np.float32)
    bad = w.copy()
    bad[3, 17] = np.nan
    with pytest.raises(lwo.ArgumentError) as e:
        lwo.quantize(bad, "int8")
    assert e.value.status == C.LWO_ERR_INVALID_ARGUMENT
    assert e.value.message.startswith("lwo_quantize") and "3" in e.value.message \
        and "17" in e.value.message, e.value.message
    bad[3, 17] = np.inf
    with pytest.raises(lwo.ArgumentError):
        lwo.quantize(bad, "fp8")
    with pytest.raises(lwo.ArgumentError) as e:
        lwo.quantize(w[:, :200].copy(), "int4")
    assert "128" in e.value.message
    with pytest.raises(lwo.ArgumentError) as e:
        lwo.quantize(w.astype(np.float64), "int8")
    assert "f64" in e.value.message
    with pytest.raises(lwo.ArgumentError):
        lwo.quantize(w, "none")
    with pytest.raises(ValueError, match="unknown quantized format"):
        lwo.quantize(w, "fp4")
    with pytest.raises(ValueError, match="2-D"):
        lwo.quantize(w.reshape(16, 16, 16), "fp8")
    with pytest.raises(TypeError, match="dtype="):
        lwo.quantize(w.tobytes(), "fp8", shape=(16, 256))
    with pytest.raises(lwo.ArgumentError) as e:  # the buffer is smaller than the shape
        lwo.quantize(w.tobytes(), "fp8", dtype="f32", shape=(32, 256))
    assert e.value.status == C.LWO_ERR_SIZE_MISMATCH, e.value
    q = lwo.quantize(w, "fp8")
    with pytest.raises(lwo.ArgumentError) as e:  # too few quantized bytes
        lwo.dequantize(bytes(q.data[:100]), format="fp8", shape=(16, 256))
    assert e.value.status == C.LWO_ERR_SIZE_MISMATCH, e.value
    assert e.value.message.startswith("lwo_dequantize_host"), e.value.message
    with pytest.raises(lwo.ArgumentError):
        lwo.dequantize(q, dtype="i8")
    with pytest.raises(TypeError, match="format= and shape="):
        lwo.dequantize(bytes(q.data))
    with pytest.raises(ValueError, match="less than"):
        lwo.QuantizedTensor(bytes(q.data[:100]), "fp8", (16, 256))


# ---- Pool's and Engine's quantized calls, without a device ----------------------

def test_pool_and_engine_calls_on_null_handles():
    """The arguments convert and LWO_ERR_INVALID_HANDLE raises, naming the call."""
    pool = _core.Pool._make(None, 0)
    w = np.zeros((8, 128), dtype=np.float32)
    for data, src in ((w, None), (w.astype(np.float16), None), (bf16_bits(w), None),
                      (w.tobytes(), "f32")):
        with pytest.raises(lwo.ArgumentError) as e:
            pool.write_quantized(0, "w", data, src_dtype=src, n_threads=1)
        assert e.value.status == C.LWO_ERR_INVALID_HANDLE, e.value
        assert e.value.message.startswith("lwo_pool_write_quantized"), e.value.message
    eng = object.__new__(_core.Engine)
    eng._handle = 0
    with pytest.raises(lwo.ArgumentError) as e:
        eng.dequantize("fp8", (8, 128), 0x1000, 0x2000, dtype="bf16", stream=0x10)
    assert e.value.status == C.LWO_ERR_INVALID_HANDLE
    assert e.value.message.startswith("lwo_dequantize"), e.value.message
    d = lwo.linear_desc(128, 8, weight_format="int4")
    assert d.weight_format == C.LWO_QUANT_INT4_GROUP128
    assert lwo.linear_desc(128, 8).weight_format == C.LWO_QUANT_NONE


def test_tensor_info_reports_the_format_and_the_bytes_saved():
    lo = lwo.quant_layout("fp8", (512, 256), "bf16")
    info = lwo.TensorInfo("w", C.LWO_DTYPE_BF16, (512, 256), 0, lo.total_bytes,
                          C.LWO_QUANT_FP8_E4M3_CHANNEL)
    assert info.quant == "fp8"
    assert info.dense_bytes == 512 * 256 * 2
    assert info.saved_bytes == 512 * 256 * 2 - lo.total_bytes == lo.saved_bytes
    dense = lwo.TensorInfo("b", C.LWO_DTYPE_F32, (512,), 0, 2048)
    assert dense.quant is None and dense.saved_bytes == 0 and dense.dense_bytes == 2048
