// Helpers shared by the fused operators (pairwise_ops.cpp, patchwise_ops.cpp): argument checks, the
// tiles' row stride, a vectorized sum reduction and per-thread accumulators for at::parallel_for.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace fused {

inline void check_cpu_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), op, ": ", name, " must be a contiguous CPU tensor");
}

// t: contiguous on the CPU, of these sizes and like's dtype.
inline void check_operand(const at::Tensor& t, at::IntArrayRef sizes, const at::Tensor& like, const char* op,
                          const char* name) {
  check_cpu_contiguous(t, op, name);
  TORCH_CHECK(t.sizes() == sizes && t.scalar_type() == like.scalar_type(), op, ": ", name, " must be ", sizes, " of ",
              like.scalar_type(), ", got ", t.sizes(), " of ", t.scalar_type());
}

// Every offset's H x W window inside the padded Hp x Wp map.
inline void check_windows(const std::vector<int64_t>& dy, const std::vector<int64_t>& dx, int64_t H, int64_t W,
                          int64_t Hp, int64_t Wp, const char* op) {
  TORCH_CHECK(dx.size() == dy.size() && !dy.empty(), op, ": dy and dx differ in length or are empty");
  for (size_t o = 0; o < dy.size(); ++o) {
    TORCH_CHECK(dy[o] >= 0 && dx[o] >= 0 && dy[o] + H <= Hp && dx[o] + W <= Wp, op, ": offset (", dy[o], ", ",
                dx[o], ") leaves the padded map of ", Hp, " x ", Wp);
  }
}

// Row stride of a tile of T pixels: T, padded on large maps so that rows do not fall 4 KiB apart
// (the same L1 sets; docs/performance.md, "Why each path exists").
inline int64_t tile_stride(int64_t T) { return T >= 256 ? (T + 15) / 16 * 16 + 16 : T; }

// sum_a += sum(a[0:n]) and sum_ab += sum(a * b) over n contiguous values, as a vectorized reduction
// (`omp simd reduction`, compiled with -fopenmp: without it GCC keeps a float sum scalar).
template <typename S>
inline void add_sum_and_dot(const S* __restrict__ a, const S* __restrict__ b, int64_t n, S& sum_a, S& sum_ab) {
  S s1 = 0, s2 = 0;
  _Pragma("omp simd reduction(+ : s1, s2)")
  for (int64_t q = 0; q < n; ++q) {
    s1 += a[q];
    s2 += a[q] * b[q];
  }
  sum_a += s1;
  sum_ab += s2;
}

// One buffer per thread of at::parallel_for, summed at the end.
template <typename A>
struct PerThread {
  std::vector<std::vector<A>> parts;
  explicit PerThread(int64_t size) : parts(at::get_num_threads(), std::vector<A>(size, A(0))) {}
  std::vector<A>& mine() { return parts[at::get_thread_num()]; }
  template <typename S>
  void sum_into(S* out) const {
    for (const auto& p : parts)
      for (size_t i = 0; i < p.size(); ++i) out[i] += static_cast<S>(p[i]);
  }
};

}  // namespace fused
