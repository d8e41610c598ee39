// Footprint window operations on CPU: the loops that local attention (SAN eq. 2-5, SASA eq. 3) runs
// once per footprint offset, each as one pass that keeps a (batch, group) slice in cache across all
// offsets instead of one full-tensor PyTorch op per offset. Compiled on first use, with
// pairwise_ops.cpp (see module.cpp), by robust_attn/layers/cpu_kernels.py; the pure-PyTorch loops
// there compute the same functions.
//
// Layouts (any strides, last dim contiguous):
//   features a      (B, G, D, H, W)      e.g. queries, or the output gradient
//   padded   bpad   (B, G, D, Hp, Wp)    e.g. padded keys or values; offset o reads bpad[..., i + dy_o, j + dx_o]
//   weights  w      (K, B, G, H, W)      one per offset, shared by the D channels of a group
//
//   window_dot     out[o, b, g, i, j]   = sum_d a[b, g, d, i, j] * bpad[b, g, d, i + dy_o, j + dx_o]
//   window_sum     out[b, g, d, i, j]  (+)= sum_o w[o, b, g, i, j] * bpad[b, g, d, i + dy_o, j + dx_o]
//   window_scatter outpad[b, g, d, i + dy_o, j + dx_o] += sum_o w[o, b, g, i, j] * a[b, g, d, i, j]
//   window_fold    outpad[b, c, i + dy_o, j + dx_o] += x[o, b, c, i, j]   (outpad passed as (B, C, 1, Hp, Wp))
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

void check_offsets(const std::vector<int64_t>& dy, const std::vector<int64_t>& dx, int64_t h, int64_t w,
                      const at::Tensor& padded) {
  TORCH_CHECK(dy.size() == dx.size(), "window ops: dy and dx differ in length");
  for (size_t o = 0; o < dy.size(); ++o) {
    TORCH_CHECK(dy[o] >= 0 && dx[o] >= 0 && dy[o] + h <= padded.size(3) && dx[o] + w <= padded.size(4),
                "window ops: offset (", dy[o], ", ", dx[o], ") leaves the padded map ", padded.sizes());
  }
}

void check_5d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "window ops: ", name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 5, "window ops: ", name, " must be 5-D, got ", t.sizes());
  TORCH_CHECK(t.stride(4) == 1 || t.size(4) == 1, "window ops: ", name, "'s last dim must be contiguous");
}

void check_same(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "window ops: dtypes differ (", a.scalar_type(), " and ",
              b.scalar_type(), ")");
}

// The four leading strides of a 5-D tensor, read once (not per row) so the inner loops stay tight.
struct Strides {
  int64_t s0, s1, s2, s3;
  explicit Strides(const at::Tensor& t) : s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)), s3(t.stride(3)) {}
  int64_t operator()(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3;
  }
};

// Loop order in all three: (batch, group) slices in parallel, then offset, channel, row. The
// working set of one (b, g, o) is a channel slice of each feature tensor and one offset's weight
// plane, all in L2; the contiguous row loop vectorizes. (Not offset innermost: the K weight planes
// lie a whole map apart, 49 streams aliasing in L1.)

