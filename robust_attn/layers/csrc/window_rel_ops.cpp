// SASA's logits (Ramachandran et al. 2019, Eq. 3) in one pass over the footprint offsets: the content
// term q . k_o and the relative term q . r_o together, so the relative term costs no pass of its own
// over the k*k logits. Compiled with window_ops.cpp (see module.cpp) by robust_attn/layers/cpu_kernels.py,
// whose window_dot_rel_torch computes the same function.
//
// Layouts as in window_ops.cpp (any strides, last dim contiguous), plus rel (G, D, K) contiguous:
//   window_dot_rel  out[o, b, g, i, j] = sum_d a[b, g, d, i, j] * (bpad[b, g, d, i + dy_o, j + dx_o] + rel[g, d, o])
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

void check_5d_rel(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "window_dot_rel: ", name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 5, "window_dot_rel: ", name, " must be 5-D, got ", t.sizes());
  TORCH_CHECK(t.stride(4) == 1 || t.size(4) == 1, "window_dot_rel: ", name, "'s last dim must be contiguous");
}

void window_dot_rel(const at::Tensor& a, const at::Tensor& bpad, const at::Tensor& rel,
                    const std::vector<int64_t>& dy, const std::vector<int64_t>& dx, at::Tensor& out) {
  check_5d_rel(a, "a"); check_5d_rel(bpad, "bpad"); check_5d_rel(out, "out");
  const int64_t B = a.size(0), G = a.size(1), D = a.size(2), H = a.size(3), W = a.size(4);
  const int64_t K = static_cast<int64_t>(dy.size());
  TORCH_CHECK(dx.size() == dy.size(), "window_dot_rel: dy and dx differ in length");
  TORCH_CHECK(a.scalar_type() == bpad.scalar_type() && a.scalar_type() == out.scalar_type() &&
              a.scalar_type() == rel.scalar_type(), "window_dot_rel: dtypes differ");
  TORCH_CHECK(rel.device().is_cpu() && rel.is_contiguous() && rel.sizes() == at::IntArrayRef({G, D, K}),
              "window_dot_rel: rel must be a contiguous CPU tensor of shape ", at::IntArrayRef({G, D, K}),
              ", got ", rel.sizes());
  TORCH_CHECK(out.sizes() == at::IntArrayRef({K, B, G, H, W}), "window_dot_rel: out must be ",
              at::IntArrayRef({K, B, G, H, W}));
  TORCH_CHECK(bpad.size(0) == B && bpad.size(1) == G && bpad.size(2) == D, "window_dot_rel: bpad ", bpad.sizes(),
              " does not match a ", a.sizes());
  for (int64_t o = 0; o < K; ++o) {
    TORCH_CHECK(dy[o] >= 0 && dx[o] >= 0 && dy[o] + H <= bpad.size(3) && dx[o] + W <= bpad.size(4),
                "window_dot_rel: offset (", dy[o], ", ", dx[o], ") leaves the padded map ", bpad.sizes());
  }
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "window_dot_rel", [&] {
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    const scalar_t* pb = bpad.const_data_ptr<scalar_t>();
    const scalar_t* pr = rel.const_data_ptr<scalar_t>();
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    const int64_t a0 = a.stride(0), a1 = a.stride(1), a2 = a.stride(2), a3 = a.stride(3);
    const int64_t b0 = bpad.stride(0), b1 = bpad.stride(1), b2 = bpad.stride(2), b3 = bpad.stride(3);
    const int64_t o0 = out.stride(0), o1 = out.stride(1), o2 = out.stride(2), o3 = out.stride(3);
    // (batch, group) slices in parallel, then offset, channel, row, as window_dot.
    at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bg = begin; bg < end; ++bg) {
        const int64_t b = bg / G, g = bg % G;
        for (int64_t o = 0; o < K; ++o) {
          for (int64_t i = 0; i < H; ++i) {
            scalar_t* __restrict__ orow = po + o * o0 + b * o1 + g * o2 + i * o3;
            for (int64_t j = 0; j < W; ++j) orow[j] = 0;
          }
          for (int64_t d = 0; d < D; ++d) {
            const scalar_t r = pr[(g * D + d) * K + o];
            for (int64_t i = 0; i < H; ++i) {
              scalar_t* __restrict__ orow = po + o * o0 + b * o1 + g * o2 + i * o3;
              const scalar_t* __restrict__ arow = pa + b * a0 + g * a1 + d * a2 + i * a3;
              const scalar_t* __restrict__ brow = pb + b * b0 + g * b1 + d * b2 + (i + dy[o]) * b3 + dx[o];
              _Pragma("GCC ivdep")
              for (int64_t j = 0; j < W; ++j) orow[j] += arow[j] * (brow[j] + r);
            }
          }
        }
      }
    });
  });
}

}  // namespace

void register_window_rel_ops(pybind11::module_& m) {
  m.def("window_dot_rel", &window_dot_rel, "out[o,b,g,i,j] = sum_d a[b,g,d,i,j] (bpad[b,g,d,i+dy_o,j+dx_o] + rel[g,d,o])");
}
