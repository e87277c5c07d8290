// Quantized weights on the device (lwo_dequantize): equal to the CPU
// reference lwo_dequantize_host bit for bit for every format and output
// dtype, on fresh random data (weights quantized by lwo_quantize, and raw
// random codes with random scales, NaN codes, non-finite, huge and subnormal
// scales included), on shapes that are not multiples of 8, through each of
// the kernel's paths (units: 8 elements per step, with 1 or 4 units per
// thread step, each unit decoded fast or by the reference functions; scalar,
// picked by shape and alignment), ordered after a copy on the same stream,
// and straight from a ring slot.
#include <limits>

#include "gpu_util.h"
#include "quant_util.h"
#include "testkit/dtype.h"
#include "testkit/spin.h"

namespace lwo_test {
namespace {

constexpr lwo_dtype_t kOut[] = {LWO_DTYPE_F32, LWO_DTYPE_BF16, LWO_DTYPE_F16};

// The shapes of a format: one element, cols not a multiple of 8 (scalar
// path), of 8 but not 16 (units: 200, 1000), of 16 but not 128 (units, with
// partial fp8 blocks: 400), of 128, partial blocks in both dimensions. int4
// cols are multiples of 128, so always units where aligned.
std::vector<std::pair<int64_t, int64_t>> shapes(lwo_quant_format_t f) {
  if (f == LWO_QUANT_INT4_GROUP128) return {{1, 128}, {5, 384}, {130, 256}, {257, 1024}};
  return {{1, 1}, {3, 7}, {129, 257}, {130, 200}, {130, 400}, {256, 1024}, {300, 1000}};
}

// A quantized tensor on the host: lwo_quantize of random bf16 weights (a few
// outliers per row), or (raw) random code bytes with random positive scales.
std::vector<uint8_t> make_quantized(const lwo_quant_desc& d, bool raw, std::mt19937_64& rng,
                                    lwo_quant_layout_info* info) {
  *info = LWO_QUANT_LAYOUT_INFO_INIT;
  EXPECT_EQ(LWO_OK, lwo_quant_layout(&d, info)) << lwo_last_error_message();
  std::vector<uint8_t> q(info->total_bytes, 0);
  if (raw) {
    for (uint64_t i = 0; i < info->data_bytes; i += 8) {  // 8 random bytes per draw
      const uint64_t x = rng();
      std::memcpy(&q[i], &x, std::min<uint64_t>(8, info->data_bytes - i));
    }
    // Mostly ordinary scales; one in eight special: non-finite (the
    // reference path), huge (products that overflow bf16 / f16 to
    // infinity), tiny or subnormal (subnormal products).
    std::uniform_real_distribution<float> s(1e-4f, 2.0f);
    const float special[] = {std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN(), 1e38f, 3e4f, 1e-30f,
                             1e-40f, -0.5f};
    for (int64_t i = 0; i < info->scale_rows * info->scale_cols; ++i) {
      const uint64_t pick = rng();
      const float v = pick % 8 == 0 ? special[(pick >> 8) % 8] : s(rng);
      std::memcpy(&q[info->scale_offset + 4 * static_cast<uint64_t>(i)], &v, 4);
    }
    return q;
  }
  const size_t n = static_cast<size_t>(d.rows * d.cols);
  std::normal_distribution<float> g(0.0f, 0.02f);
  std::vector<uint16_t> w(n);
  for (size_t i = 0; i < n; ++i) testkit::store_f32(w.data(), LWO_DTYPE_BF16, i, g(rng));
  for (int64_t r = 0; r < d.rows; ++r)
    testkit::store_f32(w.data(), LWO_DTYPE_BF16,
                       static_cast<uint64_t>(r * d.cols) + rng() % static_cast<uint64_t>(d.cols), 1.5f);
  lwo_quant_desc src = d;
  src.dtype = LWO_DTYPE_BF16;
  EXPECT_EQ(LWO_OK, lwo_quantize(&src, w.data(), w.size() * 2, q.data(), q.size(), 0))
      << lwo_last_error_message();
  return q;
}

// The CPU reference's bytes.
std::vector<uint8_t> reference(const lwo_quant_desc& d, const std::vector<uint8_t>& q) {
  std::vector<uint8_t> out(static_cast<size_t>(d.rows * d.cols) * lwo_dtype_size(d.dtype));
  EXPECT_EQ(LWO_OK, lwo_dequantize_host(&d, q.data(), q.size(), out.data(), out.size(), 0))
      << lwo_last_error_message();
  return out;
}

// "" when equal, else the first differing element.
std::string first_difference(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                             size_t esize) {
  if (got.size() != want.size()) return "sizes differ";
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      const size_t e = i / esize;
      uint32_t g = 0, w = 0;
      std::memcpy(&g, &got[e * esize], esize);
      std::memcpy(&w, &want[e * esize], esize);
      char buf[160];
      std::snprintf(buf, sizeof buf, "element %zu: device 0x%x, host 0x%x", e, g, w);
      return buf;
    }
  return "";
}

class Quant : public GpuTest {
 protected:
  // Dequantizes q on the device at byte offsets (src_off, dst_off) of fresh
  // allocations, on stream(0); returns the output bytes.
  std::vector<uint8_t> on_device(const lwo_quant_desc& d, const std::vector<uint8_t>& q,
                                 size_t src_off, size_t dst_off) {
    const size_t out_bytes = static_cast<size_t>(d.rows * d.cols) * lwo_dtype_size(d.dtype);
    testkit::DeviceMem src = testkit::device_alloc(q.size() + src_off, "quantized");
    testkit::DeviceMem dst = testkit::device_alloc(out_bytes + dst_off, "dequantized");
    auto* s = static_cast<uint8_t*>(src.get()) + src_off;
    auto* o = static_cast<uint8_t*>(dst.get()) + dst_off;
    std::vector<uint8_t> out(out_bytes);
    // On stream(0), as the dequantization: a non-blocking stream is not
    // ordered after the legacy stream's cudaMemset, and a pageable
    // cudaMemcpy may return before its bytes reach the device.
    EXPECT_EQ(cudaSuccess,
              cudaMemcpyAsync(s, q.data(), q.size(), cudaMemcpyHostToDevice, stream(0)));
    EXPECT_EQ(cudaSuccess, cudaMemsetAsync(o, 0xff, out_bytes, stream(0)));  // NaN everywhere
    EXPECT_LWO_OK(lwo_dequantize(engine_, &d, s, o, stream(0)));
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream(0)));
    EXPECT_EQ(cudaSuccess, cudaMemcpy(out.data(), o, out_bytes, cudaMemcpyDeviceToHost));
    return out;
  }
};

