// SAN patchwise attention with the concatenation relation (Zhao, Jia, Koltun, CVPR 2020, eq. 4-5):
// the psi part of gamma's first layer, fused per tile of one image and one footprint offset on CPU,
// so the k^2-expanded input of that layer (C/r1 channels per offset) never exists in memory.
// Compiled with the other kernels (module.cpp) by robust_attn/layers/cpu_kernels.py;
// robust_attn/layers/san.py's chunked PyTorch path computes the same function.
//
// gamma's first BN-ReLU-linear on the concatenation [phi(x_i), psi(x_j) for the k^2 offsets j]
// splits into a phi part (one map, left to PyTorch) and, per image b and offset j with window f_j
// (R x T: psi(x) of image b shifted by j, from the reflection-padded xpad (N, R, Hp, Wp)):
//   u_j = relu(scale[:, j] * f_j + shift[:, j])     BN1 of channel (c, j) and its ReLU
//   hid += W1_j u_j                                 W1_j = W1[:, c * K + j] as (G x R)
// BN1's moments per channel (c, j) are sums over the window f_j. The backward passes recompute u_j:
// gu_j = (W1_j^T grad_hid) * (u_j > 0) gives W1_j's gradient and BN1's per-channel sums; then
// grad f_j = a * gu_j + c1 * f_j + c0 (BN1 in closed form) is folded back into grad_xpad.
//
// Tensors (contiguous): xpad (N, R, Hp, Wp), scale/shift and coefficients (R, K), w1 (K, G, R) (W1
// regrouped by offset), hid and grad_hid (N, G, H, W).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "common.h"
#include "small_gemm.h"

