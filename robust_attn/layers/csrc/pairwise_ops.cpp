// SAN pairwise attention (Zhao, Jia, Koltun, CVPR 2020, eq. 2-3) for the linear relations
// (subtraction, summation), fused per tile of one image and one footprint offset on CPU, so that
// gamma's k^2-expanded tensors never leave the cache. Compiled with window_ops.cpp by
// robust_attn/layers/cpu_kernels.py; robust_attn/layers/san.py's chunked PyTorch path computes the
// same functions (and is what the tests compare against).
//
// Per image b and offset o = (dy, dx), on the tile of all H*W = T pixels:
//   u      = relu(center + nbpad shifted by o)                (R x T)   gamma's first BN-ReLU, BN folded
//                                                                       into center/nbpad by the caller
//   hid    = W1 u + W1p pos[:, o]                             (Hd x T)  pos: position channels (P = 2)
//   z      = relu(scale * hid + shift)                        (Hd x T)  BN2 (batch or running statistics)
//   logit  = W2 z + b2                                        (G x T)
//   w      = softmax over the offsets of logit                (per group and pixel)
//   out[b, s, g] = sum_o w[o, g] * vpad[b, s, g] shifted by o          (eq. 2's aggregation)
//
// Tensors (contiguous): center (N, R, H, W), nbpad (N, R, Hp, Wp), W1 (Hd, R), and for the position
// channels (or empty) W1p (Hd, P) and pos (P, K, T), scale/shift (Hd), W2 (G, Hd), b2 (G), vpad (N, Sh, G, Hp, Wp), out (N, Sh, G, H, W),
// lse (N, G, H, W) the log-sum-exp of the logits, keep (N, K, G, ld) the logits' gradients (rows
// padded to the tiles' stride ld).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "small_gemm.h"

namespace {

using small_gemm::gemm_nn;
using small_gemm::gemm_nt;
using fused::PerThread;

// exp that GCC vectorizes (Cephes' expf: 2^n times a degree-5 polynomial on |r| <= ln2/2; about
// 1 ulp); std::exp stays scalar without -ffast-math. double keeps std::exp (tests, not speed).
inline float vexp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // not fmin/fmax: those stay libm calls
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}
inline double vexp(double x) { return std::exp(x); }

struct Shape {
  int64_t N, R, Hd, G, Sh, H, W, Hp, Wp, K, T;
  int64_t P;   // position channels (0: none)
  int64_t ld;  // row stride of the tiles (fused::tile_stride)
};

void check_cpu_contiguous(const at::Tensor& t, const char* name) { fused::check_cpu_contiguous(t, "pairwise ops", name); }

// The shape of one call, with every tensor checked against it (v, out: only where given).
Shape shape_of(const at::Tensor& center, const at::Tensor& nbpad, const std::vector<int64_t>& dy,
               const std::vector<int64_t>& dx, const at::Tensor& w1, const at::Tensor& w1p, const at::Tensor& pos,
               const at::Tensor* w2, const at::Tensor* vpad) {
  for (auto [t, name] : {std::pair{&center, "center"}, {&nbpad, "nbpad"}, {&w1, "w1"}}) {
    check_cpu_contiguous(*t, name);
    TORCH_CHECK(t->scalar_type() == center.scalar_type(), "pairwise ops: ", name, " has another dtype");
  }
  TORCH_CHECK(center.dim() == 4 && nbpad.dim() == 4 && w1.dim() == 2, "pairwise ops: center, nbpad must be 4-D, w1 2-D");
  Shape s{};
  s.N = center.size(0); s.R = center.size(1); s.H = center.size(2); s.W = center.size(3);
  s.Hp = nbpad.size(2); s.Wp = nbpad.size(3); s.Hd = w1.size(0); s.K = static_cast<int64_t>(dy.size());
  s.T = s.H * s.W;
  s.ld = fused::tile_stride(s.T);
  TORCH_CHECK(nbpad.size(0) == s.N && nbpad.size(1) == s.R, "pairwise ops: nbpad ", nbpad.sizes(), " vs center ",
              center.sizes());
  TORCH_CHECK(w1.size(1) == s.R, "pairwise ops: w1 ", w1.sizes(), " does not take ", s.R, " channels");
  fused::check_windows(dy, dx, s.H, s.W, s.Hp, s.Wp, "pairwise ops");
  s.P = pos.defined() && pos.numel() > 0 ? pos.size(0) : 0;
  if (s.P > 0) {
    check_cpu_contiguous(pos, "pos");
    check_cpu_contiguous(w1p, "w1p");
    TORCH_CHECK(pos.sizes() == at::IntArrayRef({s.P, s.K, s.T}) && w1p.sizes() == at::IntArrayRef({s.Hd, s.P}),
                "pairwise ops: pos ", pos.sizes(), " and w1p ", w1p.sizes(), " must be (P, K, H*W) and (Hd, P)");
  }
  if (w2 != nullptr) {
    check_cpu_contiguous(*w2, "w2");
    TORCH_CHECK(w2->dim() == 2 && w2->size(1) == s.Hd, "pairwise ops: w2 ", w2->sizes(), " does not take ", s.Hd,
                " channels");
    s.G = w2->size(0);
  }
  if (vpad != nullptr) {
    check_cpu_contiguous(*vpad, "vpad");
    TORCH_CHECK(vpad->dim() == 5 && vpad->size(0) == s.N && vpad->size(2) == s.G && vpad->size(3) == s.Hp &&
                    vpad->size(4) == s.Wp,
                "pairwise ops: vpad ", vpad->sizes(), " must be (N, Sh, ", s.G, ", ", s.Hp, ", ", s.Wp, ")");
    s.Sh = vpad->size(1);
  }
  return s;
}

