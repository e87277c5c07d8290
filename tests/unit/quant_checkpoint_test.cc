// Checkpoints already quantized: an F8_E4M3 [rows, cols]
// weight with its f32 "<weight>_scale_inv" [ceil(rows/128), ceil(cols/128)]
// beside it maps, in place, to one LWO_QUANT_FP8_E4M3_BLOCK128 record tensor
// (two copy runs from the file); on the recording backend, registered and
// staged, with the slot bytes checked against the file's and the host
// dequantization of the slot against the definition (code x block scale).
#include <cmath>
#include <cstring>

#include "checkpoint_files.h"
#include "src/quant/codec.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

std::string msg() { return lwo_last_error_message(); }

FileTensor f32_tensor(const std::string& name, std::vector<int64_t> shape, float lo, float hi,
                      uint64_t seed) {
  FileTensor t{name, "F32", shape, 4, {}};
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  t.bytes.resize(4 * n);
  for (size_t i = 0; i < n; ++i) {
    const float v = u(rng);
    std::memcpy(&t.bytes[4 * i], &v, 4);
  }
  return t;
}

// fp8 codes of random finite values (no NaN code 0x7f / 0xff).
FileTensor fp8_tensor(const std::string& name, int64_t rows, int64_t cols, uint64_t seed) {
  FileTensor t = make_tensor(name, "F8_E4M3", 1, {rows, cols}, seed);
  for (uint8_t& b : t.bytes)
    if ((b & 0x7f) == 0x7f) b ^= 1;
  return t;
}

class QuantCheckpoint : public EngineTest {
 protected:
  void SetUp() override {
    EngineTest::SetUp();
    ASSERT_FALSE(tmp.dir().empty());
  }
  // Layer i: "layers.<i>.norm" bf16 [cols], "layers.<i>.proj.weight" fp8
  // [rows, cols] and its "layers.<i>.proj.weight_scale_inv"; the scales
  // written before or after the weight.
  std::vector<FileTensor> model(uint32_t L, int64_t rows, int64_t cols, uint64_t seed) {
    std::vector<FileTensor> ts;
    for (uint32_t i = 0; i < L; ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      ts.push_back(make_tensor(p + "norm", "BF16", 2, {cols}, seed + 3 * i));
      FileTensor w = fp8_tensor(p + "proj.weight", rows, cols, seed + 3 * i + 1);
      FileTensor s = f32_tensor(p + "proj.weight_scale_inv", {(rows + 127) / 128, (cols + 127) / 128},
                                1e-3f, 2e-2f, seed + 3 * i + 2);
      if (i % 2) {
        ts.push_back(s);
        ts.push_back(w);
      } else {
        ts.push_back(w);
        ts.push_back(s);
      }
    }
    return ts;
  }
  lwo_checkpoint* open(const std::vector<FileTensor>& ts, const char* name) {
    const std::string path = tmp.file(name);
    write_safetensors(path, ts);
    lwo_checkpoint* ck = nullptr;
    EXPECT_EQ(lwo_checkpoint_open(path.c_str(), &ck), LWO_OK) << msg();
    return ck;
  }
  TempFiles tmp;
};

const FileTensor& find(const std::vector<FileTensor>& ts, const std::string& name) {
  for (const FileTensor& t : ts)
    if (t.name == name) return t;
  ADD_FAILURE() << "no " << name;
  return ts[0];
}

