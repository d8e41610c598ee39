// Helpers shared by the fused operators (pairwise_ops.cpp, patchwise_ops.cpp): argument checks and
// per-thread accumulators for at::parallel_for.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace fused {

inline void check_cpu_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), op, ": ", name, " must be a contiguous CPU tensor");
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
// (the same L1 sets; measured 2x on 32 x 32 maps).
inline int64_t tile_stride(int64_t T) { return T >= 256 ? (T + 15) / 16 * 16 + 16 : T; }

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