TEST_F(Quant, DeviceEqualsHostForEveryFormatDtypeAndShape) {
  std::mt19937_64 rng(fresh_seed());
  int checked = 0;
  for (lwo_quant_format_t f : kFormats)
    for (auto [rows, cols] : shapes(f))
      for (bool raw : {false, true})
        for (lwo_dtype_t dt : kOut) {
          lwo_quant_desc d = desc_of(f, rows, cols, dt);
          SCOPED_TRACE(std::string(lwo_quant_format_name(f)) + " " + std::to_string(rows) + "x" +
                       std::to_string(cols) + " -> " + lwo_dtype_name(dt) +
                       (raw ? ", raw codes" : ", quantized weights"));
          lwo_quant_layout_info info;
          std::vector<uint8_t> q = make_quantized(d, raw, rng, &info);
          std::vector<uint8_t> want = reference(d, q);
          ASSERT_EQ("", first_difference(on_device(d, q, 0, 0), want, lwo_dtype_size(dt)))
              << "aligned (unit path where cols % 8 == 0, else scalar)";
          // src 8 bytes past 16-byte alignment: still the unit load's alignment.
          ASSERT_EQ("", first_difference(on_device(d, q, 8, 0), want, lwo_dtype_size(dt)))
              << "src at +8 bytes (unit path where cols % 8 == 0, else scalar)";
          // src at +4 bytes: units for int4 (4-byte loads), scalar for the others.
          ASSERT_EQ("", first_difference(on_device(d, q, 4, 0), want, lwo_dtype_size(dt)))
              << "src at +4 bytes (unit path for int4, else scalar)";
          // Unaligned: src at +1 byte, dst at one element past 16-byte alignment.
          ASSERT_EQ("", first_difference(on_device(d, q, 1, lwo_dtype_size(dt)), want,
                                         lwo_dtype_size(dt)))
              << "unaligned (scalar path)";
          ++checked;
        }
  EXPECT_EQ(checked, 2 * 3 * (7 * 3 + 4));
}