namespace {

using fused::PerThread;
using small_gemm::gemm_nn;
using small_gemm::gemm_nt;

struct Shape {
  int64_t N, R, G, H, W, Hp, Wp, K, T, ld;
};

Shape shape_of(const at::Tensor& xpad, const std::vector<int64_t>& dy, const std::vector<int64_t>& dx, int64_t H,
               int64_t W, const at::Tensor* w1) {
  fused::check_cpu_contiguous(xpad, "patchwise ops", "xpad");
  TORCH_CHECK(xpad.dim() == 4, "patchwise ops: xpad must be (N, R, Hp, Wp), got ", xpad.sizes());
  Shape s{xpad.size(0), xpad.size(1), 0, H, W, xpad.size(2), xpad.size(3), static_cast<int64_t>(dy.size()), H * W,
          fused::tile_stride(H * W)};
  fused::check_windows(dy, dx, H, W, s.Hp, s.Wp, "patchwise ops");
  if (w1 != nullptr) {
    fused::check_cpu_contiguous(*w1, "patchwise ops", "w1");
    TORCH_CHECK(w1->dim() == 3 && w1->size(0) == s.K && w1->size(2) == s.R && w1->scalar_type() == xpad.scalar_type(),
                "patchwise ops: w1 must be (K, G, R) = (", s.K, ", G, ", s.R, ") of xpad's dtype, got ", w1->sizes());
    s.G = w1->size(1);
  }
  return s;
}

void check_per_channel(const Shape& s, const at::Tensor& t, const char* name, const at::Tensor& like) {
  fused::check_operand(t, {s.R, s.K}, like, "patchwise ops", name);
}

// u = relu(scale[:, j] * f_j + shift[:, j]) for image b, offset j (rows of stride s.ld)
template <typename S>
void relation(const Shape& s, const S* xpad, const int64_t* dy, const int64_t* dx, const S* scale, const S* shift,
              int64_t b, int64_t j, S* __restrict__ u) {
  for (int64_t c = 0; c < s.R; ++c) {
    const S a = scale[c * s.K + j], t0 = shift[c * s.K + j];
    for (int64_t i = 0; i < s.H; ++i) {
      const S* __restrict__ xrow = xpad + ((b * s.R + c) * s.Hp + i + dy[j]) * s.Wp + dx[j];
      S* __restrict__ urow = u + c * s.ld + i * s.W;
      for (int64_t q = 0; q < s.W; ++q) {
        const S v = a * xrow[q] + t0;
        urow[q] = v > S(0) ? v : S(0);
      }
    }
  }
}

// BN1's batch moments of the psi channels: (2, R, K) float64 sums of f_j and f_j^2 per (c, j).
at::Tensor patchwise_moments(const at::Tensor& xpad, const std::vector<int64_t>& dy, const std::vector<int64_t>& dx,
                             int64_t H, int64_t W) {
  const Shape s = shape_of(xpad, dy, dx, H, W, nullptr);
  at::Tensor sums = at::zeros({2, s.R, s.K}, xpad.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(xpad.scalar_type(), "patchwise_moments", [&] {
    using S = scalar_t;
    const S* px = xpad.const_data_ptr<S>();
    PerThread<double> acc(2 * s.R * s.K);
    at::parallel_for(0, s.N * s.R, 1, [&](int64_t begin, int64_t end) {
      std::vector<double>& mine = acc.mine();
      for (int64_t bc = begin; bc < end; ++bc) {
        const int64_t c = bc % s.R;
        for (int64_t j = 0; j < s.K; ++j) {
          S sum = 0, sq = 0;
          for (int64_t i = 0; i < s.H; ++i) {
            const S* xrow = px + (bc * s.Hp + i + dy[j]) * s.Wp + dx[j];
            fused::add_sum_and_dot(xrow, xrow, s.W, sum, sq);
          }
          mine[c * s.K + j] += sum;
          mine[(s.R + c) * s.K + j] += sq;
        }
      }
    });
    acc.sum_into(sums.mutable_data_ptr<double>());
  });
  return sums;
}

// hid (N, G, H, W) = sum_j W1_j relu(scale[:, j] * f_j + shift[:, j])
at::Tensor patchwise_hidden(const at::Tensor& xpad, const std::vector<int64_t>& dy, const std::vector<int64_t>& dx,
                            int64_t H, int64_t W, const at::Tensor& scale, const at::Tensor& shift,
                            const at::Tensor& w1) {
  const Shape s = shape_of(xpad, dy, dx, H, W, &w1);
  check_per_channel(s, scale, "scale", xpad);
  check_per_channel(s, shift, "shift", xpad);
  at::Tensor hid = at::empty({s.N, s.G, H, W}, xpad.options());
  AT_DISPATCH_FLOATING_TYPES(xpad.scalar_type(), "patchwise_hidden", [&] {
    using S = scalar_t;
    const S *px = xpad.const_data_ptr<S>(), *pa = scale.const_data_ptr<S>(), *pt = shift.const_data_ptr<S>();
    const S* pw = w1.const_data_ptr<S>();
    S* ph = hid.mutable_data_ptr<S>();
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      std::vector<S> u(s.R * s.ld), acc(s.G * s.ld);
      for (int64_t b = begin; b < end; ++b) {
        std::fill(acc.begin(), acc.end(), S(0));
        for (int64_t j = 0; j < s.K; ++j) {
          relation(s, px, dy.data(), dx.data(), pa, pt, b, j, u.data());
          gemm_nn<S>(s.G, s.R, s.T, pw + j * s.G * s.R, s.R, u.data(), s.ld, acc.data(), s.ld, true);
        }
        for (int64_t g = 0; g < s.G; ++g) std::copy_n(acc.data() + g * s.ld, s.T, ph + (b * s.G + g) * s.T);
      }
    });
  });
  return hid;
}

// The two backward passes share the tile of gu_j = (W1_j^T grad_hid) * (u_j > 0).
template <typename S>
struct Backward {
  Shape s;
  const S *xpad, *scale, *shift, *w1t, *grad_hid;  // w1t: (K, R, G)
  const int64_t *dy, *dx;

