// Small dense products for tiles that live in cache: a 1x1 layer applied to a (channels x pixels)
// tile, and the tile's contribution to that layer's weight gradient. Register-blocked over output
// rows and vector lanes of pixels, with GCC vector extensions (-march=native). Used by
// pairwise_ops.cpp and patchwise_ops.cpp; row-major throughout.
//
// The vectors are as wide as the target's registers: 64 bytes with AVX-512, 32 elsewhere (AVX2).
// 64-byte vectors on AVX2 take two registers each, and the blocks below then need about twice the
// 16 registers there: SAN10 pairwise's training step was 1.8x slower (benchmarks/results/
// gemm_layout_avx2.json). The blocks are 8 output rows of 2 vectors in gemm_nn and 4 x 4 dot
// products in gemm_nt on every target (on AVX2, 8 rows beat 6 and 4 rows, which fit its registers
// without spilling: docs/performance.md). Each output element sums over k in the same order
// whatever the width; only gemm_nt's dot products and its choice of path depend on it. The
// SMALL_GEMM_* macros override these choices (benchmarks/bench_gemm_layout.py).
#pragma once

#ifndef SMALL_GEMM_VECTOR_BYTES
#  ifdef __AVX512F__
#    define SMALL_GEMM_VECTOR_BYTES 64
#  else
#    define SMALL_GEMM_VECTOR_BYTES 32
#  endif
#endif
#ifndef SMALL_GEMM_NN_ROWS
#  define SMALL_GEMM_NN_ROWS 8
#endif
#ifndef SMALL_GEMM_NT_COLS
#  define SMALL_GEMM_NT_COLS 4
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace small_gemm {

template <typename S>
struct Vec {
  static constexpr int bytes = SMALL_GEMM_VECTOR_BYTES;
  static constexpr int lanes = bytes / sizeof(S);
  typedef S type __attribute__((vector_size(bytes)));
  static type load(const S* p) { type v; std::memcpy(&v, p, bytes); return v; }
  static void store(S* p, type v) { std::memcpy(p, &v, bytes); }
  static S sum(type v) { S s = 0; for (int i = 0; i < lanes; ++i) s += v[i]; return s; }
};

// rows x (NV vectors) block of Y (+)= W X over k < K
template <typename S, int RB, int NV>
inline void nn_block(int64_t K, const S* W, int64_t ldw, const S* X, int64_t ldx, S* Y, int64_t ldy, bool acc) {
  using V = Vec<S>;
  typename V::type a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = acc ? V::load(Y + r * ldy + v * V::lanes) : typename V::type{};
  for (int64_t k = 0; k < K; ++k) {
    typename V::type x[NV];
    for (int v = 0; v < NV; ++v) x[v] = V::load(X + k * ldx + v * V::lanes);
    for (int r = 0; r < RB; ++r) {
      const S w = W[r * ldw + k];
      for (int v = 0; v < NV; ++v) a[r][v] += w * x[v];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) V::store(Y + r * ldy + v * V::lanes, a[r][v]);
}

// SMALL_GEMM_NN_ROWS rows at a time (8 rows of NV = 2 vectors beat 4 rows: docs/performance.md),
// then 4, 2 and 1
template <typename S, int NV>
inline void nn_columns(int64_t M, int64_t K, const S* W, int64_t ldw, const S* X, int64_t ldx, S* Y, int64_t ldy,
                       bool acc) {
  constexpr int R = SMALL_GEMM_NN_ROWS;
  int64_t m = 0;
  for (; m + R <= M; m += R) nn_block<S, R, NV>(K, W + m * ldw, ldw, X, ldx, Y + m * ldy, ldy, acc);
  for (; m + 4 <= M; m += 4) nn_block<S, 4, NV>(K, W + m * ldw, ldw, X, ldx, Y + m * ldy, ldy, acc);
  for (; m + 2 <= M; m += 2) nn_block<S, 2, NV>(K, W + m * ldw, ldw, X, ldx, Y + m * ldy, ldy, acc);
  for (; m < M; ++m) nn_block<S, 1, NV>(K, W + m * ldw, ldw, X, ldx, Y + m * ldy, ldy, acc);
}

// Y (M x T, row stride ldy) (+)= W (M x K, row stride ldw) X (K x T, row stride ldx). Row strides of
// a multiple of 4 KiB put a tile's rows in the same L1 sets: callers pad them (pairwise_ops.cpp).
template <typename S>
void gemm_nn(int64_t M, int64_t K, int64_t T, const S* W, int64_t ldw, const S* X, int64_t ldx, S* Y, int64_t ldy,
             bool acc) {
  constexpr int L = Vec<S>::lanes;
  int64_t t = 0;
  for (; t + 2 * L <= T; t += 2 * L) nn_columns<S, 2>(M, K, W, ldw, X + t, ldx, Y + t, ldy, acc);
  for (; t + L <= T; t += L) nn_columns<S, 1>(M, K, W, ldw, X + t, ldx, Y + t, ldy, acc);
  for (int64_t m = 0; m < M && t < T; ++m) {
    for (int64_t j = t; j < T; ++j) {
      S s = acc ? Y[m * ldy + j] : S(0);
      for (int64_t k = 0; k < K; ++k) s += W[m * ldw + k] * X[k * ldx + j];
      Y[m * ldy + j] = s;
    }
  }
}

template <typename S, int RI, int RJ>
inline void nt_block(int64_t T, const S* A, int64_t lda, const S* B, int64_t ldb, S* Y, int64_t ldy) {
  using V = Vec<S>;
  typename V::type a[RI][RJ];
  for (int i = 0; i < RI; ++i)
    for (int j = 0; j < RJ; ++j) a[i][j] = typename V::type{};
  int64_t t = 0;
  for (; t + V::lanes <= T; t += V::lanes) {
    typename V::type x[RI], y[RJ];
    for (int i = 0; i < RI; ++i) x[i] = V::load(A + i * lda + t);
    for (int j = 0; j < RJ; ++j) y[j] = V::load(B + j * ldb + t);
    for (int i = 0; i < RI; ++i)
      for (int j = 0; j < RJ; ++j) a[i][j] += x[i] * y[j];
  }
  for (int i = 0; i < RI; ++i) {
    for (int j = 0; j < RJ; ++j) {
      S s = V::sum(a[i][j]);
      for (int64_t u = t; u < T; ++u) s += A[i * lda + u] * B[j * ldb + u];
      Y[i * ldy + j] += s;
    }
  }
}

template <typename S, int RI>
inline void nt_rows(int64_t N, int64_t T, const S* A, int64_t lda, const S* B, int64_t ldb, S* Y, int64_t ldy) {
  constexpr int C = SMALL_GEMM_NT_COLS;
  int64_t n = 0;
  for (; n + C <= N; n += C) nt_block<S, RI, C>(T, A, lda, B + n * ldb, ldb, Y + n, ldy);
  for (; n < N; ++n) nt_block<S, RI, 1>(T, A, lda, B + n * ldb, ldb, Y + n, ldy);
}

// Y (M x N, row stride ldy) += A (M x T, row stride lda) B (N x T, row stride ldb)^T.
// With at least a vector of columns N and few pixels T (or many rows M), as gemm_nn on a transposed
// copy of B (no horizontal sums: the faster form there, docs/performance.md); else as dot products over T.
template <typename S>
void gemm_nt(int64_t M, int64_t N, int64_t T, const S* A, int64_t lda, const S* B, int64_t ldb, S* Y, int64_t ldy) {
  if (N >= Vec<S>::lanes && (T < 512 || M >= 16)) {
    thread_local std::vector<S> bt;
    bt.resize(T * N);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t t = 0; t < T; ++t) bt[t * N + n] = B[n * ldb + t];
    gemm_nn<S>(M, T, N, A, lda, bt.data(), N, Y, ldy, true);
    return;
  }
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) nt_rows<S, 4>(N, T, A + m * lda, lda, B, ldb, Y + m * ldy, ldy);
  for (; m < M; ++m) nt_rows<S, 1>(N, T, A + m * lda, lda, B, ldb, Y + m * ldy, ldy);
}

}  // namespace small_gemm
