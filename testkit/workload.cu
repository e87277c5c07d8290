#include <algorithm>
#include <cmath>
#include <cstring>

#include "testkit/dtype.h"
#include "testkit/workload.h"

namespace testkit {
namespace {

uint64_t align(uint64_t v) { return (v + LWO_RECORD_ALIGN - 1) / LWO_RECORD_ALIGN * LWO_RECORD_ALIGN; }

bool is_float(lwo_dtype_t d) {
  return d == LWO_DTYPE_BF16 || d == LWO_DTYPE_F16 || d == LWO_DTYPE_F32;
}

// Index of op j's weight (or bias) among its record's tensors.
uint32_t tensor_index(bool with_bias, uint32_t j, bool bias) {
  return with_bias ? 2 * j + (bias ? 1 : 0) : j;
}

}  // namespace

// --- the spec -------------------------------------------------------------------------

uint64_t ChainSpec::weight_elems(uint32_t i) const {
  return static_cast<uint64_t>(ops[i].first) * static_cast<uint64_t>(ops[i].second) *
         (kind == OpKind::kConv3x3 ? 9 : 1);
}

uint64_t ChainSpec::fan_in(uint32_t i) const {
  return static_cast<uint64_t>(ops[i].first) * (kind == OpKind::kConv3x3 ? 9 : 1);
}

float ChainSpec::weight_bound(uint32_t i) const {
  return std::sqrt(3.0f / static_cast<float>(fan_in(i)));
}

float ChainSpec::bias_bound(uint32_t i) const {
  return 1.0f / std::sqrt(static_cast<float>(fan_in(i)));
}

void ChainSpec::group(uint32_t per_record) {
  records.clear();
  for (uint32_t i = 0; i < n_ops(); i += per_record) {
    std::vector<uint32_t> r;
    for (uint32_t k = i; k < std::min(n_ops(), i + per_record); ++k) r.push_back(k);
    records.push_back(r);
  }
}

uint64_t quant_bytes(lwo_quant_format_t format, lwo_dtype_t dtype, int64_t rows, int64_t cols) {
  lwo_quant_desc d = LWO_QUANT_DESC_INIT;
  d.format = format;
  d.dtype = dtype;
  d.rows = rows;
  d.cols = cols;
  lwo_quant_layout_info l = LWO_QUANT_LAYOUT_INFO_INIT;
  return lwo_quant_layout(&d, &l) == LWO_OK ? l.total_bytes : 0;
}

ChainSpec linear_chain(std::string name, int64_t dim, uint32_t n, uint32_t per_record) {
  ChainSpec s;
  s.name = std::move(name);
  s.ops.assign(n, {dim, dim});
  s.group(per_record);
  return s;
}

ChainSpec m144_chain(bool block_records) {
  ChainSpec s;
  s.name = block_records ? "m144/block_records" : "m144/linear_records";
  for (int b = 0; b < 24; ++b) {
    for (int k = 0; k < 4; ++k) s.ops.push_back({2048, 2048});
    s.ops.push_back({2048, 8192});
    s.ops.push_back({8192, 2048});
  }
  s.group(block_records ? 6 : 1);
  return s;
}

// --- the weights ------------------------------------------------------------------------

ChainWeights::ChainWeights(lwo_engine* engine, ChainSpec spec, bool fill_now)
    : spec_(std::move(spec)), engine_(engine) {
  const ChainSpec& s = spec_;
  const uint32_t R = s.n_records();
  if (s.ops.empty() || R == 0) fail("testkit::ChainWeights: a chain needs ops and records");
  if (!is_float(s.dtype))
    fail(strf("testkit::ChainWeights: dtype %s (bf16, f16 or f32)", lwo_dtype_name(s.dtype)));
  uint32_t next = 0;
  for (const auto& rec : s.records) {
    if (rec.empty()) fail("testkit::ChainWeights: an empty record");
    for (uint32_t i : rec)
      if (i != next++) fail("testkit::ChainWeights: records must hold consecutive ops in order");
  }
  if (next != s.n_ops()) fail("testkit::ChainWeights: the records do not hold every op");
  for (uint32_t i = 1; i < s.n_ops(); ++i)
    if (s.ops[i].first != s.ops[i - 1].second)
      fail(strf("testkit::ChainWeights: op %u takes %lld, op %u gives %lld", i,
                static_cast<long long>(s.ops[i].first), i - 1,
                static_cast<long long>(s.ops[i - 1].second)));

  if (s.quant != LWO_QUANT_NONE && s.kind != OpKind::kLinear)
    fail("testkit::ChainWeights: quantized weights are for linear chains");
  lwo_tensor_quant_ext qx = quant_ext(s.quant);
  names_.resize(R);
  std::vector<std::vector<lwo_tensor_desc>> tensors(R);
  std::vector<lwo_layer_desc> layers(R);
  for (uint32_t r = 0; r < R; ++r) {
    const auto& rec = s.records[r];
    for (uint32_t j = 0; j < rec.size(); ++j) {
      names_[r].push_back(rec.size() == 1 ? "weight" : strf("w%u", j));
      names_[r].push_back(rec.size() == 1 ? "bias" : strf("b%u", j));
    }
    for (uint32_t j = 0; j < rec.size(); ++j) {
      const auto& op = s.ops[rec[j]];
      lwo_tensor_desc t{};
      t.name = names_[r][2 * j].c_str();
      t.dtype = s.dtype;
      if (s.kind == OpKind::kLinear) {
        t.n_dims = 2;  // [out, in]
        t.shape[0] = op.second;
        t.shape[1] = op.first;
        if (s.quant != LWO_QUANT_NONE) t.next = &qx;
      } else {
        t.n_dims = 4;  // NHWC filters: [k, kh, kw, c]
        t.shape[0] = op.second;
        t.shape[1] = 3;
        t.shape[2] = 3;
        t.shape[3] = op.first;
      }
      tensors[r].push_back(t);
      if (s.bias) {
        lwo_tensor_desc b{};
        b.name = names_[r][2 * j + 1].c_str();
        b.dtype = s.dtype;
        b.n_dims = 1;
        b.shape[0] = op.second;
        tensors[r].push_back(b);
      }
    }
    layers[r] = lwo_layer_desc{tensors[r].data(), static_cast<uint32_t>(tensors[r].size()), nullptr};
  }
  const double t0 = now_seconds();
  check(lwo_pool_create_pinned(engine_, layers.data(), R, nullptr, pool_.out()),
        "lwo_pool_create_pinned");
  pool_s_ = now_seconds() - t0;

  const uint64_t es = lwo_dtype_size(s.dtype);
  record_bytes_.resize(R);
  tensor_off_.resize(R);
  for (uint32_t r = 0; r < R; ++r) {
    check(lwo_pool_record_bytes(pool_.get(), r, &record_bytes_[r]), "lwo_pool_record_bytes");
    pool_bytes_ += record_bytes_[r];
    const auto& rec = s.records[r];
    tensor_off_[r].assign(2 * rec.size(), 0);
    for (uint32_t j = 0; j < rec.size(); ++j) {
      const uint32_t i = rec[j];
      for (int k = 0; k < (s.bias ? 2 : 1); ++k) {
        lwo_tensor_info info = LWO_TENSOR_INFO_INIT;
        check(lwo_pool_tensor_info(pool_.get(), r, tensor_index(s.bias, j, k == 1), &info),
              "lwo_pool_tensor_info");
        tensor_off_[r][2 * j + k] = info.offset;
        void* p = nullptr;
        uint64_t bytes = 0;
        check(lwo_pool_tensor_host(pool_.get(), r, names_[r][2 * j + k].c_str(), &p, &bytes),
              "lwo_pool_tensor_host");
        const float bound = k == 0 ? s.weight_bound(i) : s.bias_bound(i);
        if (k == 0 && s.quant != LWO_QUANT_NONE) {
          quant_fill_.push_back({r, names_[r][2 * j],
                                 {nullptr, s.dtype, s.weight_elems(i), bound,
                                  key_of(s.seed, 2 * uint64_t(i) + k)}});
          continue;
        }
        fill_.push_back({p, s.dtype, bytes / es, bound, key_of(s.seed, 2 * uint64_t(i) + k)});
      }
    }
  }
  if (fill_now) fill();
}

void ChainWeights::fill(const Progress& progress) {
  const double t0 = now_seconds();
  fill_uniform(fill_, 0, progress);
  // Quantized weights: the same uniform values, quantized on load.
  std::vector<uint8_t> buf;
  for (const QuantFill& q : quant_fill_) {
    const uint64_t bytes = q.values.n * lwo_dtype_size(q.values.dtype);
    buf.resize(bytes);
    UniformRange v = q.values;
    v.data = buf.data();
    fill_uniform({v});
    check(lwo_pool_write_quantized(pool_.get(), q.record, q.name.c_str(), buf.data(),
                                   q.values.dtype, bytes, 0),
          "lwo_pool_write_quantized");
  }
  fill_s_ = now_seconds() - t0;
}

uint64_t ChainWeights::fill_bytes() const {
  uint64_t bytes = 0;
  for (const UniformRange& r : fill_) bytes += r.n * lwo_dtype_size(r.dtype);
  return bytes;
}

ChainWeights::~ChainWeights() {
  resident_.clear();
  pool_.reset();
}

std::vector<HostRange> ChainWeights::record_hosts() const {
  std::vector<HostRange> out(n_records());
  for (uint32_t r = 0; r < n_records(); ++r)
    check(lwo_pool_layer_host(pool_.get(), r, &out[r].data, &out[r].bytes), "lwo_pool_layer_host");
  return out;
}

void ChainWeights::make_resident(bool allow_partial, uint64_t margin_bytes) {
  const uint32_t R = n_records();
  resident_.clear();
  resident_.resize(R);
  all_resident_ = true;
  resident_note_.clear();
  if (!allow_partial) {
    for (uint32_t r = 0; r < R; ++r) resident_[r] = device_alloc(record_bytes_[r]);
  } else {
    resident_[0] = device_alloc(record_bytes_[0]);
    if (R > 1) resident_[R - 1] = device_alloc(record_bytes_[R - 1]);
    size_t free_b = 0, total_b = 0;
    check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    uint64_t rest = 0;
    for (uint32_t r = 1; r + 1 < R; ++r) rest += record_bytes_[r];
    if (R > 2 && rest + margin_bytes > free_b) {  // with 2 records or 1, all are resident
      all_resident_ = false;
      resident_note_ = strf("the other %u records (%s) do not fit in the %s of device memory left",
                            R - 2, fmt_bytes(rest).c_str(), fmt_bytes(free_b).c_str());
    }
    for (uint32_t r = 1; all_resident_ && r + 1 < R; ++r) {
      cudaError_t e = cudaMalloc(resident_[r].out(), record_bytes_[r]);
      if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        all_resident_ = false;
        resident_note_ = strf("cudaMalloc of the record of layer %u failed: out of memory", r);
        for (uint32_t k = 1; k < r; ++k) resident_[k].destroy();
        break;
      }
      check(e, "cudaMalloc (resident record)");
    }
  }
  const double t0 = now_seconds();
  const std::vector<HostRange> hosts = record_hosts();
  for (uint32_t r = 0; r < R; ++r)
    if (resident_[r].get())
      check(cudaMemcpy(resident_[r].get(), hosts[r].data, record_bytes_[r], cudaMemcpyHostToDevice),
            "cudaMemcpy (resident record)");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  resident_s_ = now_seconds() - t0;
}