  // grad_hid of image b into a tile of stride s.ld
  void load_grad(int64_t b, S* __restrict__ gh) const {
    for (int64_t g = 0; g < s.G; ++g) std::copy_n(grad_hid + (b * s.G + g) * s.T, s.T, gh + g * s.ld);
  }
  void masked_grad(int64_t b, int64_t j, const S* gh, S* __restrict__ u, S* __restrict__ gu) const {
    relation(s, xpad, dy, dx, scale, shift, b, j, u);
    gemm_nn<S>(s.R, s.G, s.T, w1t + j * s.R * s.G, s.G, gh, s.ld, gu, s.ld, false);
    for (int64_t c = 0; c < s.R; ++c) {
      S* __restrict__ grow = gu + c * s.ld;
      const S* __restrict__ urow = u + c * s.ld;
      for (int64_t t = 0; t < s.T; ++t) grow[t] = urow[t] > S(0) ? grow[t] : S(0);
    }
  }
  const S* window_row(int64_t b, int64_t c, int64_t j, int64_t i) const {
    return xpad + ((b * s.R + c) * s.Hp + i + dy[j]) * s.Wp + dx[j];
  }
};

template <typename S>
Backward<S> backward_of(const Shape& s, const at::Tensor& xpad, const std::vector<int64_t>& dy,
                        const std::vector<int64_t>& dx, const at::Tensor& scale, const at::Tensor& shift,
                        const at::Tensor& w1t, const at::Tensor& grad_hid) {
  return Backward<S>{s, xpad.const_data_ptr<S>(), scale.const_data_ptr<S>(), shift.const_data_ptr<S>(),
                     w1t.const_data_ptr<S>(), grad_hid.const_data_ptr<S>(), dy.data(), dx.data()};
}

void check_grad_hid(const Shape& s, const at::Tensor& grad_hid, const at::Tensor& xpad) {
  fused::check_operand(grad_hid, {s.N, s.G, s.H, s.W}, xpad, "patchwise ops", "grad_hid");
}

// First backward pass: (grad_w1 (K, G, R), undefined without weight_grads, sums (2, R, K) float64 of
// gu_j and gu_j * f_j per (c, j)). Not needed in eval mode with frozen parameters (an attack).
std::vector<at::Tensor> patchwise_backward_sums(const at::Tensor& xpad, const std::vector<int64_t>& dy,
                                                const std::vector<int64_t>& dx, int64_t H, int64_t W,
                                                const at::Tensor& scale, const at::Tensor& shift,
                                                const at::Tensor& w1, const at::Tensor& grad_hid, bool weight_grads) {
  const Shape s = shape_of(xpad, dy, dx, H, W, &w1);
  check_per_channel(s, scale, "scale", xpad);
  check_per_channel(s, shift, "shift", xpad);
  check_grad_hid(s, grad_hid, xpad);
  at::Tensor grad_w1 = weight_grads ? at::zeros_like(w1) : at::Tensor();
  at::Tensor sums = at::zeros({2, s.R, s.K}, xpad.options().dtype(at::kDouble));
  const at::Tensor w1t = w1.transpose(1, 2).contiguous();
  AT_DISPATCH_FLOATING_TYPES(xpad.scalar_type(), "patchwise_backward_sums", [&] {
    using S = scalar_t;
    const Backward<S> bw = backward_of<S>(s, xpad, dy, dx, scale, shift, w1t, grad_hid);
    PerThread<S> acc_w1(weight_grads ? s.K * s.G * s.R : 0);
    PerThread<double> acc_sums(2 * s.R * s.K);
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      std::vector<S> gh(s.G * s.ld), u(s.R * s.ld), gu(s.R * s.ld);
      std::vector<S>& my_w1 = acc_w1.mine();
      std::vector<double>& my_sums = acc_sums.mine();
      for (int64_t b = begin; b < end; ++b) {
        bw.load_grad(b, gh.data());
        for (int64_t j = 0; j < s.K; ++j) {
          bw.masked_grad(b, j, gh.data(), u.data(), gu.data());
          if (weight_grads)
            gemm_nt<S>(s.G, s.R, s.T, gh.data(), s.ld, u.data(), s.ld, my_w1.data() + j * s.G * s.R, s.R);
          for (int64_t c = 0; c < s.R; ++c) {
            S sum = 0, sum_f = 0;
            for (int64_t i = 0; i < s.H; ++i)
              fused::add_sum_and_dot(gu.data() + c * s.ld + i * s.W, bw.window_row(b, c, j, i), s.W, sum, sum_f);
            my_sums[c * s.K + j] += sum;
            my_sums[(s.R + c) * s.K + j] += sum_f;
          }
        }
      }
    });
    if (weight_grads) acc_w1.sum_into(grad_w1.mutable_data_ptr<S>());
    acc_sums.sum_into(sums.mutable_data_ptr<double>());
  });
  return {grad_w1, sums};
}

