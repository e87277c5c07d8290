// An fp64 CPU reference of lwo's 2-D convolution (a cross-correlation, as
// lwo_conv2d_forward defines it) and of its backward pass, in NHWC or NCHW
// with the weight in the layout's filter order (lwo.h's lwo_layout_t).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace testkit {

struct ConvShape {
  bool nhwc;
  int32_t n, c, h, w, k, kh, kw, sh, sw, ph, pw, dh, dw, g;
  int32_t out_h() const { return (h + 2 * ph - (dh * (kh - 1) + 1)) / sh + 1; }
  int32_t out_w() const { return (w + 2 * pw - (dw * (kw - 1) + 1)) / sw + 1; }
  // Elements of the weight, [k, c / g, kh, kw] in the layout's order.
  size_t weight_elems() const { return size_t(k) * (c / g) * kh * kw; }
};

// Index of element (n, c, y, x) of a [N, C, H, W] tensor stored in NHWC or NCHW.
inline size_t conv_at(bool nhwc, int32_t C, int32_t H, int32_t W, int32_t n, int32_t c, int32_t y,
                      int32_t x) {
  return nhwc ? ((size_t(n) * H + y) * W + x) * C + c : ((size_t(n) * C + c) * H + y) * W + x;
}

// Index of weight element (k, c' of its group, r, s): NHWC [k, kh, kw, c/g],
// NCHW [k, c/g, kh, kw].
inline size_t conv_widx(const ConvShape& s, int32_t k, int32_t ci, int32_t r, int32_t q) {
  const int32_t cg = s.c / s.g;
  return s.nhwc ? ((size_t(k) * s.kh + r) * s.kw + q) * cg + ci
                : ((size_t(k) * cg + ci) * s.kh + r) * s.kw + q;
}

// y = conv(x, W) (+ b, if b), dx += dy conv^T W, dW += dy (x) x, db += the
// sum of dy, in fp64 over the given element values (x [n, c, h, w], dy
// [n, k, oh, ow], both in the layout's order). Null outputs are skipped;
// y is overwritten, dx, dw and db are resized to their tensors and zeroed.
template <class T>
void conv2d_reference(const ConvShape& s, const std::vector<T>& x, const std::vector<T>& w,
                      const std::vector<T>* b, const std::vector<T>& dy, std::vector<double>* y,
                      std::vector<double>* dx, std::vector<double>* dw, std::vector<double>* db) {
  const int32_t oh = s.out_h(), ow = s.out_w(), cg = s.c / s.g, kg = s.k / s.g;
  const size_t ny = size_t(s.n) * s.k * oh * ow;
  if (y) y->assign(ny, 0.0);
  if (dx) dx->assign(size_t(s.n) * s.c * s.h * s.w, 0.0);
  if (dw) dw->assign(s.weight_elems(), 0.0);
  if (db) db->assign(size_t(s.k), 0.0);
  for (int32_t n = 0; n < s.n; ++n)
    for (int32_t k = 0; k < s.k; ++k)
      for (int32_t oy = 0; oy < oh; ++oy)
        for (int32_t ox = 0; ox < ow; ++ox) {
          const size_t yi = conv_at(s.nhwc, s.k, oh, ow, n, k, oy, ox);
          double acc = b ? double((*b)[k]) : 0.0;
          const double g = double(dy[yi]);
          if (db) (*db)[k] += g;
          const int32_t grp = k / kg;
          for (int32_t ci = 0; ci < cg; ++ci)
            for (int32_t r = 0; r < s.kh; ++r)
              for (int32_t q = 0; q < s.kw; ++q) {
                const int32_t iy = oy * s.sh - s.ph + r * s.dh, ix = ox * s.sw - s.pw + q * s.dw;
                if (iy < 0 || iy >= s.h || ix < 0 || ix >= s.w) continue;
                const size_t xi = conv_at(s.nhwc, s.c, s.h, s.w, n, grp * cg + ci, iy, ix);
                const size_t wi = conv_widx(s, k, ci, r, q);
                acc += double(x[xi]) * double(w[wi]);
                if (dx) (*dx)[xi] += g * double(w[wi]);
                if (dw) (*dw)[wi] += g * double(x[xi]);
              }
          if (y) (*y)[yi] = acc;
        }
}

}  // namespace testkit