// The steps of one tile, shared by every pass.
template <typename S>
struct Gamma {
  Shape s;
  const S* center;
  const S* nbpad;
  const int64_t* dy;
  const int64_t* dx;
  const S* w1;
  const S* w1p;  // (Hd, P)
  const S* pos;  // (P, K, T); nullptr: no position channels

  // u = relu(center[b] + nbpad[b] shifted by offset k)
  void relation(int64_t b, int64_t k, S* __restrict__ u) const {
    for (int64_t c = 0; c < s.R; ++c) {
      for (int64_t i = 0; i < s.H; ++i) {
        const S* __restrict__ crow = center + ((b * s.R + c) * s.H + i) * s.W;
        const S* __restrict__ xrow = nbpad + ((b * s.R + c) * s.Hp + i + dy[k]) * s.Wp + dx[k];
        S* __restrict__ urow = u + c * s.ld + i * s.W;
        for (int64_t j = 0; j < s.W; ++j) {
          const S v = crow[j] + xrow[j];
          urow[j] = v > S(0) ? v : S(0);
        }
      }
    }
  }

  // hid = W1 u + W1p pos[:, k] (the position channels: a rank-P update, cheaper than reading a
  // precomputed (Hd, K, T) term from memory)
  void hidden(int64_t k, const S* u, S* __restrict__ hid) const {
    gemm_nn<S>(s.Hd, s.R, s.T, w1, s.R, u, s.ld, hid, s.ld, false);
    for (int64_t p = 0; p < s.P; ++p) {
      const S* __restrict__ prow = pos + (p * s.K + k) * s.T;
      for (int64_t j = 0; j < s.Hd; ++j) {
        const S a = w1p[j * s.P + p];
        S* __restrict__ hrow = hid + j * s.ld;
        for (int64_t t = 0; t < s.T; ++t) hrow[t] += a * prow[t];
      }
    }
  }

  // z = relu(scale * hid + shift)
  void activation(const S* __restrict__ hid, const S* scale, const S* shift, S* __restrict__ z) const {
    for (int64_t j = 0; j < s.Hd; ++j) {
      const S a = scale[j], c = shift[j];
      const S* __restrict__ hrow = hid + j * s.ld;
      S* __restrict__ zrow = z + j * s.ld;
      for (int64_t t = 0; t < s.T; ++t) {
        const S v = a * hrow[t] + c;
        zrow[t] = v > S(0) ? v : S(0);
      }
    }
  }

  // logit = W2 z + b2
  void logits(const S* w2, const S* b2, const S* z, S* __restrict__ out) const {
    gemm_nn<S>(s.G, s.Hd, s.T, w2, s.Hd, z, s.ld, out, s.ld, false);
    for (int64_t g = 0; g < s.G; ++g) {
      S* __restrict__ row = out + g * s.ld;
      for (int64_t t = 0; t < s.T; ++t) row[t] += b2[g];
    }
  }
};