// Second backward pass: grad_xpad (N, R, Hp, Wp) with grad f_j = a * gu_j + c1 * f_j + c0 per (c, j)
// (BN1's backward; eval mode: a = scale, c1 = c0 = 0) folded into the padded map.
at::Tensor patchwise_backward_input(const at::Tensor& xpad, const std::vector<int64_t>& dy,
                                    const std::vector<int64_t>& dx, int64_t H, int64_t W, const at::Tensor& scale,
                                    const at::Tensor& shift, const at::Tensor& w1, const at::Tensor& grad_hid,
                                    const at::Tensor& coef_a, const at::Tensor& coef_f, const at::Tensor& coef_0) {
  const Shape s = shape_of(xpad, dy, dx, H, W, &w1);
  for (auto [t, name] : {std::pair{&scale, "scale"}, {&shift, "shift"}, {&coef_a, "coef_a"}, {&coef_f, "coef_f"},
                         {&coef_0, "coef_0"}}) {
    check_per_channel(s, *t, name, xpad);
  }
  check_grad_hid(s, grad_hid, xpad);
  at::Tensor grad_xpad = at::zeros_like(xpad);
  const at::Tensor w1t = w1.transpose(1, 2).contiguous();
  AT_DISPATCH_FLOATING_TYPES(xpad.scalar_type(), "patchwise_backward_input", [&] {
    using S = scalar_t;
    const Backward<S> bw = backward_of<S>(s, xpad, dy, dx, scale, shift, w1t, grad_hid);
    const S *pa = coef_a.const_data_ptr<S>(), *pf = coef_f.const_data_ptr<S>(), *p0 = coef_0.const_data_ptr<S>();
    S* pg = grad_xpad.mutable_data_ptr<S>();
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      std::vector<S> gh(s.G * s.ld), u(s.R * s.ld), gu(s.R * s.ld);
      for (int64_t b = begin; b < end; ++b) {
        bw.load_grad(b, gh.data());
        for (int64_t j = 0; j < s.K; ++j) {
          bw.masked_grad(b, j, gh.data(), u.data(), gu.data());
          for (int64_t c = 0; c < s.R; ++c) {
            const S a = pa[c * s.K + j], c1 = pf[c * s.K + j], c0 = p0[c * s.K + j];
            for (int64_t i = 0; i < s.H; ++i) {
              const S* __restrict__ grow = gu.data() + c * s.ld + i * s.W;
              const S* __restrict__ frow = bw.window_row(b, c, j, i);
              S* __restrict__ xrow = pg + ((b * s.R + c) * s.Hp + i + dy[j]) * s.Wp + dx[j];
              for (int64_t q = 0; q < s.W; ++q) xrow[q] += a * grow[q] + c1 * frow[q] + c0;
            }
          }
        }
      }
    });
  });
  return grad_xpad;
}

}  // namespace

void register_patchwise_ops(pybind11::module_& m) {
  m.def("patchwise_moments", &patchwise_moments, "BN1's batch sums of SAN patchwise concatenation's psi channels");
  m.def("patchwise_hidden", &patchwise_hidden, "psi part of SAN patchwise concatenation gamma's first layer");
  m.def("patchwise_backward_sums", &patchwise_backward_sums, "first backward pass: W1, BN1's sums");
  m.def("patchwise_backward_input", &patchwise_backward_input, "second backward pass: the padded psi map");
}