const void* ChainWeights::resident_weight(uint32_t r, uint32_t j) const {
  if (!resident(r)) fail(strf("testkit::ChainWeights: record %u is not resident", r));
  return static_cast<const uint8_t*>(resident_[r].get()) + tensor_off_[r][2 * j];
}

const void* ChainWeights::resident_bias(uint32_t r, uint32_t j) const {
  if (!spec_.bias) return nullptr;
  if (!resident(r)) fail(strf("testkit::ChainWeights: record %u is not resident", r));
  return static_cast<const uint8_t*>(resident_[r].get()) + tensor_off_[r][2 * j + 1];
}

uint64_t ChainWeights::grad_offset(uint32_t r, uint32_t j, bool bias, lwo_dtype_t wire) const {
  const uint64_t es = lwo_dtype_size(wire);
  uint64_t off = 0;
  const auto& rec = spec_.records[r];
  for (uint32_t k = 0; k <= j && k < rec.size(); ++k) {
    if (k == j && !bias) return off;
    off += align(spec_.weight_elems(rec[k]) * es);
    if (k == j) return off;
    if (spec_.bias) off += align(static_cast<uint64_t>(spec_.ops[rec[k]].second) * es);
  }
  return off;
}

uint64_t ChainWeights::grad_bytes(uint32_t r, lwo_dtype_t wire) const {
  const auto& rec = spec_.records[r];
  const uint32_t last = static_cast<uint32_t>(rec.size()) - 1;
  const uint64_t es = lwo_dtype_size(wire);
  return spec_.bias ? grad_offset(r, last, true, wire) +
                          align(static_cast<uint64_t>(spec_.ops[rec[last]].second) * es)
                    : grad_offset(r, last, false, wire) + align(spec_.weight_elems(rec[last]) * es);
}

