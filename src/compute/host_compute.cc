// See host_compute.h.
#include "src/compute/host_compute.h"

#include <vector>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/quant/quant.h"

namespace lwo {
namespace host_compute {
namespace {

std::vector<float> load(const void* p, lwo_dtype_t dtype, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = load_f32(p, dtype, i);
  return v;
}

void store(void* p, lwo_dtype_t dtype, const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i) store_f32(p, dtype, i, v[i]);
}

// A gradient: v, or (accumulate) its old value plus v, rounded once.
void store_grad(void* p, lwo_dtype_t dtype, const std::vector<float>& v, bool accumulate) {
  for (size_t i = 0; i < v.size(); ++i)
    store_f32(p, dtype, i, accumulate ? load_f32(p, dtype, i) + v[i] : v[i]);
}

// The [rows x cols] weight as f32: dense in `dtype`, or a quantized tensor
// of `format` dequantized to `dtype` first.
std::vector<float> weight(lwo_quant_format_t format, lwo_dtype_t dtype, int64_t rows,
                          int64_t cols, const void* w) {
  const size_t n = size_t(rows) * size_t(cols);
  if (format == LWO_QUANT_NONE) return load(w, dtype, n);
  quant::Layout layout = quant::layout_of(format, dtype, rows, cols);
  std::vector<uint8_t> plain(n * dtype_size(dtype));
  quant::dequantize(layout, w, plain.data(), dtype, 1);
  return load(plain.data(), dtype, n);
}

// Rows of `a` ([rows x cols]) as columns: [cols x rows].
std::vector<float> transpose(const std::vector<float>& a, size_t rows, size_t cols) {
  std::vector<float> t(a.size());
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

float dot(const float* a, const float* b, size_t n) {
  float s = 0.0f;
  for (size_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// ---- convolutions: indices as lwo_layout_t lays the tensors out ----
size_t at(bool nhwc, int32_t C, int32_t H, int32_t W, int32_t n, int32_t c, int32_t y, int32_t x) {
  return nhwc ? ((size_t(n) * H + y) * W + x) * C + c : ((size_t(n) * C + c) * H + y) * W + x;
}
// Weight element (k, c' of its group, r, q): NHWC [k, kh, kw, c/g], NCHW [k, c/g, kh, kw].
size_t widx(const Compute::Conv& cv, int32_t k, int32_t ci, int32_t r, int32_t q) {
  const int32_t cg = cv.c / cv.groups;
  return cv.nhwc ? ((size_t(k) * cv.kh + r) * cv.kw + q) * cg + ci
                 : ((size_t(k) * cg + ci) * cv.kh + r) * cv.kw + q;
}

// Calls f(x index, w index, y index) for every product of the convolution.
template <class F>
void each_product(const Compute::Conv& cv, int32_t n, int32_t h, int32_t w, F&& f) {
  int32_t oh = 0, ow = 0;
  Compute::conv_out_size(cv, h, w, &oh, &ow);
  const int32_t cg = cv.c / cv.groups, kg = cv.k / cv.groups;
  for (int32_t b = 0; b < n; ++b)
    for (int32_t k = 0; k < cv.k; ++k)
      for (int32_t oy = 0; oy < oh; ++oy)
        for (int32_t ox = 0; ox < ow; ++ox) {
          const size_t yi = at(cv.nhwc, cv.k, oh, ow, b, k, oy, ox);
          const int32_t grp = k / kg;
          for (int32_t ci = 0; ci < cg; ++ci)
            for (int32_t r = 0; r < cv.kh; ++r)
              for (int32_t q = 0; q < cv.kw; ++q) {
                const int32_t iy = oy * cv.sh - cv.ph + r * cv.dh;
                const int32_t ix = ox * cv.sw - cv.pw + q * cv.dw;
                if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
                f(at(cv.nhwc, cv.c, h, w, b, grp * cg + ci, iy, ix), widx(cv, k, ci, r, q), yi);
              }
        }
}

size_t out_elems(const Compute::Conv& cv, int32_t n, int32_t h, int32_t w) {
  int32_t oh = 0, ow = 0;
  Compute::conv_out_size(cv, h, w, &oh, &ow);
  return size_t(n) * cv.k * oh * ow;
}

}  // namespace

void linear_forward(const Compute::Linear& l, int64_t tokens, const void* x, const void* w,
                    const void* b, void* y) {
  const size_t T = size_t(tokens), in = size_t(l.in), out = size_t(l.out);
  std::vector<float> X = load(x, l.dtype, T * in);
  std::vector<float> W = weight(l.weight_format, l.dtype, l.out, l.in, w);
  std::vector<float> B = l.bias ? load(b, l.dtype, out) : std::vector<float>();
  std::vector<float> Y(T * out);
  for (size_t t = 0; t < T; ++t)
    for (size_t o = 0; o < out; ++o) {
      float s = dot(&X[t * in], &W[o * in], in);
      Y[t * out + o] = l.bias ? s + B[o] : s;
    }
  store(y, l.dtype, Y);
}

void linear_backward(const Compute::Linear& l, int64_t tokens, const void* x, const void* dy,
                     const void* w, void* dx, void* dw, void* db, lwo_dtype_t grad_dtype) {
  const size_t T = size_t(tokens), in = size_t(l.in), out = size_t(l.out);
  std::vector<float> DY = load(dy, l.dtype, T * out);
  std::vector<float> DYt = transpose(DY, T, out);  // [out x T]
  if (dw) {
    std::vector<float> Xt = transpose(load(x, l.dtype, T * in), T, in);  // [in x T]
    std::vector<float> G(out * in);
    for (size_t o = 0; o < out; ++o)
      for (size_t i = 0; i < in; ++i) G[o * in + i] = dot(&DYt[o * T], &Xt[i * T], T);
    store_grad(dw, grad_dtype, G, l.accumulate);
  }
  if (db) {
    std::vector<float> G(out, 0.0f);
    for (size_t o = 0; o < out; ++o)
      for (size_t t = 0; t < T; ++t) G[o] += DYt[o * T + t];
    store_grad(db, grad_dtype, G, l.accumulate);
  }
  if (dx) {
    std::vector<float> Wt =
        transpose(weight(l.weight_format, l.dtype, l.out, l.in, w), out, in);  // [in x out]
    std::vector<float> DX(T * in);
    for (size_t t = 0; t < T; ++t)
      for (size_t i = 0; i < in; ++i) DX[t * in + i] = dot(&DY[t * out], &Wt[i * out], out);
    store(dx, l.dtype, DX);
  }
}

void conv_forward(const Compute::Conv& cv, int32_t n, int32_t h, int32_t w, const void* x,
                  const void* wt, const void* b, void* y) {
  std::vector<float> X = load(x, cv.dtype, size_t(n) * cv.c * h * w);
  std::vector<float> W = weight(cv.weight_format, cv.dtype, cv.k, cv.weight_cols(), wt);
  std::vector<float> Y(out_elems(cv, n, h, w), 0.0f);
  each_product(cv, n, h, w, [&](size_t xi, size_t wi, size_t yi) { Y[yi] += X[xi] * W[wi]; });
  if (cv.bias) {
    std::vector<float> B = load(b, cv.dtype, size_t(cv.k));
    const size_t per = Y.size() / (size_t(n) * cv.k);  // oh * ow
    for (size_t i = 0; i < Y.size(); ++i) {
      const size_t k = cv.nhwc ? i % size_t(cv.k) : (i / per) % size_t(cv.k);
      Y[i] += B[k];
    }
  }
  store(y, cv.dtype, Y);
}

void conv_backward(const Compute::Conv& cv, int32_t n, int32_t h, int32_t w, const void* x,
                   const void* dy, const void* wt, void* dx, void* dwt, void* db,
                   lwo_dtype_t grad_dtype) {
  const size_t ny = out_elems(cv, n, h, w), nx = size_t(n) * cv.c * h * w;
  std::vector<float> DY = load(dy, cv.dtype, ny);
  if (dwt) {
    std::vector<float> X = load(x, cv.dtype, nx);
    std::vector<float> G(size_t(cv.k) * size_t(cv.weight_cols()), 0.0f);
    each_product(cv, n, h, w, [&](size_t xi, size_t wi, size_t yi) { G[wi] += DY[yi] * X[xi]; });
    store_grad(dwt, grad_dtype, G, cv.accumulate);
  }
  if (db) {
    std::vector<float> G(size_t(cv.k), 0.0f);
    const size_t per = ny / (size_t(n) * cv.k);
    for (size_t i = 0; i < ny; ++i)
      G[cv.nhwc ? i % size_t(cv.k) : (i / per) % size_t(cv.k)] += DY[i];
    store_grad(db, grad_dtype, G, cv.accumulate);
  }
  if (dx) {
    std::vector<float> W = weight(cv.weight_format, cv.dtype, cv.k, cv.weight_cols(), wt);
    std::vector<float> DX(nx, 0.0f);
    each_product(cv, n, h, w, [&](size_t xi, size_t wi, size_t yi) { DX[xi] += DY[yi] * W[wi]; });
    store(dx, cv.dtype, DX);
  }
}

}  // namespace host_compute
}  // namespace lwo