// out[o, b, g, i, :] = sum_d a[b, g, d, i, :] * bpad[b, g, d, i + dy, dx:]
void window_dot(const at::Tensor& a, const at::Tensor& bpad, const std::vector<int64_t>& dy,
                const std::vector<int64_t>& dx, at::Tensor& out) {
  check_5d(a, "a"); check_5d(bpad, "bpad"); check_5d(out, "out");
  check_same(a, bpad); check_same(a, out);
  const int64_t B = a.size(0), G = a.size(1), D = a.size(2), H = a.size(3), W = a.size(4);
  check_offsets(dy, dx, H, W, bpad);
  const int64_t K = static_cast<int64_t>(dy.size());
  TORCH_CHECK(out.sizes() == at::IntArrayRef({K, B, G, H, W}), "window_dot: out must be ", at::IntArrayRef({K, B, G, H, W}));
  TORCH_CHECK(bpad.size(0) == B && bpad.size(1) == G && bpad.size(2) == D, "window_dot: bpad ", bpad.sizes(),
              " does not match a ", a.sizes());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "window_dot", [&] {
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    const scalar_t* pb = bpad.const_data_ptr<scalar_t>();
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    const Strides st_a(a), st_bpad(bpad), st_out(out);
    at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bg = begin; bg < end; ++bg) {
        const int64_t b = bg / G, g = bg % G;
        for (int64_t o = 0; o < K; ++o) {
          for (int64_t i = 0; i < H; ++i) {
            scalar_t* __restrict__ orow = po + st_out(o, b, g, i);
            for (int64_t j = 0; j < W; ++j) orow[j] = 0;
          }
          for (int64_t d = 0; d < D; ++d) {
            for (int64_t i = 0; i < H; ++i) {
              scalar_t* __restrict__ orow = po + st_out(o, b, g, i);
              const scalar_t* __restrict__ arow = pa + st_a(b, g, d, i);
              const scalar_t* __restrict__ brow = pb + st_bpad(b, g, d, i + dy[o]) + dx[o];
              _Pragma("GCC ivdep")
              for (int64_t j = 0; j < W; ++j) orow[j] += arow[j] * brow[j];
            }
          }
        }
      }
    });
  });
}

// out[b, g, d, i, :] (+)= sum_o w[o, b, g, i, :] * bpad[b, g, d, i + dy, dx:]
void window_sum(const at::Tensor& w, const at::Tensor& bpad, const std::vector<int64_t>& dy,
                const std::vector<int64_t>& dx, at::Tensor& out, bool accumulate) {
  check_5d(w, "w"); check_5d(bpad, "bpad"); check_5d(out, "out");
  check_same(w, bpad); check_same(w, out);
  const int64_t B = out.size(0), G = out.size(1), D = out.size(2), H = out.size(3), W = out.size(4);
  check_offsets(dy, dx, H, W, bpad);
  const int64_t K = static_cast<int64_t>(dy.size());
  TORCH_CHECK(w.sizes() == at::IntArrayRef({K, B, G, H, W}), "window_sum: w must be ", at::IntArrayRef({K, B, G, H, W}));
  TORCH_CHECK(bpad.size(0) == B && bpad.size(1) == G && bpad.size(2) == D, "window_sum: bpad ", bpad.sizes(),
              " does not match out ", out.sizes());
  AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "window_sum", [&] {
    const scalar_t* pw = w.const_data_ptr<scalar_t>();
    const scalar_t* pb = bpad.const_data_ptr<scalar_t>();
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    const Strides st_w(w), st_bpad(bpad), st_out(out);
    at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bg = begin; bg < end; ++bg) {
        const int64_t b = bg / G, g = bg % G;
        if (!accumulate) {
          for (int64_t d = 0; d < D; ++d) {
            for (int64_t i = 0; i < H; ++i) {
              scalar_t* __restrict__ orow = po + st_out(b, g, d, i);
              for (int64_t j = 0; j < W; ++j) orow[j] = 0;
            }
          }
        }
        for (int64_t o = 0; o < K; ++o) {
          for (int64_t d = 0; d < D; ++d) {
            for (int64_t i = 0; i < H; ++i) {
              scalar_t* __restrict__ orow = po + st_out(b, g, d, i);
              const scalar_t* __restrict__ wrow = pw + st_w(o, b, g, i);
              const scalar_t* __restrict__ brow = pb + st_bpad(b, g, d, i + dy[o]) + dx[o];
              _Pragma("GCC ivdep")
              for (int64_t j = 0; j < W; ++j) orow[j] += wrow[j] * brow[j];
            }
          }
        }
      }
    });
  });
}