TEST_F(QuantCheckpoint, Fp8WeightAndScalesAreOneQuantizedTensor) {
  const uint32_t L = 3;
  const int64_t rows = 200, cols = 300;  // partial edge blocks both ways
  const auto ts = model(L, rows, cols, 40);
  lwo_checkpoint* ck = open(ts, "fp8.safetensors");
  ASSERT_NE(ck, nullptr);
  lwo_quant_desc qd = LWO_QUANT_DESC_INIT;
  qd.format = LWO_QUANT_FP8_E4M3_BLOCK128;
  qd.rows = rows;
  qd.cols = cols;
  lwo_quant_layout_info ql = LWO_QUANT_LAYOUT_INFO_INIT;
  ASSERT_LWO(lwo_quant_layout(&qd, &ql));
  // The checkpoint's own tensor info pairs each weight with its scales.
  uint32_t n_tensors = 0;
  ASSERT_LWO(lwo_checkpoint_tensor_count(ck, &n_tensors));
  ASSERT_EQ(n_tensors, 3 * L);
  uint32_t n_pairs = 0;
  for (uint32_t i = 0; i < n_tensors; ++i) {
    lwo_checkpoint_tensor ct = LWO_CHECKPOINT_TENSOR_INIT;
    ASSERT_LWO(lwo_checkpoint_tensor_info(ck, i, &ct));
    const std::string name = ct.name;
    if (name.find("proj.weight_scale_inv") != std::string::npos) {
      EXPECT_EQ(ct.quant_format, LWO_QUANT_NONE) << name;
      ASSERT_NE(ct.quant_partner, LWO_NO_LAYER) << name;
      lwo_checkpoint_tensor w = LWO_CHECKPOINT_TENSOR_INIT;
      ASSERT_LWO(lwo_checkpoint_tensor_info(ck, ct.quant_partner, &w));
      EXPECT_EQ(name, std::string(w.name) + "_scale_inv");
      EXPECT_EQ(w.quant_partner, i);
    } else if (name.find("proj.weight") != std::string::npos) {
      EXPECT_EQ(ct.quant_format, LWO_QUANT_FP8_E4M3_BLOCK128) << name;
      ++n_pairs;
    } else {
      EXPECT_EQ(ct.quant_format, LWO_QUANT_NONE) << name;
      EXPECT_EQ(ct.quant_partner, LWO_NO_LAYER) << name;
    }
  }
  EXPECT_EQ(n_pairs, L);
  for (uint32_t flags : {0u, static_cast<uint32_t>(LWO_CHECKPOINT_STAGED)}) {
    SCOPED_TRACE(flags ? "staged" : "registered");
    lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
    cfg.pattern = "layers.{i}.";
    cfg.flags = flags;
    lwo_pool* pool = nullptr;
    ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
    lwo_ring* ring = make_ring(pool, 2);
    StreamH c = gpu->new_stream();
    for (uint32_t l = 0; l < L; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      uint32_t n = 0;
      ASSERT_LWO(lwo_pool_layer_tensor_count(pool, l, &n));
      ASSERT_EQ(n, 2u);  // the scales are inside the weight's tensor
      uint32_t wi = 0;
      ASSERT_LWO(lwo_pool_find_tensor(pool, l, "proj.weight", &wi));
      lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
      ASSERT_LWO(lwo_pool_tensor_info(pool, l, wi, &ti));
      EXPECT_EQ(ti.quant_format, LWO_QUANT_FP8_E4M3_BLOCK128);
      EXPECT_EQ(ti.dtype, LWO_DTYPE_BF16);
      ASSERT_EQ(ti.n_dims, 2);
      EXPECT_EQ(ti.shape[0], rows);
      EXPECT_EQ(ti.shape[1], cols);
      EXPECT_EQ(ti.bytes, ql.total_bytes);
      EXPECT_EQ(lwo_pool_find_tensor(pool, l, "proj.weight_scale_inv", &wi), LWO_ERR_NOT_FOUND);
      void* h = nullptr;
      uint64_t hb = 0;
      EXPECT_EQ(lwo_pool_tensor_host(pool, l, "proj.weight", &h, &hb), LWO_ERR_UNSUPPORTED);
      EXPECT_NE(msg().find("lie apart"), std::string::npos) << msg();
      ASSERT_LWO(lwo_pool_tensor_host(pool, l, "norm", &h, &hb));

      const uint64_t copies = gpu->stats.copies;
      lwo_ticket t{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_LWO(lwo_ring_stage(ring, l, &t));
      // Direct: three runs (norm, codes, scales); staged: one packed copy.
      EXPECT_EQ(gpu->stats.copies - copies, flags ? 1u : 3u);
      ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
      void* w = nullptr;
      ASSERT_LWO(lwo_ring_tensor(ring, t, "proj.weight", &w));
      const FileTensor& fw = find(ts, p + "proj.weight");
      const FileTensor& fs = find(ts, p + "proj.weight_scale_inv");
      const auto* slot = static_cast<const uint8_t*>(w);
      EXPECT_EQ(std::memcmp(slot, fw.bytes.data(), fw.bytes.size()), 0) << "codes, layer " << l;
      EXPECT_EQ(std::memcmp(slot + ql.scale_offset, fs.bytes.data(), fs.bytes.size()), 0)
          << "scales, layer " << l;
      // The slot dequantizes to code x its block's scale.
      std::vector<float> deq(static_cast<size_t>(rows * cols));
      qd.dtype = LWO_DTYPE_F32;
      ASSERT_LWO(lwo_dequantize_host(&qd, slot, ql.total_bytes, deq.data(), deq.size() * 4, 1));
      qd.dtype = LWO_DTYPE_BF16;
      for (int64_t r = 0; r < rows; r += 37)
        for (int64_t k = 0; k < cols; k += 29) {
          float scale = 0;
          std::memcpy(&scale, &fs.bytes[4 * static_cast<size_t>((r / 128) * ((cols + 127) / 128) + k / 128)], 4);
          const float want = quant::e4m3_to_f32(fw.bytes[static_cast<size_t>(r * cols + k)]) * scale;
          ASSERT_EQ(deq[static_cast<size_t>(r * cols + k)], want) << r << ", " << k;
        }
      gpu->read(c, v.base, v.record_bytes);
      ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
    }
    EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
    ASSERT_LWO(lwo_ring_destroy(ring));
    // fp8 block-128 weights have gradients (dense, bf16: rows x cols), but a
    // checkpoint's mapped files are read-only: no optimizer writes them.
    lwo_grads* g = nullptr;
    ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
    lwo_grad_tensor gt = LWO_GRAD_TENSOR_INIT;
    ASSERT_LWO(lwo_grads_tensor(g, 0, "proj.weight", &gt));
    EXPECT_EQ(gt.dtype, LWO_DTYPE_BF16);
    EXPECT_EQ(gt.n_elements, static_cast<uint64_t>(rows * cols));
    lwo_optim* o = nullptr;
    EXPECT_EQ(lwo_optim_create(g, nullptr, &o), LWO_ERR_UNSUPPORTED);
    EXPECT_NE(msg().find("read-only"), std::string::npos) << msg();
    ASSERT_LWO(lwo_grads_destroy(g));
    ASSERT_LWO(lwo_pool_destroy(pool));
  }
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

TEST_F(QuantCheckpoint, AnFp8TensorWithoutScalesStaysBytes) {
  std::vector<FileTensor> ts = {fp8_tensor("layers.0.w", 16, 32, 1),
                                make_tensor("layers.0.b", "F32", 4, {16}, 2)};
  lwo_checkpoint* ck = open(ts, "plain.safetensors");
  ASSERT_NE(ck, nullptr);
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "layers.{i}.";
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  lwo_checkpoint_tensor ct = LWO_CHECKPOINT_TENSOR_INIT;
  ASSERT_LWO(lwo_checkpoint_tensor_info(ck, 0, &ct));
  EXPECT_EQ(ct.quant_format, LWO_QUANT_NONE);
  EXPECT_EQ(ct.quant_partner, LWO_NO_LAYER);
  lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 0, 0, &ti));
  EXPECT_EQ(ti.dtype, LWO_DTYPE_F8_E4M3);
  EXPECT_EQ(ti.quant_format, LWO_QUANT_NONE);
  EXPECT_EQ(ti.bytes, 16u * 32u);
  void* p = nullptr;
  uint64_t b = 0;
  ASSERT_LWO(lwo_pool_layer_host(pool, 0, &p, &b));  // the file's layout: one copy
  destroy(pool, ck);
}