// --- the bound ------------------------------------------------------------------------------

Bound bound_of(const std::vector<BoundTerm>& terms) {
  Bound b;
  for (const BoundTerm& t : terms) b.terms_ms.push_back(t.ms);
  for (size_t i = 0; i < terms.size(); ++i)
    if (terms[i].ms > b.ms) {
      b.ms = terms[i].ms;
      b.name = terms[i].name;
      b.index = i;
    }
  return b;
}

Bound step_bound(double resident_ms, double h2d_bytes, double h2d_gbps, double d2h_bytes,
                 double d2h_gbps) {
  return bound_of({{"resident compute", resident_ms},
                   {"H2D", ms_at(h2d_bytes, h2d_gbps)},
                   {"D2H", ms_at(d2h_bytes, d2h_gbps)}});
}

double duplex_ms(double h2d_bytes, double d2h_bytes, const LinkRates& k) {
  // One direction only (a frozen backward moves weights alone): its one-way rate.
  if (d2h_bytes <= 0) return ms_at(h2d_bytes, k.h2d_gbps > 0 ? k.h2d_gbps : k.duplex_h2d_gbps);
  if (h2d_bytes <= 0) return ms_at(d2h_bytes, k.d2h_gbps > 0 ? k.d2h_gbps : k.duplex_d2h_gbps);
  if (k.duplex_h2d_gbps <= 0 || k.duplex_d2h_gbps <= 0) return 0;
  const double th = ms_at(h2d_bytes, k.duplex_h2d_gbps), td = ms_at(d2h_bytes, k.duplex_d2h_gbps);
  // Both at their duplex rates until the first finishes; the other's rest
  // alone (at its one-way rate, where measured).
  if (th <= td) {
    const double left = d2h_bytes - h2d_bytes / k.duplex_h2d_gbps * k.duplex_d2h_gbps;
    return th + ms_at(std::max(0.0, left), k.d2h_gbps > 0 ? k.d2h_gbps : k.duplex_d2h_gbps);
  }
  const double left = h2d_bytes - d2h_bytes / k.duplex_d2h_gbps * k.duplex_h2d_gbps;
  return td + ms_at(std::max(0.0, left), k.h2d_gbps > 0 ? k.h2d_gbps : k.duplex_h2d_gbps);
}

SplitFloor split_floor(double fwd_compute_ms, double bwd_compute_ms, double h2d_fwd_bytes,
                       double h2d_bwd_bytes, double d2h_bytes, uint32_t passes,
                       const LinkRates& rates) {
  const double p = std::max<uint32_t>(passes, 1);
  SplitFloor f;
  f.fwd_compute_ms = fwd_compute_ms / p;
  f.fwd_h2d_ms = ms_at(h2d_fwd_bytes / p, rates.h2d_gbps);
  f.bwd_compute_ms = bwd_compute_ms / p;
  f.bwd_link_ms = duplex_ms(h2d_bwd_bytes / p, d2h_bytes / p, rates);
  f.fwd_ms = std::max(f.fwd_compute_ms, f.fwd_h2d_ms);
  f.bwd_ms = std::max(f.bwd_compute_ms, f.bwd_link_ms);
  f.fwd_binding = f.fwd_compute_ms >= f.fwd_h2d_ms ? "compute" : "H2D";
  f.bwd_binding = f.bwd_compute_ms >= f.bwd_link_ms ? "compute" : "link";
  f.ms = p * (f.fwd_ms + f.bwd_ms);
  return f;
}

// --- the step's driver ---------------------------------------------------------------------

std::vector<uint32_t> step_order(uint32_t n_records, bool backward) {
  std::vector<uint32_t> order(backward ? 2 * size_t(n_records) : n_records);
  for (uint32_t r = 0; r < n_records; ++r) {
    order[r] = r;
    if (backward) order[2 * size_t(n_records) - 1 - r] = r;
  }
  return order;
}