template <typename S>
Gamma<S> gamma_of(const Shape& s, const at::Tensor& center, const at::Tensor& nbpad, const std::vector<int64_t>& dy,
                  const std::vector<int64_t>& dx, const at::Tensor& w1, const at::Tensor& w1p, const at::Tensor& pos) {
  return Gamma<S>{s, center.const_data_ptr<S>(), nbpad.const_data_ptr<S>(), dy.data(), dx.data(),
                  w1.const_data_ptr<S>(), s.P ? w1p.const_data_ptr<S>() : nullptr,
                  s.P ? pos.const_data_ptr<S>() : nullptr};
}

// BN2's batch moments: sum and sum of squares of hid per hidden channel, (2, Hd) in float64.
at::Tensor pairwise_moments(const at::Tensor& center, const at::Tensor& nbpad, const std::vector<int64_t>& dy,
                            const std::vector<int64_t>& dx, const at::Tensor& w1, const at::Tensor& w1p, const at::Tensor& pos) {
  const Shape s = shape_of(center, nbpad, dy, dx, w1, w1p, pos, nullptr, nullptr);
  at::Tensor sums = at::zeros({2, s.Hd}, center.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(center.scalar_type(), "pairwise_moments", [&] {
    const Gamma<scalar_t> gam = gamma_of<scalar_t>(s, center, nbpad, dy, dx, w1, w1p, pos);
    PerThread<double> acc(2 * s.Hd);
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> u(s.R * s.ld), hid(s.Hd * s.ld);
      std::vector<double>& mine = acc.mine();
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t k = 0; k < s.K; ++k) {
          gam.relation(b, k, u.data());
          gam.hidden(k, u.data(), hid.data());
          for (int64_t j = 0; j < s.Hd; ++j) {
            const scalar_t* __restrict__ hrow = hid.data() + j * s.ld;
            scalar_t sum = 0, sq = 0;
            fused::add_sum_and_dot(hrow, hrow, s.T, sum, sq);
            mine[j] += sum;
            mine[s.Hd + j] += sq;
          }
        }
      }
    });
    acc.sum_into(sums.mutable_data_ptr<double>());
  });
  return sums;
}