TEST_F(QuantCheckpoint, BadScalesAreRefusedNamingBothTensors) {
  struct Case {
    const char* what;
    std::vector<FileTensor> ts;
    lwo_status_t want;
    const char* part;
  };
  std::vector<Case> cases;
  cases.push_back({"scale shape",
                   {fp8_tensor("layers.0.w", 200, 300, 1),
                    f32_tensor("layers.0.w_scale_inv", {2, 2}, 0.1f, 1.f, 2)},
                   LWO_ERR_SHAPE_MISMATCH, "must be [2, 3]"});
  cases.push_back({"scale dtype",
                   {fp8_tensor("layers.0.w", 200, 300, 1),
                    make_tensor("layers.0.w_scale_inv", "BF16", 2, {2, 3}, 2)},
                   LWO_ERR_BAD_DTYPE, "(must be F32)"});
  {
    FileTensor w3 = make_tensor("layers.0.w", "F8_E4M3", 1, {4, 4, 4}, 1);
    cases.push_back({"3-D weight",
                     {w3, f32_tensor("layers.0.w_scale_inv", {1, 1}, 0.1f, 1.f, 2)},
                     LWO_ERR_SHAPE_MISMATCH, "3 dimensions"});
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].what);
    lwo_checkpoint* ck = open(cases[i].ts, ("bad" + std::to_string(i) + ".safetensors").c_str());
    ASSERT_NE(ck, nullptr);
    lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
    cfg.pattern = "layers.{i}.";
    lwo_pool* pool = nullptr;
    EXPECT_STREQ(lwo_status_string(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool)),
                 lwo_status_string(cases[i].want));
    const std::string m = msg();
    EXPECT_EQ(m.rfind("lwo_pool_create_from_checkpoint", 0), 0u) << m;
    EXPECT_NE(m.find(cases[i].part), std::string::npos) << m;
    EXPECT_NE(m.find("'layers.0.w'"), std::string::npos) << m;
    EXPECT_NE(m.find("'layers.0.w_scale_inv'"), std::string::npos) << m;
    EXPECT_EQ(pool, nullptr);
    EXPECT_EQ(gpu->n_registered(), 0u);
    ASSERT_LWO(lwo_checkpoint_destroy(ck));
  }
}

}  // namespace
}  // namespace testing
}  // namespace lwo