// outpad[b, g, d, i + dy, dx:] += sum_o w[o, b, g, i, :] * a[b, g, d, i, :]
void window_scatter(const at::Tensor& w, const at::Tensor& a, const std::vector<int64_t>& dy,
                    const std::vector<int64_t>& dx, at::Tensor& outpad) {
  check_5d(w, "w"); check_5d(a, "a"); check_5d(outpad, "outpad");
  check_same(w, a); check_same(w, outpad);
  const int64_t B = a.size(0), G = a.size(1), D = a.size(2), H = a.size(3), W = a.size(4);
  check_offsets(dy, dx, H, W, outpad);
  const int64_t K = static_cast<int64_t>(dy.size());
  TORCH_CHECK(w.sizes() == at::IntArrayRef({K, B, G, H, W}), "window_scatter: w must be ", at::IntArrayRef({K, B, G, H, W}));
  TORCH_CHECK(outpad.size(0) == B && outpad.size(1) == G && outpad.size(2) == D, "window_scatter: outpad ",
              outpad.sizes(), " does not match a ", a.sizes());
  AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "window_scatter", [&] {
    const scalar_t* pw = w.const_data_ptr<scalar_t>();
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    scalar_t* po = outpad.mutable_data_ptr<scalar_t>();
    const Strides st_w(w), st_a(a), st_outpad(outpad);
    at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bg = begin; bg < end; ++bg) {
        const int64_t b = bg / G, g = bg % G;
        for (int64_t o = 0; o < K; ++o) {
          for (int64_t d = 0; d < D; ++d) {
            for (int64_t i = 0; i < H; ++i) {
              const scalar_t* __restrict__ arow = pa + st_a(b, g, d, i);
              const scalar_t* __restrict__ wrow = pw + st_w(o, b, g, i);
              scalar_t* __restrict__ prow = po + st_outpad(b, g, d, i + dy[o]) + dx[o];
              _Pragma("GCC ivdep")
              for (int64_t j = 0; j < W; ++j) prow[j] += wrow[j] * arow[j];
            }
          }
        }
      }
    });
  });
}

// outpad[b, c, i + dy, dx:] += x[o, b, c, i, :] for every o: the adjoint of stacking shifted windows
void window_fold(const at::Tensor& x, const std::vector<int64_t>& dy, const std::vector<int64_t>& dx,
                 at::Tensor& outpad) {
  check_5d(x, "x"); check_5d(outpad, "outpad");
  check_same(x, outpad);
  const int64_t K = x.size(0), B = x.size(1), C = x.size(2), H = x.size(3), W = x.size(4);
  TORCH_CHECK(static_cast<int64_t>(dy.size()) == K, "window_fold: ", dy.size(), " offsets for ", K, " windows");
  TORCH_CHECK(outpad.size(0) == B && outpad.size(1) == C && outpad.size(2) == 1, "window_fold: outpad ",
              outpad.sizes(), " must be (B, C, 1, Hp, Wp) for x ", x.sizes());
  check_offsets(dy, dx, H, W, outpad);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "window_fold", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    scalar_t* po = outpad.mutable_data_ptr<scalar_t>();
    const Strides st_x(x), st_outpad(outpad);
    at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bc = begin; bc < end; ++bc) {
        const int64_t b = bc / C, c = bc % C;
        for (int64_t o = 0; o < K; ++o) {
          for (int64_t i = 0; i < H; ++i) {
            const scalar_t* __restrict__ xrow = px + st_x(o, b, c, i);
            scalar_t* __restrict__ prow = po + st_outpad(b, c, 0, i + dy[o]) + dx[o];
            _Pragma("GCC ivdep")
            for (int64_t j = 0; j < W; ++j) prow[j] += xrow[j];
          }
        }
      }
    });
  });
}

}  // namespace

void register_window_ops(pybind11::module_& m) {
  m.def("window_dot", &window_dot, "out[o,b,g,i,j] = sum_d a[b,g,d,i,j] bpad[b,g,d,i+dy_o,j+dx_o]");
  m.def("window_sum", &window_sum, "out[b,g,d,i,j] (+)= sum_o w[o,b,g,i,j] bpad[b,g,d,i+dy_o,j+dx_o]");
  m.def("window_fold", &window_fold, "outpad[b,c,i+dy_o,j+dx_o] += x[o,b,c,i,j]");
  m.def("window_scatter", &window_scatter, "outpad[b,g,d,i+dy_o,j+dx_o] += sum_o w[o,b,g,i,j] a[b,g,d,i,j]");
}