TEST_F(Quant, LargeTensorsEqualHostOnEveryPath) {
  // 4096 x 8192 (32 Mi elements): 4 Mi units, so the unit path takes 4 per
  // thread step (4 Mi and up) and a grid-stride loop; raw random codes
  // (every e4m3 code, NaNs included: those units take the reference
  // decoding) and random scales (specials included); also at src +8 bytes
  // (units) and through the scalar path (src at +1 byte).
  std::mt19937_64 rng(fresh_seed() + 4);
  const int64_t rows = 4096, cols = 8192;
  for (lwo_quant_format_t f : kFormats)
    for (lwo_dtype_t dt : kOut) {
      lwo_quant_desc d = desc_of(f, rows, cols, dt);
      SCOPED_TRACE(std::string(lwo_quant_format_name(f)) + " 4096x8192 -> " + lwo_dtype_name(dt));
      lwo_quant_layout_info info;
      std::vector<uint8_t> q = make_quantized(d, true, rng, &info);
      std::vector<uint8_t> want = reference(d, q);
      ASSERT_EQ("", first_difference(on_device(d, q, 0, 0), want, lwo_dtype_size(dt)))
          << "aligned (unit path, 4 units per step)";
      ASSERT_EQ("", first_difference(on_device(d, q, 8, 0), want, lwo_dtype_size(dt)))
          << "src at +8 bytes (unit path)";
      if (dt == LWO_DTYPE_BF16) {
        ASSERT_EQ("", first_difference(on_device(d, q, 1, 2), want, 2))
            << "src at +1 byte (scalar path)";
      }
    }
}

TEST_F(Quant, OrderedAfterACopyOnTheSameStream) {
  // The copy waits behind a 200 ms spin on the same stream: a dequantization
  // that did not follow it would read the poison (zeros) instead.
  std::mt19937_64 rng(fresh_seed() + 1);
  for (lwo_quant_format_t f : kFormats) {
    const int64_t rows = 512, cols = 1024;
    lwo_quant_desc d = desc_of(f, rows, cols, LWO_DTYPE_BF16);
    SCOPED_TRACE(lwo_quant_format_name(f));
    lwo_quant_layout_info info;
    std::vector<uint8_t> q = make_quantized(d, false, rng, &info);
    std::vector<uint8_t> want = reference(d, q);
    testkit::PinnedMem host = testkit::pinned_alloc(q.size());
    std::memcpy(host.get(), q.data(), q.size());
    testkit::DeviceMem src = testkit::device_alloc(q.size(), "quantized");
    testkit::DeviceMem dst = testkit::device_alloc(want.size(), "dequantized");
    CUDA_OK(cudaMemset(src.get(), 0, q.size()));
    CUDA_OK(cudaMemset(dst.get(), 0xff, want.size()));
    cudaStream_t st = stream(0);
    CUDA_OK(lwo::kernels::spin_async(200000, st));
    CUDA_OK(cudaMemcpyAsync(src.get(), host.get(), q.size(), cudaMemcpyHostToDevice, st));
    CHECK_LWO(lwo_dequantize(engine_, &d, src.get(), dst.get(), st));
    std::vector<uint8_t> got(want.size());
    CUDA_OK(cudaMemcpyAsync(got.data(), dst.get(), got.size(), cudaMemcpyDeviceToHost, st));
    CUDA_OK(cudaStreamSynchronize(st));
    ASSERT_EQ("", first_difference(got, want, 2));
  }
}