// Forward: (out (N, Sh, G, H, W), lse (N, G, H, W)).
std::vector<at::Tensor> pairwise_forward(const at::Tensor& center, const at::Tensor& nbpad,
                                         const std::vector<int64_t>& dy, const std::vector<int64_t>& dx,
                                         const at::Tensor& w1, const at::Tensor& w1p, const at::Tensor& pos, const at::Tensor& scale,
                                         const at::Tensor& shift, const at::Tensor& w2, const at::Tensor& b2,
                                         const at::Tensor& vpad) {
  const Shape s = shape_of(center, nbpad, dy, dx, w1, w1p, pos, &w2, &vpad);
  at::Tensor out = at::empty({s.N, s.Sh, s.G, s.H, s.W}, center.options());
  at::Tensor lse = at::empty({s.N, s.G, s.H, s.W}, center.options());
  AT_DISPATCH_FLOATING_TYPES(center.scalar_type(), "pairwise_forward", [&] {
    using S = scalar_t;
    const Gamma<S> gam = gamma_of<S>(s, center, nbpad, dy, dx, w1, w1p, pos);
    const S *pscale = scale.const_data_ptr<S>(), *pshift = shift.const_data_ptr<S>();
    const S *pw2 = w2.const_data_ptr<S>(), *pb2 = b2.const_data_ptr<S>(), *pv = vpad.const_data_ptr<S>();
    S *pout = out.mutable_data_ptr<S>(), *plse = lse.mutable_data_ptr<S>();
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      std::vector<S> u(s.R * s.ld), hid(s.Hd * s.ld), z(s.Hd * s.ld), weights(s.K * s.G * s.ld), lse_b(s.G * s.T),
          inv_total(s.G * s.T);
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t k = 0; k < s.K; ++k) {
          gam.relation(b, k, u.data());
          gam.hidden(k, u.data(), hid.data());
          gam.activation(hid.data(), pscale, pshift, z.data());
          gam.logits(pw2, pb2, z.data(), weights.data() + k * s.G * s.ld);
        }
        // softmax over the offsets per group and pixel: e = exp(logit - peak) in place and the
        // reciprocal of its total, applied once to the aggregated output (no normalizing pass)
        for (int64_t g = 0; g < s.G; ++g) {
          S* __restrict__ peak = lse_b.data() + g * s.T;
          S* __restrict__ total = inv_total.data() + g * s.T;
          std::copy_n(weights.data() + g * s.ld, s.T, peak);
          for (int64_t k = 1; k < s.K; ++k) {
            const S* __restrict__ row = weights.data() + (k * s.G + g) * s.ld;
            for (int64_t t = 0; t < s.T; ++t) peak[t] = row[t] > peak[t] ? row[t] : peak[t];
          }
          std::fill(total, total + s.T, S(0));
          for (int64_t k = 0; k < s.K; ++k) {
            S* __restrict__ row = weights.data() + (k * s.G + g) * s.ld;
            for (int64_t t = 0; t < s.T; ++t) {
              row[t] = vexp(row[t] - peak[t]);
              total[t] += row[t];
            }
          }
          S* __restrict__ lrow = plse + (b * s.G + g) * s.T;
          for (int64_t t = 0; t < s.T; ++t) {
            lrow[t] = peak[t] + std::log(total[t]);
            total[t] = S(1) / total[t];
          }
        }
        // out[b, sh, g] = sum_k e[k, g] * vpad[b, sh, g] shifted by k / total: one output plane at a
        // time, in L1 across the offsets
        for (int64_t sh = 0; sh < s.Sh; ++sh) {
          for (int64_t g = 0; g < s.G; ++g) {
            const S* vg = pv + ((b * s.Sh + sh) * s.G + g) * s.Hp * s.Wp;
            S* __restrict__ og = pout + ((b * s.Sh + sh) * s.G + g) * s.T;
            std::fill(og, og + s.T, S(0));
            for (int64_t k = 0; k < s.K; ++k) {
              const S* wk = weights.data() + (k * s.G + g) * s.ld;
              for (int64_t i = 0; i < s.H; ++i) {
                const S* __restrict__ wrow = wk + i * s.W;
                const S* __restrict__ vrow = vg + (i + dy[k]) * s.Wp + dx[k];
                S* __restrict__ orow = og + i * s.W;
                for (int64_t j = 0; j < s.W; ++j) orow[j] += wrow[j] * vrow[j];
              }
            }
            const S* __restrict__ total = inv_total.data() + g * s.T;
            for (int64_t t = 0; t < s.T; ++t) og[t] *= total[t];
          }
        }
      }
    });
  });
  return {out, lse};
}

