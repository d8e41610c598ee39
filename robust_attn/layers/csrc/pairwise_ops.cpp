// SAN pairwise attention (Zhao, Jia, Koltun, CVPR 2020, eq. 2-3) for the linear relations
// (subtraction, summation), fused per tile of one image and one footprint offset on CPU, so that
// gamma's k^2-expanded tensors never leave the cache. Compiled with the other kernels (module.cpp) by
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
// channels (or empty) W1p (Hd, P) and pos (P, K, T), scale/shift (Hd), W2 (G, Hd), b2 (G),
// vpad (N, Sh, G, Hp, Wp), out (N, Sh, G, H, W), lse (N, G, H, W) the log-sum-exp of the logits,
// keep (N, K, G, ld) the logits' gradients (rows padded to the tiles' stride ld).
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

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  fused::check_cpu_contiguous(t, "pairwise ops", name);
}

// The shape of one call, with every tensor checked against it (v, out: only where given).
Shape shape_of(const at::Tensor& center, const at::Tensor& nbpad, const std::vector<int64_t>& dy,
               const std::vector<int64_t>& dx, const at::Tensor& w1, const at::Tensor& w1p, const at::Tensor& pos,
               const at::Tensor* w2, const at::Tensor* vpad) {
  for (auto [t, name] : {std::pair{&center, "center"}, {&nbpad, "nbpad"}, {&w1, "w1"}}) {
    check_cpu_contiguous(*t, name);
    TORCH_CHECK(t->scalar_type() == center.scalar_type(), "pairwise ops: ", name, " has another dtype");
  }
  TORCH_CHECK(center.dim() == 4 && nbpad.dim() == 4 && w1.dim() == 2,
              "pairwise ops: center, nbpad must be 4-D, w1 2-D");
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

// BN2 as (scale, shift) per hidden channel and gamma's last bias per group.
void check_bn2(const Shape& s, const at::Tensor& scale, const at::Tensor& shift, const at::Tensor& b2,
               const at::Tensor& like) {
  fused::check_operand(scale, {s.Hd}, like, "pairwise ops", "scale");
  fused::check_operand(shift, {s.Hd}, like, "pairwise ops", "shift");
  fused::check_operand(b2, {s.G}, like, "pairwise ops", "b2");
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

  // u, hid and z of tile (b, k)
  void hidden_tile(int64_t b, int64_t k, const S* scale, const S* shift, S* u, S* hid, S* z) const {
    relation(b, k, u);
    hidden(k, u, hid);
    activation(hid, scale, shift, z);
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
                            const std::vector<int64_t>& dx, const at::Tensor& w1, const at::Tensor& w1p,
                            const at::Tensor& pos) {
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
                                         const at::Tensor& w1, const at::Tensor& w1p, const at::Tensor& pos,
                                         const at::Tensor& scale, const at::Tensor& shift, const at::Tensor& w2,
                                         const at::Tensor& b2, const at::Tensor& vpad) {
  const Shape s = shape_of(center, nbpad, dy, dx, w1, w1p, pos, &w2, &vpad);
  check_bn2(s, scale, shift, b2, center);
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
          gam.hidden_tile(b, k, pscale, pshift, u.data(), hid.data(), z.data());
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

// The backward passes. Per tile, logit_grads: the logits' gradients w (gw - D) with gw = <grad_out, v
// shifted> and D = <grad_out, out> per group (softmax backward), v's and gamma's last layer's
// gradients, gz (the gradient at BN2's output through its ReLU) and BN2's per-channel sums of gz and
// gz * hid; input_grads: from BN2's input gradient gh, W1's and the position channels' gradients and,
// through the first ReLU, center's and nbpad's. With BN2 on batch statistics gh = a * gz + c1 * hid +
// c0 needs the sums over every tile first: two passes, the first keeping the logits' gradients. On
// running statistics gh = scale * gz: one pass. Without weight_grads (an attack: frozen parameters)
// the weights' gradients are skipped.
template <typename S>
struct Backward {
  Gamma<S> gam;
  const S *scale, *shift, *w2, *b2, *w2t, *w1t, *w1pt, *vpad, *out, *grad_out, *lse;
  bool weight_grads;
  S *grad_vpad, *grad_center, *grad_nbpad;
  PerThread<S> w1_part, w1p_part, pos_part, w2_part;
  PerThread<double> b2_part, sums_part;

  Backward(const Gamma<S>& g, bool weight_grads)
      : gam(g), weight_grads(weight_grads), w1_part(weight_grads ? g.s.Hd * g.s.R : 0),
        w1p_part(weight_grads ? g.s.Hd * g.s.P : 0), pos_part(weight_grads ? g.s.P * g.s.K * g.s.T : 0),
        w2_part(weight_grads ? g.s.G * g.s.Hd : 0), b2_part(g.s.G), sums_part(2 * g.s.Hd) {}

  // D[g, t] = sum_sh grad_out * out for image b
  void softmax_dot(int64_t b, S* __restrict__ dot) const {
    const Shape& s = gam.s;
    std::fill(dot, dot + s.G * s.T, S(0));
    for (int64_t sh = 0; sh < s.Sh; ++sh) {
      for (int64_t g = 0; g < s.G; ++g) {
        const S* __restrict__ gy = grad_out + ((b * s.Sh + sh) * s.G + g) * s.T;
        const S* __restrict__ o = out + ((b * s.Sh + sh) * s.G + g) * s.T;
        S* __restrict__ d = dot + g * s.T;
        for (int64_t t = 0; t < s.T; ++t) d[t] += gy[t] * o[t];
      }
    }
  }

  // u, hid, the logits' gradients gl (G rows of stride ld) and the masked gz of tile (b, k)
  void logit_grads(int64_t b, int64_t k, const S* dot, S* u, S* hid, S* z, S* gl, S* gz) {
    const Shape& s = gam.s;
    gam.hidden_tile(b, k, scale, shift, u, hid, z);
    gam.logits(w2, b2, z, gl);
    std::vector<double>& my_b2 = b2_part.mine();
    for (int64_t g = 0; g < s.G; ++g) {
      S* __restrict__ w = gl + g * s.ld;  // logits -> softmax weights -> their gradient
      const S* __restrict__ lrow = lse + (b * s.G + g) * s.T;
      const S* __restrict__ d = dot + g * s.T;
      for (int64_t t = 0; t < s.T; ++t) w[t] = vexp(w[t] - lrow[t]);
      // gw = <grad_out, v shifted by k>; grad_vpad shifted by k += w * grad_out
      S* __restrict__ gw = gz;  // scratch of T
      std::fill(gw, gw + s.T, S(0));
      for (int64_t sh = 0; sh < s.Sh; ++sh) {
        const S* gy = grad_out + ((b * s.Sh + sh) * s.G + g) * s.T;
        const int64_t plane = ((b * s.Sh + sh) * s.G + g) * s.Hp * s.Wp;
        for (int64_t i = 0; i < s.H; ++i) {
          const S* __restrict__ gyrow = gy + i * s.W;
          const S* __restrict__ vrow = vpad + plane + (i + gam.dy[k]) * s.Wp + gam.dx[k];
          S* __restrict__ gvrow = grad_vpad + plane + (i + gam.dy[k]) * s.Wp + gam.dx[k];
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
    gemm_nn<S>(s.Hd, s.G, s.T, w2t, s.G, gl, s.ld, gz, s.ld, false);
    if (weight_grads) gemm_nt<S>(s.G, s.Hd, s.T, gl, s.ld, z, s.ld, w2_part.mine().data(), s.Hd);
    std::vector<double>& my_sums = sums_part.mine();
    for (int64_t j = 0; j < s.Hd; ++j) {
      S* __restrict__ grow = gz + j * s.ld;
      const S* __restrict__ zrow = z + j * s.ld;
      for (int64_t t = 0; t < s.T; ++t) grow[t] = zrow[t] > S(0) ? grow[t] : S(0);
      S sum = 0, sum_h = 0;
      fused::add_sum_and_dot(grow, hid + j * s.ld, s.T, sum, sum_h);
      my_sums[j] += sum;
      my_sums[s.Hd + j] += sum_h;
    }
  }

  // From gh (BN2's input gradient) of tile (b, k) with its u: W1's and the positions' gradients,
  // and center's and nbpad's through relu(center + nbpad shifted by k)
  void input_grads(int64_t b, int64_t k, const S* u, const S* gh, S* gu) {
    const Shape& s = gam.s;
    if (weight_grads) {
      gemm_nt<S>(s.Hd, s.R, s.T, gh, s.ld, u, s.ld, w1_part.mine().data(), s.R);
      if (s.P) {  // grad W1p += gh pos[:, k]^T, grad pos[:, k] += W1p^T gh
        gemm_nt<S>(s.Hd, s.P, s.T, gh, s.ld, gam.pos + k * s.T, s.K * s.T, w1p_part.mine().data(), s.P);
        gemm_nn<S>(s.P, s.Hd, s.T, w1pt, s.Hd, gh, s.ld, pos_part.mine().data() + k * s.T, s.K * s.T, true);
      }
    }
    gemm_nn<S>(s.R, s.Hd, s.T, w1t, s.Hd, gh, s.ld, gu, s.ld, false);
    for (int64_t c = 0; c < s.R; ++c) {
      for (int64_t i = 0; i < s.H; ++i) {
        const S* __restrict__ grow = gu + c * s.ld + i * s.W;
        const S* __restrict__ urow = u + c * s.ld + i * s.W;
        S* __restrict__ crow = grad_center + ((b * s.R + c) * s.H + i) * s.W;
        S* __restrict__ xrow = grad_nbpad + ((b * s.R + c) * s.Hp + i + gam.dy[k]) * s.Wp + gam.dx[k];
        for (int64_t j = 0; j < s.W; ++j) {
          const S m = urow[j] > S(0) ? grow[j] : S(0);
          crow[j] += m;
          xrow[j] += m;
        }
      }
    }
  }
};

// The tensors both passes return, zero-initialized (weights' gradients undefined without weight_grads).
struct Grads {
  at::Tensor w1, w1p, pos, w2, b2, sums, vpad, center, nbpad;
  Grads(const Shape& s, const at::Tensor& center_, const at::Tensor& nbpad_, const at::Tensor* vpad_, bool weights) {
    const auto opt = center_.options();
    if (weights) {
      w1 = at::zeros({s.Hd, s.R}, opt);
      w2 = at::zeros({s.G, s.Hd}, opt);
      if (s.P) {
        w1p = at::zeros({s.Hd, s.P}, opt);
        pos = at::zeros({s.P, s.K, s.T}, opt);
      }
    }
    b2 = at::zeros({s.G}, opt.dtype(at::kDouble));
    sums = at::zeros({2, s.Hd}, opt.dtype(at::kDouble));
    if (vpad_ != nullptr) vpad = at::zeros_like(*vpad_);
    center = at::zeros_like(center_);
    nbpad = at::zeros_like(nbpad_);
  }
};

template <typename S>
void bind(Backward<S>& bw, Grads& grads) {
  bw.grad_vpad = grads.vpad.defined() ? grads.vpad.template mutable_data_ptr<S>() : nullptr;
  bw.grad_center = grads.center.template mutable_data_ptr<S>();
  bw.grad_nbpad = grads.nbpad.template mutable_data_ptr<S>();
}

template <typename S>
void collect(Backward<S>& bw, Grads& grads) {
  if (bw.weight_grads) {
    bw.w1_part.sum_into(grads.w1.template mutable_data_ptr<S>());
    bw.w2_part.sum_into(grads.w2.template mutable_data_ptr<S>());
    if (bw.gam.s.P) {
      bw.w1p_part.sum_into(grads.w1p.template mutable_data_ptr<S>());
      bw.pos_part.sum_into(grads.pos.template mutable_data_ptr<S>());
    }
  }
  bw.b2_part.sum_into(grads.b2.template mutable_data_ptr<double>());
  bw.sums_part.sum_into(grads.sums.template mutable_data_ptr<double>());
}

// Backward, first (and with one_pass, only) pass. Returns (keep (N, K, G, ld) or undefined with
// one_pass, grad_w2, grad_b2 (float64), sums (2, Hd) float64, grad_vpad, then with one_pass grad_w1,
// grad_w1p, grad_pos, grad_center, grad_nbpad); gradients of weights undefined without weight_grads.
std::vector<at::Tensor> pairwise_backward(
    const at::Tensor& center, const at::Tensor& nbpad, const std::vector<int64_t>& dy, const std::vector<int64_t>& dx,
    const at::Tensor& w1, const at::Tensor& w1p, const at::Tensor& pos, const at::Tensor& scale,
    const at::Tensor& shift, const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& vpad,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& grad_out, bool weight_grads, bool one_pass) {
  const Shape s = shape_of(center, nbpad, dy, dx, w1, w1p, pos, &w2, &vpad);
  check_bn2(s, scale, shift, b2, center);
  fused::check_operand(out, {s.N, s.Sh, s.G, s.H, s.W}, center, "pairwise ops", "out");
  fused::check_operand(grad_out, {s.N, s.Sh, s.G, s.H, s.W}, center, "pairwise ops", "grad_out");
  fused::check_operand(lse, {s.N, s.G, s.H, s.W}, center, "pairwise ops", "lse");
  at::Tensor keep = one_pass ? at::Tensor() : at::empty({s.N, s.K, s.G, s.ld}, center.options());
  Grads grads(s, center, nbpad, &vpad, weight_grads);
  AT_DISPATCH_FLOATING_TYPES(center.scalar_type(), "pairwise_backward", [&] {
    using S = scalar_t;
    Backward<S> bw(gamma_of<S>(s, center, nbpad, dy, dx, w1, w1p, pos), weight_grads);
    const at::Tensor w2t = w2.t().contiguous(), w1t = w1.t().contiguous();
    const at::Tensor w1pt = s.P ? w1p.t().contiguous() : at::Tensor();
    bw.scale = scale.const_data_ptr<S>(); bw.shift = shift.const_data_ptr<S>();
    bw.w2 = w2.const_data_ptr<S>(); bw.b2 = b2.const_data_ptr<S>(); bw.w2t = w2t.const_data_ptr<S>();
    bw.w1t = w1t.const_data_ptr<S>(); bw.w1pt = s.P ? w1pt.const_data_ptr<S>() : nullptr;
    bw.vpad = vpad.const_data_ptr<S>(); bw.out = out.const_data_ptr<S>();
    bw.grad_out = grad_out.const_data_ptr<S>(); bw.lse = lse.const_data_ptr<S>();
    bind(bw, grads);
    S* pkeep = one_pass ? nullptr : keep.mutable_data_ptr<S>();
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      std::vector<S> u(s.R * s.ld), hid(s.Hd * s.ld), z(s.Hd * s.ld), gz(s.Hd * s.ld), gu(s.R * s.ld),
          gl(one_pass ? s.G * s.ld : 0), dot(s.G * s.T);
      for (int64_t b = begin; b < end; ++b) {
        bw.softmax_dot(b, dot.data());
        for (int64_t k = 0; k < s.K; ++k) {
          S* glk = one_pass ? gl.data() : pkeep + (b * s.K + k) * s.G * s.ld;
          bw.logit_grads(b, k, dot.data(), u.data(), hid.data(), z.data(), glk, gz.data());
          if (!one_pass) continue;
          for (int64_t j = 0; j < s.Hd; ++j) {  // gh = scale * gz (BN2 on running statistics)
            S* __restrict__ grow = gz.data() + j * s.ld;
            for (int64_t t = 0; t < s.T; ++t) grow[t] *= bw.scale[j];
          }
          bw.input_grads(b, k, u.data(), gz.data(), gu.data());
        }
      }
    });
    collect(bw, grads);
  });
  if (!one_pass) return {keep, grads.w2, grads.b2, grads.sums, grads.vpad};
  return {keep, grads.w2, grads.b2, grads.sums, grads.vpad, grads.w1, grads.w1p, grads.pos, grads.center, grads.nbpad};
}

// Backward, second pass (batch statistics): with BN2's gradient gh = a * gz + c1 * hid + c0 per hidden
// channel (a, c1, c0 from the first pass's sums). Returns (grad_w1, grad_w1p, grad_pos, grad_center,
// grad_nbpad); gradients of weights undefined without weight_grads, of positions without them.
std::vector<at::Tensor> pairwise_backward_input(
    const at::Tensor& center, const at::Tensor& nbpad, const std::vector<int64_t>& dy, const std::vector<int64_t>& dx,
    const at::Tensor& w1, const at::Tensor& w1p, const at::Tensor& pos, const at::Tensor& scale,
    const at::Tensor& shift, const at::Tensor& w2, const at::Tensor& keep, const at::Tensor& coef_a,
    const at::Tensor& coef_h, const at::Tensor& coef_0, bool weight_grads) {
  const Shape s = shape_of(center, nbpad, dy, dx, w1, w1p, pos, &w2, nullptr);
  fused::check_operand(keep, {s.N, s.K, s.G, s.ld}, center, "pairwise ops", "keep");
  for (auto [t, name] : {std::pair{&scale, "scale"}, {&shift, "shift"}, {&coef_a, "coef_a"}, {&coef_h, "coef_h"},
                         {&coef_0, "coef_0"}}) {
    fused::check_operand(*t, {s.Hd}, center, "pairwise ops", name);
  }
  Grads grads(s, center, nbpad, nullptr, weight_grads);
  AT_DISPATCH_FLOATING_TYPES(center.scalar_type(), "pairwise_backward_input", [&] {
    using S = scalar_t;
    Backward<S> bw(gamma_of<S>(s, center, nbpad, dy, dx, w1, w1p, pos), weight_grads);
    const at::Tensor w2t = w2.t().contiguous(), w1t = w1.t().contiguous();
    const at::Tensor w1pt = s.P ? w1p.t().contiguous() : at::Tensor();
    bw.w1t = w1t.const_data_ptr<S>(); bw.w1pt = s.P ? w1pt.const_data_ptr<S>() : nullptr;
    bind(bw, grads);
    const S *pscale = scale.const_data_ptr<S>(), *pshift = shift.const_data_ptr<S>();
    const S *pa = coef_a.const_data_ptr<S>(), *ph = coef_h.const_data_ptr<S>(), *p0 = coef_0.const_data_ptr<S>();
    const S* pkeep = keep.const_data_ptr<S>();
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      std::vector<S> u(s.R * s.ld), hid(s.Hd * s.ld), z(s.Hd * s.ld), gh(s.Hd * s.ld), gu(s.R * s.ld);
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t k = 0; k < s.K; ++k) {
          bw.gam.hidden_tile(b, k, pscale, pshift, u.data(), hid.data(), z.data());
          gemm_nn<S>(s.Hd, s.G, s.T, w2t.const_data_ptr<S>(), s.G, pkeep + (b * s.K + k) * s.G * s.ld, s.ld,
                     gh.data(), s.ld, false);
          for (int64_t j = 0; j < s.Hd; ++j) {  // gh = a * gz + c1 * hid + c0
            S* __restrict__ grow = gh.data() + j * s.ld;
            const S* __restrict__ zrow = z.data() + j * s.ld;
            const S* __restrict__ hrow = hid.data() + j * s.ld;
            const S a = pa[j], c1 = ph[j], c0 = p0[j];
            for (int64_t t = 0; t < s.T; ++t) grow[t] = (zrow[t] > S(0) ? a * grow[t] : S(0)) + c1 * hrow[t] + c0;
          }
          bw.input_grads(b, k, u.data(), gh.data(), gu.data());
        }
      }
    });
    collect(bw, grads);
  });
  return {grads.w1, grads.w1p, grads.pos, grads.center, grads.nbpad};
}

}  // namespace

void register_pairwise_ops(pybind11::module_& m) {
  m.def("pairwise_moments", &pairwise_moments, "BN2's batch sums of SAN pairwise gamma's hidden layer");
  m.def("pairwise_forward", &pairwise_forward, "SAN pairwise attention, fused per (image, offset) tile");
  m.def("pairwise_backward", &pairwise_backward, "backward, first (or only) pass: logits, W2, b2, v, sums");
  m.def("pairwise_backward_input", &pairwise_backward_input, "second backward pass: W1, positions, center, nbpad");
}