TEST_F(Quant, FromARingSlot) {
  // A layer of one quantized tensor (u8 bytes of total_bytes) and a bf16
  // bias: the slot's tensor is dequantized after lwo_ring_acquire.
  std::mt19937_64 rng(fresh_seed() + 2);
  for (lwo_quant_format_t f : kFormats) {
    SCOPED_TRACE(lwo_quant_format_name(f));
    lwo_quant_desc d = desc_of(f, 384, 640, LWO_DTYPE_F16);
    lwo_quant_layout_info info;
    std::vector<uint8_t> q = make_quantized(d, false, rng, &info);
    std::vector<uint8_t> want = reference(d, q);
    lwo_tensor_desc t[2] = {};
    t[0] = tensor_desc("weight.q", LWO_DTYPE_U8, {static_cast<int64_t>(info.total_bytes)});
    t[1] = tensor_desc("bias", LWO_DTYPE_BF16, {384});
    lwo_layer_desc layer = {t, 2, nullptr};
    testkit::Pool pool;
    CHECK_LWO(lwo_pool_create_pinned(engine_, &layer, 1, nullptr, pool.out()));
    CHECK_LWO(lwo_pool_write(pool.get(), 0, "weight.q", q.data(), q.size()));
    Ring ring;
    CHECK_LWO(lwo_ring_create(pool.get(), nullptr, ring.out()));
    testkit::DeviceMem dst = testkit::device_alloc(want.size(), "dequantized");
    CUDA_OK(cudaMemset(dst.get(), 0xff, want.size()));
    cudaStream_t st = stream(0);
    lwo_ticket tk{0};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), 0, st, &tk, &v));
    CHECK_LWO(lwo_dequantize(engine_, &d, v.tensors[0], dst.get(), st));
    CHECK_LWO(lwo_ring_release(ring.get(), tk, st));
    std::vector<uint8_t> got(want.size());
    CUDA_OK(cudaMemcpyAsync(got.data(), dst.get(), got.size(), cudaMemcpyDeviceToHost, st));
    CUDA_OK(cudaStreamSynchronize(st));
    ASSERT_EQ("", first_difference(got, want, 2));
  }
}

TEST_F(Quant, ThroughputIsReported) {
  // Not a speed target (the quantized speed targets come with the GEMM
  // integration): the bytes read and written per second of each format into
  // bf16, for the record, on 8192 x 8192 (64 Mi weights, quantized from random bf16
  // weights: no NaN code, finite scales, as a model's), the best of 5 runs.
  std::mt19937_64 rng(fresh_seed() + 3);
  const int64_t rows = 8192, cols = 8192;
  for (lwo_quant_format_t f : kFormats) {
    lwo_quant_desc d = desc_of(f, rows, cols, LWO_DTYPE_BF16);
    lwo_quant_layout_info info;
    std::vector<uint8_t> q = make_quantized(d, false, rng, &info);
    const size_t out_bytes = static_cast<size_t>(rows * cols) * 2;
    testkit::DeviceMem src = testkit::device_alloc(q.size(), "quantized");
    testkit::DeviceMem dst = testkit::device_alloc(out_bytes, "dequantized");
    CUDA_OK(cudaMemcpy(src.get(), q.data(), q.size(), cudaMemcpyHostToDevice));
    cudaStream_t st = stream(0);
    Event a = testkit::make_event(), b = testkit::make_event();
    double best_ms = 1e30;
    for (int run = 0; run < 6; ++run) {  // the first warms up
      CUDA_OK(cudaEventRecord(a.get(), st));
      CHECK_LWO(lwo_dequantize(engine_, &d, src.get(), dst.get(), st));
      CUDA_OK(cudaEventRecord(b.get(), st));
      CUDA_OK(cudaEventSynchronize(b.get()));
      if (run) best_ms = std::min(best_ms, testkit::elapsed_ms(a, b));
    }
    const double gbs = static_cast<double>(q.size() + out_bytes) / (best_ms * 1e6);
    std::printf("quant_test: %s 8192x8192 -> bf16: %.3f ms, %.0f GB/s (read + write)\n",
                lwo_quant_format_name(f), best_ms, gbs);
    RecordProperty(std::string(lwo_quant_format_name(f)) + "_to_bf16_GBps", std::to_string(gbs));
    EXPECT_GT(gbs, 0.0);
  }
}

TEST_F(Quant, ArgumentsAreCheckedOnARealEngine) {
  lwo_quant_desc d = desc_of(LWO_QUANT_INT4_GROUP128, 4, 100, LWO_DTYPE_BF16);
  testkit::DeviceMem buf = testkit::device_alloc(4096, "buffer");
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_dequantize",
                 lwo_dequantize(engine_, &d, buf.get(), buf.get(), stream(0)));
  d.cols = 128;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_dequantize",
                 lwo_dequantize(engine_, &d, nullptr, buf.get(), stream(0)));
  EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_dequantize",
                 lwo_dequantize(nullptr, &d, buf.get(), buf.get(), stream(0)));
}

}  // namespace
}  // namespace lwo_test