// Backward, first pass: the logits' gradients w (gw - D) with gw = <grad_out, v shifted> and
// D = <grad_out, out> per group (softmax backward), gamma's last layer's gradients, v's gradient,
// and the per-channel sums of gz and gz * hid (gz: the gradient at BN2's output through the ReLU)
// that BN2's backward needs. Returns (keep (N, K, G, ld), grad_w2, grad_b2, sums (2, Hd) float64,
// grad_vpad (N, Sh, G, Hp, Wp)).
std::vector<at::Tensor> pairwise_backward_logits(
    const at::Tensor& center, const at::Tensor& nbpad, const std::vector<int64_t>& dy, const std::vector<int64_t>& dx,
    const at::Tensor& w1, const at::Tensor& w1p, const at::Tensor& pos, const at::Tensor& scale, const at::Tensor& shift,
    const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& vpad, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& grad_out) {
  const Shape s = shape_of(center, nbpad, dy, dx, w1, w1p, pos, &w2, &vpad);
  for (auto [t, name] : {std::pair{&out, "out"}, {&grad_out, "grad_out"}}) {
    check_cpu_contiguous(*t, name);
    TORCH_CHECK(t->sizes() == at::IntArrayRef({s.N, s.Sh, s.G, s.H, s.W}), "pairwise ops: ", name, " must be ",
                at::IntArrayRef({s.N, s.Sh, s.G, s.H, s.W}));
  }
  check_cpu_contiguous(lse, "lse");
  at::Tensor keep = at::empty({s.N, s.K, s.G, s.ld}, center.options());  // rows padded like the tiles
  at::Tensor grad_w2 = at::zeros({s.G, s.Hd}, center.options());
  at::Tensor grad_b2 = at::zeros({s.G}, center.options().dtype(at::kDouble));
  at::Tensor sums = at::zeros({2, s.Hd}, center.options().dtype(at::kDouble));
  at::Tensor grad_vpad = at::zeros_like(vpad);
  AT_DISPATCH_FLOATING_TYPES(center.scalar_type(), "pairwise_backward_logits", [&] {
    using S = scalar_t;
    const Gamma<S> gam = gamma_of<S>(s, center, nbpad, dy, dx, w1, w1p, pos);
    const S *pscale = scale.const_data_ptr<S>(), *pshift = shift.const_data_ptr<S>();
    const S *pw2 = w2.const_data_ptr<S>(), *pb2 = b2.const_data_ptr<S>(), *pv = vpad.const_data_ptr<S>();
    const S *pout = out.const_data_ptr<S>(), *pgy = grad_out.const_data_ptr<S>(), *plse = lse.const_data_ptr<S>();
    const at::Tensor w2t_tensor = w2.t().contiguous();
    const S* w2t = w2t_tensor.const_data_ptr<S>();
    S *pkeep = keep.mutable_data_ptr<S>(), *pgv = grad_vpad.mutable_data_ptr<S>();
    PerThread<S> acc_w2(s.G * s.Hd);
    PerThread<double> acc_b2(s.G), acc_sums(2 * s.Hd);
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      std::vector<S> u(s.R * s.ld), hid(s.Hd * s.ld), z(s.Hd * s.ld), gz(s.Hd * s.ld), dot(s.G * s.T);
      std::vector<S>& my_w2 = acc_w2.mine();
      std::vector<double>&my_b2 = acc_b2.mine(), &my_sums = acc_sums.mine();
      for (int64_t b = begin; b < end; ++b) {
        const S* gyb = pgy + b * s.Sh * s.G * s.T;
        // D[g, t] = sum_sh grad_out * out
        std::fill(dot.begin(), dot.end(), S(0));
        for (int64_t sh = 0; sh < s.Sh; ++sh) {
          for (int64_t g = 0; g < s.G; ++g) {
            const S* __restrict__ gy = gyb + (sh * s.G + g) * s.T;
            const S* __restrict__ o = pout + ((b * s.Sh + sh) * s.G + g) * s.T;
            S* __restrict__ d = dot.data() + g * s.T;
            for (int64_t t = 0; t < s.T; ++t) d[t] += gy[t] * o[t];
          }
        }
        for (int64_t k = 0; k < s.K; ++k) {
          S* gl = pkeep + (b * s.K + k) * s.G * s.ld;
          gam.relation(b, k, u.data());
          gam.hidden(k, u.data(), hid.data());
          gam.activation(hid.data(), pscale, pshift, z.data());
          gam.logits(pw2, pb2, z.data(), gl);
          for (int64_t g = 0; g < s.G; ++g) {
            S* __restrict__ w = gl + g * s.ld;  // logits -> softmax weights -> their gradient
            const S* __restrict__ lrow = plse + (b * s.G + g) * s.T;
            const S* __restrict__ d = dot.data() + g * s.T;
            for (int64_t t = 0; t < s.T; ++t) w[t] = vexp(w[t] - lrow[t]);
            // gw = <grad_out, v shifted by k>; grad_vpad shifted by k += w * grad_out
            S* __restrict__ gw = gz.data();  // scratch of T
            std::fill(gw, gw + s.T, S(0));
            for (int64_t sh = 0; sh < s.Sh; ++sh) {
              const S* gy = gyb + (sh * s.G + g) * s.T;
              const int64_t plane = ((b * s.Sh + sh) * s.G + g) * s.Hp * s.Wp;
              for (int64_t i = 0; i < s.H; ++i) {
                const S* __restrict__ gyrow = gy + i * s.W;
                const S* __restrict__ vrow = pv + plane + (i + dy[k]) * s.Wp + dx[k];
                S* __restrict__ gvrow = pgv + plane + (i + dy[k]) * s.Wp + dx[k];
                const S* __restrict__ wrow = w + i * s.W;
                S* __restrict__ gwrow = gw + i * s.W;
                for (int64_t j = 0; j < s.W; ++j) {
                  gwrow[j] += gyrow[j] * vrow[j];
                  gvrow[j] += wrow[j] * gyrow[j];
                }
              }
            }
            S row_sum = 0;
            _Pragma("omp simd reduction(+ : row_sum)")  // see fused::add_sum_and_dot
            for (int64_t t = 0; t < s.T; ++t) {
              w[t] = w[t] * (gw[t] - d[t]);
              row_sum += w[t];
            }
            my_b2[g] += row_sum;
          }
          // gz = (W2^T gl) * (z > 0); grad W2 += gl z^T; BN2's sums
          gemm_nn<S>(s.Hd, s.G, s.T, w2t, s.G, gl, s.ld, gz.data(), s.ld, false);
          gemm_nt<S>(s.G, s.Hd, s.T, gl, s.ld, z.data(), s.ld, my_w2.data(), s.Hd);
          for (int64_t j = 0; j < s.Hd; ++j) {
            S* __restrict__ grow = gz.data() + j * s.ld;
            const S* __restrict__ zrow = z.data() + j * s.ld;
            const S* __restrict__ hrow = hid.data() + j * s.ld;
            for (int64_t t = 0; t < s.T; ++t) grow[t] = zrow[t] > S(0) ? grow[t] : S(0);
            S sum = 0, sum_h = 0;
            fused::add_sum_and_dot(grow, hrow, s.T, sum, sum_h);
            my_sums[j] += sum;
            my_sums[s.Hd + j] += sum_h;
          }
        }
      }
    });
    acc_w2.sum_into(grad_w2.mutable_data_ptr<S>());
    acc_b2.sum_into(grad_b2.mutable_data_ptr<double>());
    acc_sums.sum_into(sums.mutable_data_ptr<double>());
  });
  return {keep, grad_w2, grad_b2, sums, grad_vpad};
}