StepStats run_step(lwo_schedule* schedule, lwo_ring* ring, lwo_grads* grads, cudaStream_t stream,
                   uint32_t n_records, const StepOptions& o, const StepCalls& calls) {
  const uint32_t R = n_records, n = o.backward ? 2 * R : R;
  const uint32_t passes = std::max<uint32_t>(o.passes, 1);
  StepStats st;
  st.passes = passes;
  if (grads && o.zero_grads) check(lwo_grads_zero(grads), "lwo_grads_zero");
  const lwo_ring_stats r0 = ring_stats(ring);
  const lwo_grads_stats g0 = grads_stats(grads);
  uint64_t fwd_bytes = 0;
  // The edges: per pass, events at its start, once its first record is in
  // its slot, after its last forward compute, once its first backward record
  // is in its slot; after the last compute of the step.
  std::vector<Event> ev;
  if (o.edges)
    for (uint32_t i = 0; i < 4 * passes + 1; ++i) ev.push_back(make_event());
  auto mark = [&](uint32_t i) {
    if (o.edges) check(cudaEventRecord(ev[i].get(), stream), "cudaEventRecord");
  };
  // The stalls: per pass, an event at its start, then per position one once
  // its record (and gradient slot) is ready and one after its calls.
  std::vector<Event> sev;
  if (o.stalls)
    for (uint32_t i = 0; i < passes * (2 * n + 1); ++i) sev.push_back(make_event());
  auto smark = [&](uint32_t p, uint32_t i) {  // i: 0 the start, 1 + 2k ready, 2 + 2k done
    if (o.stalls) check(cudaEventRecord(sev[p * (2 * n + 1) + i].get(), stream), "cudaEventRecord");
  };
  if (o.before_start) o.before_start();
  const double t0 = now_seconds();
  for (uint32_t p = 0; p < passes; ++p) {
    const lwo_ring_stats rp = o.half_stats ? ring_stats(ring) : lwo_ring_stats{};
    if (calls.begin_pass) calls.begin_pass(p);
    mark(4 * p);
    smark(p, 0);
    check(lwo_schedule_reset(schedule, stream), "lwo_schedule_reset");
    lwo_layer_view view = LWO_LAYER_VIEW_INIT;
    for (uint32_t i = 0; i < n; ++i) {
      lwo_status_t s = lwo_schedule_next(schedule, stream, &view);
      if (s == LWO_END) fail(strf("the schedule ended after %u of its %u layers", i, n));
      check(s, "lwo_schedule_next");
      const uint32_t r = i < R ? i : 2 * R - 1 - i;
      if (view.layer != r)
        fail(strf("lwo_schedule_next returned layer %u at position %u; expected layer %u",
                  view.layer, i, r));
      if (i == 0) mark(4 * p + 1);
      if (i == R) mark(4 * p + 3);
      if (i < R) {
        smark(p, 1 + 2 * i);
        calls.forward(r, view);
        smark(p, 2 + 2 * i);
        if (i + 1 == R) {
          mark(4 * p + 2);
          if (o.half_stats) fwd_bytes += ring_stats(ring).bytes_copied - rp.bytes_copied;
        }
        continue;
      }
      if (!grads) {
        smark(p, 1 + 2 * i);
        calls.backward(r, view, nullptr, [] {});
        smark(p, 2 + 2 * i);
        continue;
      }
      lwo_layer_view g = LWO_LAYER_VIEW_INIT;
      check(lwo_grads_begin(grads, r, stream, &g), "lwo_grads_begin");
      smark(p, 1 + 2 * i);
      // One reference captured: the std::function holds it without an allocation.
      const struct {
        lwo_grads* grads;
        uint32_t r;
        cudaStream_t stream;
      } end{grads, r, stream};
      calls.backward(r, view, &g, [&end] {
        check(lwo_grads_end(end.grads, end.r, end.stream), "lwo_grads_end");
      });
      smark(p, 2 + 2 * i);
    }
    lwo_status_t s = lwo_schedule_next(schedule, stream, &view);
    if (s != LWO_END) {
      check(s, "lwo_schedule_next");
      fail(strf("the schedule did not end after its %u layers", n));
    }
  }
  if (o.after_enqueue) o.after_enqueue();
  mark(4 * passes);
  double last_compute_s = 0;
  if (o.edges) {
    check(cudaEventSynchronize(ev[4 * passes].get()), "cudaEventSynchronize");
    last_compute_s = now_seconds();
  }
  // The step ends when every gradient has landed and the last dx is done.
  if (grads) check(lwo_grads_wait(grads), "lwo_grads_wait");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  const double t1 = now_seconds();
  st.ms = (t1 - t0) * 1e3;
  if (o.check_engine) check(lwo_engine_check(o.check_engine), "lwo_engine_check");
  if (o.edges) {
    for (uint32_t p = 0; p < passes; ++p) {
      st.start_ms += elapsed_ms(ev[4 * p], ev[4 * p + 1]);
      if (o.backward) st.turn_ms += elapsed_ms(ev[4 * p + 2], ev[4 * p + 3]);
    }
    st.end_ms = (t1 - last_compute_s) * 1e3;
  }
  if (o.stalls) {
    st.stall_ms.assign(n, 0.0);
    for (uint32_t p = 0; p < passes; ++p) {
      const Event* e = &sev[p * (2 * n + 1)];
      for (uint32_t i = 0; i < n; ++i)
        st.stall_ms[i] += elapsed_ms(e[i == 0 ? 0 : 2 * i], e[1 + 2 * i]);
    }
  }
  const lwo_ring_stats r1 = ring_stats(ring);
  const lwo_grads_stats g1 = grads_stats(grads);
  st.h2d_bytes = r1.bytes_copied - r0.bytes_copied;
  st.h2d_fwd_bytes = o.half_stats ? fwd_bytes : 0;
  st.copies = r1.n_copies - r0.n_copies;
  st.hits = r1.n_hits - r0.n_hits;
  st.stages = r1.n_stages - r0.n_stages;
  st.copy_ms = r1.copy_ms - r0.copy_ms;
  st.wait_ms = r1.wait_ms - r0.wait_ms;
  st.d2h_bytes = g1.bytes - g0.bytes;
  st.d2h_transfers = g1.n_transfers - g0.n_transfers;
  st.accumulated_bytes = g1.accumulated_bytes - g0.accumulated_bytes;
  st.accumulate_ns = g1.accumulate_ns - g0.accumulate_ns;
  return st;
}

// --- the chain on the device --------------------------------------------------------------

const char* micro_order_name(MicroOrder order) {
  return order == MicroOrder::kLayer ? "layer" : "batch";
}