// Backward, second pass: with BN2's gradient gh = a * gz + c1 * hid + c0 per hidden channel (a, c1, c0
// from the first pass's sums; eval mode: a = scale, c1 = c0 = 0), the gradients of W1, W1p, pos and,
// through the first ReLU, of center and nbpad. Returns (grad_w1, grad_w1p, grad_pos (both empty
// without position channels), grad_center, grad_nbpad).
std::vector<at::Tensor> pairwise_backward_input(
    const at::Tensor& center, const at::Tensor& nbpad, const std::vector<int64_t>& dy, const std::vector<int64_t>& dx,
    const at::Tensor& w1, const at::Tensor& w1p, const at::Tensor& pos, const at::Tensor& scale, const at::Tensor& shift,
    const at::Tensor& w2, const at::Tensor& keep, const at::Tensor& coef_a, const at::Tensor& coef_h,
    const at::Tensor& coef_0) {
  const Shape s = shape_of(center, nbpad, dy, dx, w1, w1p, pos, &w2, nullptr);
  check_cpu_contiguous(keep, "keep");
  TORCH_CHECK(keep.sizes() == at::IntArrayRef({s.N, s.K, s.G, s.ld}), "pairwise ops: keep must be ",
              at::IntArrayRef({s.N, s.K, s.G, s.ld}));
  at::Tensor grad_w1 = at::zeros({s.Hd, s.R}, center.options());
  at::Tensor grad_w1p = s.P ? at::zeros({s.Hd, s.P}, center.options()) : at::Tensor();
  at::Tensor grad_pos = s.P ? at::zeros({s.P, s.K, s.T}, center.options()) : at::Tensor();
  at::Tensor grad_center = at::zeros_like(center);
  at::Tensor grad_nbpad = at::zeros_like(nbpad);
  AT_DISPATCH_FLOATING_TYPES(center.scalar_type(), "pairwise_backward_input", [&] {
    using S = scalar_t;
    const Gamma<S> gam = gamma_of<S>(s, center, nbpad, dy, dx, w1, w1p, pos);
    const S *pscale = scale.const_data_ptr<S>(), *pshift = shift.const_data_ptr<S>();
    const S *pa = coef_a.const_data_ptr<S>(), *ph = coef_h.const_data_ptr<S>(), *p0 = coef_0.const_data_ptr<S>();
    const at::Tensor w2t_tensor = w2.t().contiguous(), w1t_tensor = w1.t().contiguous();
    const S *w2t = w2t_tensor.const_data_ptr<S>(), *w1t = w1t_tensor.const_data_ptr<S>();
    const S* pkeep = keep.const_data_ptr<S>();
    S *pgc = grad_center.mutable_data_ptr<S>(), *pgn = grad_nbpad.mutable_data_ptr<S>();
    const at::Tensor w1pt_tensor = s.P ? w1p.t().contiguous() : at::Tensor();
    const S* w1pt = s.P ? w1pt_tensor.const_data_ptr<S>() : nullptr;
    PerThread<S> acc_w1(s.Hd * s.R), acc_w1p(s.Hd * s.P), acc_pos(s.P * s.K * s.T);
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      std::vector<S> u(s.R * s.ld), hid(s.Hd * s.ld), z(s.Hd * s.ld), gh(s.Hd * s.ld), gu(s.R * s.ld);
      std::vector<S>&my_w1 = acc_w1.mine(), &my_w1p = acc_w1p.mine(), &my_pos = acc_pos.mine();
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t k = 0; k < s.K; ++k) {
          gam.relation(b, k, u.data());
          gam.hidden(k, u.data(), hid.data());
          gam.activation(hid.data(), pscale, pshift, z.data());
          gemm_nn<S>(s.Hd, s.G, s.T, w2t, s.G, pkeep + (b * s.K + k) * s.G * s.ld, s.ld, gh.data(), s.ld, false);
          for (int64_t j = 0; j < s.Hd; ++j) {  // gh = a * gz + c1 * hid + c0
            S* __restrict__ grow = gh.data() + j * s.ld;
            const S* __restrict__ zrow = z.data() + j * s.ld;
            const S* __restrict__ hrow = hid.data() + j * s.ld;
            const S a = pa[j], c1 = ph[j], c0 = p0[j];
            for (int64_t t = 0; t < s.T; ++t) grow[t] = (zrow[t] > S(0) ? a * grow[t] : S(0)) + c1 * hrow[t] + c0;
          }
          if (s.P) {  // grad W1p += gh pos[:, k]^T, grad pos[:, k] += W1p^T gh
            const S* posk = gam.pos + k * s.T;
            gemm_nt<S>(s.Hd, s.P, s.T, gh.data(), s.ld, posk, s.K * s.T, my_w1p.data(), s.P);
            gemm_nn<S>(s.P, s.Hd, s.T, w1pt, s.Hd, gh.data(), s.ld, my_pos.data() + k * s.T, s.K * s.T, true);
          }
          gemm_nt<S>(s.Hd, s.R, s.T, gh.data(), s.ld, u.data(), s.ld, my_w1.data(), s.R);
          gemm_nn<S>(s.R, s.Hd, s.T, w1t, s.Hd, gh.data(), s.ld, gu.data(), s.ld, false);
          for (int64_t c = 0; c < s.R; ++c) {  // through relu(center + nbpad shifted by k)
            for (int64_t i = 0; i < s.H; ++i) {
              const S* __restrict__ grow = gu.data() + c * s.ld + i * s.W;
              const S* __restrict__ urow = u.data() + c * s.ld + i * s.W;
              S* __restrict__ crow = pgc + ((b * s.R + c) * s.H + i) * s.W;
              S* __restrict__ xrow = pgn + ((b * s.R + c) * s.Hp + i + dy[k]) * s.Wp + dx[k];
              for (int64_t j = 0; j < s.W; ++j) {
                const S m = urow[j] > S(0) ? grow[j] : S(0);
                crow[j] += m;
                xrow[j] += m;
              }
            }
          }
        }
      }
    });
    acc_w1.sum_into(grad_w1.mutable_data_ptr<S>());
    if (s.P) {
      acc_w1p.sum_into(grad_w1p.mutable_data_ptr<S>());
      acc_pos.sum_into(grad_pos.mutable_data_ptr<S>());
    }
  });
  return {grad_w1, grad_w1p, grad_pos, grad_center, grad_nbpad};
}

}  // namespace

void register_pairwise_ops(pybind11::module_& m) {
  m.def("pairwise_moments", &pairwise_moments, "BN2's batch sums of SAN pairwise gamma's hidden layer");
  m.def("pairwise_forward", &pairwise_forward, "SAN pairwise attention, fused per (image, offset) tile");
  m.def("pairwise_backward_logits", &pairwise_backward_logits, "first backward pass: logits, W2, b2, v");
  m.def("pairwise_backward_input", &pairwise_backward_input, "second backward pass: W1, P, center, nbpad");
}