ChainRun::ChainRun(const ChainWeights& weights, int64_t rows, cudaStream_t stream, bool trainable,
                   lwo_dtype_t wire, uint32_t micro_batches, MicroOrder order)
    : weights_(weights),
      spec_(weights.spec()),
      rows_(rows),
      stream_(stream),
      trainable_(trainable),
      wire_(wire),
      micro_(micro_batches),
      order_(order) {
  if (wire != LWO_DTYPE_F32 && wire != spec_.dtype)
    fail("testkit::ChainRun: gradients in f32 or the chain's dtype");
  if (micro_ < 1) fail("testkit::ChainRun: at least one micro-batch");
  const uint32_t N = spec_.n_ops();
  int64_t widest = 0;
  act_.push_back(device_alloc(micro_ * act_bytes(spec_.ops[0].first)));
  for (uint32_t i = 0; i < N; ++i) {
    const auto& op = spec_.ops[i];
    act_.push_back(device_alloc(micro_ * act_bytes(op.second)));
    widest = std::max({widest, op.first, op.second});
    lwo_linear_desc l = LWO_LINEAR_DESC_INIT;
    l.dtype = spec_.dtype;
    l.flags = spec_.bias ? LWO_LINEAR_BIAS : 0u;
    l.in_features = op.first;
    l.out_features = op.second;
    l.weight_format = spec_.quant;
    lin_.push_back(l);
    l.flags |= LWO_LINEAR_ACCUMULATE;
    lin_acc_.push_back(l);
    lwo_conv2d_desc c = LWO_CONV2D_DESC_INIT;
    c.dtype = spec_.dtype;
    c.flags = spec_.bias ? LWO_CONV_BIAS : 0u;
    c.in_channels = static_cast<int32_t>(op.first);
    c.out_channels = static_cast<int32_t>(op.second);
    c.kernel_h = c.kernel_w = 3;
    c.pad_h = c.pad_w = 1;
    conv_.push_back(c);
    c.flags |= LWO_CONV_ACCUMULATE;
    conv_acc_.push_back(c);
  }
  dy_last_ = device_alloc(micro_ * act_bytes(spec_.ops[N - 1].second));
  dbuf_[0] = device_alloc(micro_ * act_bytes(widest));
  dbuf_[1] = device_alloc(micro_ * act_bytes(widest));
  // x_0 uniform in [-1, 1); dy_N within +-1/sqrt(rows) (each weight gradient
  // is a sum over the rows). Copies from pageable memory on the stream, each
  // waited for: a cudaMemcpy may return before its DMA lands, and a
  // non-blocking stream would not wait for it.
  const uint64_t es = lwo_dtype_size(spec_.dtype);
  const uint64_t n0 = input_bytes() / es, nl = output_bytes() / es;
  std::vector<uint8_t> host(std::max(n0, nl) * es);
  fill_uniform({{host.data(), spec_.dtype, n0, 1.0f, key_of(spec_.seed, kInputIndex)}});
  check(cudaMemcpyAsync(x(0), host.data(), n0 * es, cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync (x_0)");
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  fill_uniform({{host.data(), spec_.dtype, nl, dy_bound(), key_of(spec_.seed, kGradIndex)}});
  check(cudaMemcpyAsync(dy_last_.get(), host.data(), nl * es, cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync (dy_N)");
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

uint64_t ChainRun::act_bytes(int64_t width) const {
  return static_cast<uint64_t>(rows_) * spec_.spatial() * static_cast<uint64_t>(width) *
         lwo_dtype_size(spec_.dtype);
}
uint64_t ChainRun::output_bytes() const { return micro_ * act_bytes(spec_.ops.back().second); }
float ChainRun::dy_bound() const { return 1.0f / std::sqrt(static_cast<float>(rows_)); }
uint64_t ChainRun::input_bytes() const { return micro_ * act_bytes(spec_.ops.front().first); }

const void* ChainRun::dy_in(uint32_t i) const {
  const uint32_t k = spec_.n_ops() - 1 - i;  // backward position
  return k == 0 ? dy_last_.get() : dbuf_[(k - 1) % 2].get();
}
void* ChainRun::dx_out(uint32_t i) const { return dbuf_[(spec_.n_ops() - 1 - i) % 2].get(); }

void* ChainRun::slice(const DeviceMem& buf, int64_t width, uint32_t k) const {
  return static_cast<uint8_t*>(buf.get()) + k * act_bytes(width);
}

// Op i reads dy_in(i) and writes dx_out(i); micro-batch k's rows of each.
const void* ChainRun::dy_slice(uint32_t i, uint32_t k) const {
  return static_cast<const uint8_t*>(dy_in(i)) + k * act_bytes(spec_.ops[i].second);
}
void* ChainRun::dx_slice(uint32_t i, uint32_t k) const {
  return static_cast<uint8_t*>(dx_out(i)) + k * act_bytes(spec_.ops[i].first);
}

void ChainRun::forward_op(uint32_t i, const void* w, const void* b, uint32_t k) const {
  lwo_engine* e = weights_.engine();
  const void* bias = spec_.bias ? b : nullptr;
  void* in = slice(act_[i], spec_.ops[i].first, k);
  void* out = slice(act_[i + 1], spec_.ops[i].second, k);
  lwo_status_t s;
  if (spec_.kind == OpKind::kLinear)
    s = lwo_linear_forward(e, &lin_[i], rows_, in, w, bias, out, stream_);
  else
    s = lwo_conv2d_forward(e, &conv_[i], static_cast<int32_t>(rows_), spec_.h, spec_.w, in, w,
                           bias, out, stream_);
  if (s != LWO_OK) check(s, strf("the forward of op %u", i));
}

void ChainRun::backward_op(uint32_t i, const void* w, void* dx, void* dw, void* db, uint32_t k,
                           bool accumulate) const {
  lwo_engine* e = weights_.engine();
  void* dbias = spec_.bias ? db : nullptr;
  const void* in = slice(act_[i], spec_.ops[i].first, k);
  lwo_status_t s;
  if (spec_.kind == OpKind::kLinear)
    s = lwo_linear_backward(e, accumulate ? &lin_acc_[i] : &lin_[i], rows_, in, dy_slice(i, k), w,
                            dx, dw, dbias, wire_, stream_);
  else
    s = lwo_conv2d_backward(e, accumulate ? &conv_acc_[i] : &conv_[i], static_cast<int32_t>(rows_),
                            spec_.h, spec_.w, in, dy_slice(i, k), w, dx, dw, dbias, wire_,
                            stream_);
  if (s != LWO_OK) check(s, strf("the backward of op %u", i));
}

void ChainRun::forward_record(uint32_t r, const void* const* t, uint32_t k0, uint32_t k1) const {
  const auto& rec = spec_.records[r];
  const bool b = spec_.bias;
  for (uint32_t j = 0; j < rec.size(); ++j)
    for (uint32_t k = k0; k < k1; ++k)
      forward_op(rec[j], t[tensor_index(b, j, false)], b ? t[tensor_index(b, j, true)] : nullptr,
                 k);
}

void ChainRun::backward_record(uint32_t r, const void* const* t, void* const* g,
                               const std::function<void()>& done, uint32_t k0,
                               uint32_t k1) const {
  const auto& rec = spec_.records[r];
  const bool b = spec_.bias;
  for (uint32_t j = static_cast<uint32_t>(rec.size()); j-- > 0;) {
    const void* w = t[tensor_index(b, j, false)];
    if (g)  // the micro-batches after the first add into the gradients
      for (uint32_t k = k0; k < k1; ++k)
        backward_op(rec[j], w, nullptr, g[tensor_index(b, j, false)],
                    b ? g[tensor_index(b, j, true)] : nullptr, k, k > k0);
    if (j == 0) done();
    for (uint32_t k = k0; k < k1; ++k)
      backward_op(rec[j], w, dx_slice(rec[j], k), nullptr, nullptr, k, false);
  }
}

void ChainRun::ensure_grad_buffers() {
  if (grad_first_) return;
  const uint32_t R = spec_.n_records();
  grad_first_ = device_alloc(weights_.grad_bytes(0, wire_));
  if (R > 1) grad_last_ = device_alloc(weights_.grad_bytes(R - 1, wire_));
  uint64_t scratch = 0;
  for (uint32_t r = 1; r + 1 < R; ++r) scratch = std::max(scratch, weights_.grad_bytes(r, wire_));
  if (scratch && weights_.all_resident()) grad_scratch_ = device_alloc(scratch);
}

std::vector<const void*> ChainRun::resident_tensors(uint32_t r) {
  std::vector<const void*> w;
  std::vector<void*> g;
  resident_views(r, w, g, false);
  return w;
}

// Record r's resident tensors, and where its weight gradients go (g: the
// same order; empty when not asked for).
void ChainRun::resident_views(uint32_t r, std::vector<const void*>& w, std::vector<void*>& g,
                              bool grads) {
  const uint32_t R = spec_.n_records();
  const auto& rec = spec_.records[r];
  w.clear();
  g.clear();
  uint8_t* base = nullptr;
  if (grads) {
    ensure_grad_buffers();
    base = static_cast<uint8_t*>(r == 0       ? grad_first_.get()
                                 : r == R - 1 ? grad_last_.get()
                                              : grad_scratch_.get());
    if (!base) fail(strf("testkit::ChainRun: no gradient buffer for record %u", r));
  }
  for (uint32_t j = 0; j < rec.size(); ++j) {
    w.push_back(weights_.resident_weight(r, j));
    if (grads) g.push_back(base + weights_.grad_offset(r, j, false, wire_));
    if (spec_.bias) {
      w.push_back(weights_.resident_bias(r, j));
      if (grads) g.push_back(base + weights_.grad_offset(r, j, true, wire_));
    }
  }
}

PassTimes ChainRun::resident_pass(bool backward, bool events,
                                  const std::function<void(uint32_t pass)>& after_pass) {
  if (!weights_.all_resident()) fail("testkit::ChainRun: not every record is resident");
  const uint32_t R = spec_.n_records(), P = passes();
  const bool grads = backward && trainable_;
  std::vector<std::vector<const void*>> w(R);
  std::vector<std::vector<void*>> g(R);
  for (uint32_t r = 0; r < R; ++r) resident_views(r, w[r], g[r], grads);
  // Events at each pass's start, its forward's end, and its backward's end.
  std::vector<Event> ev;
  if (events)
    for (uint32_t i = 0; i < 2 * P + 1; ++i) ev.push_back(make_event());
  const double t0 = now_seconds();
  for (uint32_t p = 0; p < P; ++p) {
    const uint32_t k0 = pass_first(p), k1 = pass_end(p);
    if (events) check(cudaEventRecord(ev[2 * p].get(), stream_), "cudaEventRecord");
    for (uint32_t r = 0; r < R; ++r) forward_record(r, w[r].data(), k0, k1);
    if (events) check(cudaEventRecord(ev[2 * p + 1].get(), stream_), "cudaEventRecord");
    if (backward)
      for (uint32_t r = R; r-- > 0;)
        backward_record(r, w[r].data(), grads ? g[r].data() : nullptr, [] {}, k0, k1);
    if (after_pass) after_pass(p);
  }
  if (events) check(cudaEventRecord(ev[2 * P].get(), stream_), "cudaEventRecord");
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  PassTimes t;
  t.wall_ms = (now_seconds() - t0) * 1e3;
  if (events)
    for (uint32_t p = 0; p < P; ++p) {
      t.fwd_ms += elapsed_ms(ev[2 * p], ev[2 * p + 1]);
      t.bwd_ms += elapsed_ms(ev[2 * p + 1], ev[2 * p + 2]);
    }
  return t;
}

ChainRun::RecordTimes ChainRun::resident_record_times(bool backward, uint32_t repeats) {
  if (!weights_.all_resident()) fail("testkit::ChainRun: not every record is resident");
  if (repeats < 1) fail("testkit::ChainRun: at least one timed pass per record");
  const uint32_t R = spec_.n_records(), P = passes();
  const bool grads = backward && trainable_;
  std::vector<std::vector<const void*>> w(R);
  std::vector<std::vector<void*>> g(R);
  for (uint32_t r = 0; r < R; ++r) resident_views(r, w[r], g[r], grads);
  // Per pass: an event at its start, then one after each forward record and
  // (backward) one after each backward record, in schedule order.
  const uint32_t n = backward ? 2 * R : R;
  std::vector<Event> ev;
  for (uint32_t i = 0; i < P * (n + 1); ++i) ev.push_back(make_event());
  std::vector<std::vector<double>> fwd(R), bwd(backward ? R : 0);
  for (uint32_t k = 0; k < repeats; ++k) {
    for (uint32_t p = 0; p < P; ++p) {
      const uint32_t k0 = pass_first(p), k1 = pass_end(p);
      Event* e = &ev[p * (n + 1)];
      check(cudaEventRecord(e[0].get(), stream_), "cudaEventRecord");
      for (uint32_t r = 0; r < R; ++r) {
        forward_record(r, w[r].data(), k0, k1);
        check(cudaEventRecord(e[1 + r].get(), stream_), "cudaEventRecord");
      }
      if (backward)
        for (uint32_t r = R; r-- > 0;) {
          backward_record(r, w[r].data(), grads ? g[r].data() : nullptr, [] {}, k0, k1);
          check(cudaEventRecord(e[2 * R - r].get(), stream_), "cudaEventRecord");
        }
    }
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    for (uint32_t r = 0; r < R; ++r) {
      double f = 0, b = 0;
      for (uint32_t p = 0; p < P; ++p) {
        const Event* e = &ev[p * (n + 1)];
        f += elapsed_ms(e[r], e[1 + r]);
        if (backward) b += elapsed_ms(e[2 * R - r - 1], e[2 * R - r]);
      }
      fwd[r].push_back(f);
      if (backward) bwd[r].push_back(b);
    }
  }
  RecordTimes t;
  for (uint32_t r = 0; r < R; ++r) {
    t.fwd_ms.push_back(median(fwd[r]));
    if (backward) t.bwd_ms.push_back(median(bwd[r]));
  }
  return t;
}

StepStats ChainRun::streamed_pass(lwo_schedule* schedule, lwo_ring* ring, lwo_grads* grads,
                                  const StepOptions& options) {
  StepCalls calls;
  uint32_t k0 = 0, k1 = 1;
  calls.begin_pass = [&](uint32_t p) {
    k0 = pass_first(p);
    k1 = pass_end(p);
  };
  calls.forward = [&](uint32_t r, const lwo_layer_view& v) {
    forward_record(r, v.tensors, k0, k1);
  };
  calls.backward = [&](uint32_t r, const lwo_layer_view& v, const lwo_layer_view* g,
                       const std::function<void()>& done) {
    // The backward writes its gradients in wire_: the slot must hold that
    // dtype (lwo 0.3's default gradients are the tensor's own dtype).
    if (g && trainable_ && g->tensor_dtypes)
      for (uint32_t k = 0; k < g->n_tensors; ++k)
        if (g->tensor_dtypes[k] != wire_)
          fail(strf("testkit::ChainRun: record %u's gradient slot holds %s, the run computes "
                    "%s gradients (create the grads with LWO_GRADS_F32, or "
                    "LWO_GRADS_NATIVE_WIRE and the chain's dtype as the wire)",
                    r, lwo_dtype_name(g->tensor_dtypes[k]), lwo_dtype_name(wire_)));
    backward_record(r, v.tensors, g && trainable_ ? g->tensors : nullptr, done, k0, k1);
  };
  StepOptions o = options;
  o.passes = passes();
  return run_step(schedule, ring, trainable_ ? grads : nullptr, stream_, spec_.n_records(), o,
                  calls);
}

void ChainRun::enqueue_streamed_step(lwo_schedule* schedule, lwo_grads* grads) {
  if (passes() != 1) fail("testkit::ChainRun: an enqueued step is one pass (one micro-batch pass)");
  const uint32_t R = spec_.n_records();
  const bool with_grads = grads && trainable_;
  check(lwo_schedule_reset(schedule, stream_), "lwo_schedule_reset");
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  for (uint32_t i = 0; i < 2 * R; ++i) {
    check(lwo_schedule_next(schedule, stream_, &v), "lwo_schedule_next");
    const uint32_t r = i < R ? i : 2 * R - 1 - i;
    if (v.layer != r)
      fail(strf("lwo_schedule_next returned layer %u at position %u; expected layer %u", v.layer,
                i, r));
    if (i < R) {
      forward_record(r, v.tensors, 0, micro_);
      continue;
    }
    if (!with_grads) {
      backward_record(r, v.tensors, nullptr, [] {}, 0, micro_);
      continue;
    }
    lwo_layer_view g = LWO_LAYER_VIEW_INIT;
    check(lwo_grads_begin(grads, r, stream_, &g), "lwo_grads_begin");
    for (uint32_t k = 0; k < g.n_tensors; ++k)
      if (g.tensor_dtypes && g.tensor_dtypes[k] != wire_)
        fail(strf("testkit::ChainRun: record %u's gradient slot holds %s, the run computes %s "
                  "gradients", r, lwo_dtype_name(g.tensor_dtypes[k]), lwo_dtype_name(wire_)));
    backward_record(r, v.tensors, g.tensors, [&] {
      check(lwo_grads_end(grads, r, stream_), "lwo_grads_end");
    }, 0, micro_);
  }
  const lwo_status_t s = lwo_schedule_next(schedule, stream_, &v);
  if (s != LWO_END) {
    check(s, "lwo_schedule_next");
    fail(strf("the schedule did not end after its %u layers", 2 * R));
  }
}

void ChainRun::enqueue_resident_step() {
  if (!weights_.all_resident()) fail("testkit::ChainRun: not every record is resident");
  if (passes() != 1) fail("testkit::ChainRun: an enqueued step is one pass (one micro-batch pass)");
  const uint32_t R = spec_.n_records();
  std::vector<std::vector<const void*>> w(R);
  std::vector<std::vector<void*>> g(R);
  for (uint32_t r = 0; r < R; ++r) resident_views(r, w[r], g[r], trainable_);
  for (uint32_t r = 0; r < R; ++r) forward_record(r, w[r].data(), 0, micro_);
  for (uint32_t r = R; r-- > 0;)
    backward_record(r, w[r].data(), trainable_ ? g[r].data() : nullptr, [] {}, 0, micro_);
}

// --- the check ---------------------------------------------------------------------------

std::vector<uint8_t> copy_back(const void* device, uint64_t bytes) {
  std::vector<uint8_t> host(bytes);
  // Every stream in flight is non-blocking: this copy on the legacy default
  // stream waits for none of them. Callers have synchronised.
  check(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (check)");
  return host;
}

std::string compare_bits(const std::string& what, const void* got, const void* want, uint64_t n,
                         lwo_dtype_t dtype, int64_t cols) {
  const uint64_t es = lwo_dtype_size(dtype);
  const auto* g = static_cast<const uint8_t*>(got);
  const auto* w = static_cast<const uint8_t*>(want);
  if (n == 0 || std::memcmp(g, w, n * es) == 0) return "";
  uint64_t first = n, bad = 0;
  constexpr uint64_t kBlock = 4096;  // elements compared at once
  for (uint64_t b = 0; b < n; b += kBlock) {
    const uint64_t e = std::min(n, b + kBlock);
    if (std::memcmp(g + b * es, w + b * es, (e - b) * es) == 0) continue;
    for (uint64_t i = b; i < e; ++i)
      if (std::memcmp(g + i * es, w + i * es, es) != 0) {
        if (first == n) first = i;
        ++bad;
      }
  }
  uint64_t gb = 0, wb = 0;
  std::memcpy(&gb, g + first * es, es);
  std::memcpy(&wb, w + first * es, es);
  const int hex = static_cast<int>(2 * es);
  const uint64_t c = static_cast<uint64_t>(std::max<int64_t>(cols, 1));
  return strf(
      "%s differs from the resident reference at element %llu (row %llu, col %llu): streamed "
      "%.9g (0x%0*llx), resident %.9g (0x%0*llx); %llu of %llu elements differ",
      what.c_str(), static_cast<unsigned long long>(first),
      static_cast<unsigned long long>(first / c), static_cast<unsigned long long>(first % c),
      load_f32(g, dtype, first), hex, static_cast<unsigned long long>(gb),
      load_f32(w, dtype, first), hex, static_cast<unsigned long long>(wb),
      static_cast<unsigned long long>(bad), static_cast<unsigned long long>(n));
}

ChainCheck ChainRun::compare_with_resident(lwo_grads* grads, bool backward) {
  const uint32_t R = spec_.n_records(), N = spec_.n_ops();
  const bool with_grads = backward && trainable_ && grads;
  ChainCheck out;
  auto differ = [&](const std::string& item, const std::string& message) {
    if (message.empty()) return;
    out.same = false;
    out.differs += " " + item;
    if (out.first.empty()) out.first = message;
  };
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  const std::vector<uint8_t> y = copy_back(x(N), output_bytes());
  std::vector<uint8_t> dx0;
  if (backward) dx0 = copy_back(dx_out(0), input_bytes());

  // The gradients checked: every tensor of the first and the last record,
  // each as lwo_grads_tensor gives it (its host dtype), and the sum the host
  // should hold: the resident gradients of each pass, added as the library
  // adds (in f32, rounded once to the host dtype).
  struct Item {
    uint32_t r, j;
    bool bias;
    std::string name;
    lwo_grad_tensor got;
    std::vector<uint8_t> want;
  };
  std::vector<Item> items_checked;
  const uint32_t checked[2] = {0, R - 1};
  const uint32_t n_checked = with_grads ? (R > 1 ? 2u : 1u) : 0u;
  for (uint32_t c = 0; c < n_checked; ++c) {
    const uint32_t r = checked[c];
    for (uint32_t j = 0; j < spec_.records[r].size(); ++j)
      for (int k = 0; k < (spec_.bias ? 2 : 1); ++k) {
        Item it{r, j, k == 1, k == 0 ? weights_.weight_name(r, j) : weights_.bias_name(r, j),
                LWO_GRAD_TENSOR_INIT, {}};
        check(lwo_grads_tensor(grads, r, it.name.c_str(), &it.got),
              strf("lwo_grads_tensor(record %u, \"%s\")", r, it.name.c_str()));
        const uint64_t n = it.bias ? static_cast<uint64_t>(spec_.ops[spec_.records[r][j]].second)
                                   : spec_.weight_elems(spec_.records[r][j]);
        it.want.assign(n * lwo_dtype_size(it.got.dtype), 0);
        items_checked.push_back(std::move(it));
      }
  }
  auto add_pass = [&](uint32_t p) {  // the resident gradients of pass p, into `want`
    if (!with_grads) return;
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    for (uint32_t c = 0; c < n_checked; ++c) {
      const uint32_t r = checked[c];
      const std::vector<uint8_t> ref = copy_back(
          r == 0 ? grad_first_.get() : grad_last_.get(), weights_.grad_bytes(r, wire_));
      for (Item& it : items_checked) {
        if (it.r != r) continue;
        const uint8_t* src = ref.data() + weights_.grad_offset(r, it.j, it.bias, wire_);
        const uint64_t n = it.want.size() / lwo_dtype_size(it.got.dtype);
        for (uint64_t i = 0; i < n; ++i) {
          const float part = load_f32(src, wire_, i);
          store_f32(it.want.data(), it.got.dtype, i,
                    p == 0 ? part : load_f32(it.want.data(), it.got.dtype, i) + part);
        }
      }
    }
  };

  // The resident computation, now.
  if (weights_.all_resident()) {
    resident_pass(backward, false, add_pass);
  } else {
    if (spec_.records[0].size() != 1 || spec_.records[R - 1].size() != 1)
      fail("testkit::ChainRun: a partly resident chain is checked with records of one op");
    if (micro_ > 1)
      fail("testkit::ChainRun: micro-batches are checked with every record resident");
    // The streamed x_{N-1} and the dy of op 0 are still in place. Op 0's
    // backward goes first: it reads a ping-pong buffer that op N-1's dx would
    // overwrite, so op N-1 computes no dx here.
    std::vector<const void*> w;
    std::vector<void*> g;
    resident_views(R - 1, w, g, false);
    forward_record(R - 1, w.data(), 0, 1);
    resident_views(0, w, g, with_grads);
    if (backward) backward_record(0, w.data(), with_grads ? g.data() : nullptr, [] {}, 0, 1);
    if (backward && with_grads && R > 1) {
      resident_views(R - 1, w, g, true);
      const bool bias = spec_.bias;
      backward_op(N - 1, w[0], nullptr, g[0], bias ? g[1] : nullptr, 0, false);
    }
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    add_pass(0);
  }
  check(lwo_engine_check(weights_.engine()), "lwo_engine_check");
  const uint64_t es = lwo_dtype_size(spec_.dtype);
  const int64_t out_cols = spec_.ops.back().second, in_cols = spec_.ops.front().first;
  differ("output", compare_bits(strf("the output of op %u", N - 1), y.data(),
                                copy_back(x(N), y.size()).data(), y.size() / es, spec_.dtype,
                                out_cols));
  if (backward)
    differ("input-gradient",
           compare_bits("the input gradient (dx of op 0)", dx0.data(),
                        copy_back(dx_out(0), dx0.size()).data(), dx0.size() / es, spec_.dtype,
                        in_cols));
  const std::string how = weights_.all_resident()
                              ? "the whole chain recomputed with every weight resident"
                              : strf("records 0 and %u recomputed from the streamed pass's inputs",
                                     R - 1);
  std::string items = strf("output of op %u", N - 1);
  if (backward) items += ", input gradient";
  if (micro_ > 1)
    items += strf(" of all %u micro-batches (%s-major)", micro_, micro_order_name(order_));

  lwo_dtype_t host_dtype = wire_;
  for (const Item& it : items_checked) {
    const uint64_t want_n = it.want.size() / lwo_dtype_size(it.got.dtype);
    const std::string item = strf("%s-gradient(record %u, %s)", it.bias ? "bias" : "weight", it.r,
                                  it.name.c_str());
    host_dtype = it.got.dtype;
    if (it.got.first_element != 0 || it.got.n_elements != want_n || !it.got.data) {
      differ(item, strf("lwo_grads_tensor(record %u, \"%s\") has elements [%llu, %llu), "
                        "expected [0, %llu)",
                        it.r, it.name.c_str(), static_cast<unsigned long long>(it.got.first_element),
                        static_cast<unsigned long long>(it.got.first_element + it.got.n_elements),
                        static_cast<unsigned long long>(want_n)));
      continue;
    }
    const int64_t cols = it.bias ? 1 : static_cast<int64_t>(spec_.fan_in(spec_.records[it.r][it.j]));
    differ(item, compare_bits(strf("d%s of record %u (host gradients)", it.name.c_str(), it.r),
                              it.got.data, it.want.data(), want_n, it.got.dtype, cols));
  }
  for (uint32_t c = 0; c < n_checked; ++c)
    items += strf(", the %s gradients of record %u", spec_.bias ? "weight and bias" : "weight",
                  checked[c]);
  out.what = strf("%s bit for bit%s: %s", how.c_str(),
                  with_grads ? strf(" (%s wire, %s host buffers)", lwo_dtype_name(wire_),
                                    lwo_dtype_name(host_dtype))
                                   .c_str()
                             : "",
                  items.c_str());
  return out;
}

}  // namespace testkit
