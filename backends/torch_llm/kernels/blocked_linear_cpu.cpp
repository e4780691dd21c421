// y = x W^T + b for float32 on CPU, with W stored once at load in a blocked layout: [N/16][K][16],
// the 16 output columns of a block side by side for every k (zero rows pad N to a multiple of 16).
// Built at first use by torch.utils.cpp_extension (backends/torch_llm/kernels/blocked_linear.py).
//
// Why our own: a decode step multiplies 1-16 rows by each weight, so the cost is reading the
// weight once (memory bound) plus the per-call overhead; oneDNN's packed linears spent 30-50 % more
// than this on this project's 2-core CPU for the decoder's shapes at 1-16 rows (and a little more at
// prefill's hundreds of rows). The micro-kernel is the usual register tile: 6 rows x 16 columns of
// accumulators (12 AVX2 registers), each weight vector loaded once per k and used by all 6 rows.
//
// Each output is one running FMA sum over k in order (float32 throughout): the same dot product as
// F.linear, rounded differently (its summation order is its BLAS's). Blocks of columns are split
// over torch's intra-op threads; the GIL is released while it computes.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 16;  // output columns per block
constexpr int kRows = 6;        // rows per register tile

#if defined(__AVX2__) && defined(__FMA__)
// Named accumulators, not arrays: with arrays GCC kept them on the stack, a store per FMA.
#define FG_EACH_ROW(X_) X_(0) X_(1) X_(2) X_(3) X_(4) X_(5)

// y[r, 0:16] = b[0:16] + sum_k x[r, k] * wb[k, 0:16] for the first MR rows
template <int MR>
inline void tile(const float* x, int64_t ldx, const float* wb, const float* b, int64_t K, float* y, int64_t ldy) {
  const __m256 b0 = b ? _mm256_loadu_ps(b) : _mm256_setzero_ps();
  const __m256 b1 = b ? _mm256_loadu_ps(b + 8) : _mm256_setzero_ps();
#define FG_DECLARE(r) __m256 acc##r##a = b0, acc##r##b = b1;
  FG_EACH_ROW(FG_DECLARE)
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(wb + k * kBlock), w1 = _mm256_loadu_ps(wb + k * kBlock + 8);
#define FG_STEP(r)                                                  \
  if constexpr (r < MR) {                                           \
    const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);         \
    acc##r##a = _mm256_fmadd_ps(xv, w0, acc##r##a);                 \
    acc##r##b = _mm256_fmadd_ps(xv, w1, acc##r##b);                 \
  }
    FG_EACH_ROW(FG_STEP)
  }
#define FG_STORE(r)                                                 \
  if constexpr (r < MR) {                                           \
    _mm256_storeu_ps(y + r * ldy, acc##r##a);                       \
    _mm256_storeu_ps(y + r * ldy + 8, acc##r##b);                   \
  }
  FG_EACH_ROW(FG_STORE)
#undef FG_DECLARE
#undef FG_STEP
#undef FG_STORE
}
#else
// Portable version of the same tile (the compiler vectorizes the inner loop where it can).
template <int MR>
inline void tile(const float* x, int64_t ldx, const float* wb, const float* b, int64_t K, float* y, int64_t ldy) {
  float acc[MR][kBlock];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kBlock; ++j) acc[r][j] = b ? b[j] : 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MR; ++r) {
      const float xv = x[r * ldx + k];
      for (int j = 0; j < kBlock; ++j) acc[r][j] += xv * wb[k * kBlock + j];
    }
  for (int r = 0; r < MR; ++r) std::memcpy(y + r * ldy, acc[r], sizeof(acc[r]));
}
#endif

// `rows` (< kRows) rows of one block: the tile of that height
inline void tail_tile(int64_t rows, const float* x, int64_t ldx, const float* wb, const float* b, int64_t K,
                      float* y, int64_t ldy) {
  switch (rows) {
    case 5: tile<5>(x, ldx, wb, b, K, y, ldy); break;
    case 4: tile<4>(x, ldx, wb, b, K, y, ldy); break;
    case 3: tile<3>(x, ldx, wb, b, K, y, ldy); break;
    case 2: tile<2>(x, ldx, wb, b, K, y, ldy); break;
    case 1: tile<1>(x, ldx, wb, b, K, y, ldy); break;
    default: break;
  }
}

// One block of 16 columns for all M rows, written to y[:, 0:width] (width < 16 for the last block
// of an N that is not a multiple of 16: computed in a scratch tile, then the valid columns copied)
void block_columns(const float* x, int64_t M, int64_t K, const float* wb, const float* b, float* y, int64_t ldy,
                   int64_t width) {
  if (width == kBlock) {
    int64_t m = 0;
    for (; m + kRows <= M; m += kRows) tile<kRows>(x + m * K, K, wb, b, K, y + m * ldy, ldy);
    tail_tile(M - m, x + m * K, K, wb, b, K, y + m * ldy, ldy);
    return;
  }
  float scratch[kRows * kBlock];
  for (int64_t m = 0; m < M; m += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, M - m);
    if (rows == kRows) tile<kRows>(x + m * K, K, wb, b, K, scratch, kBlock);
    else tail_tile(rows, x + m * K, K, wb, b, K, scratch, kBlock);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (m + r) * ldy, scratch + r * kBlock, width * sizeof(float));
  }
}

}  // namespace

// x: [M, K] float32 contiguous; wb: [NB, K, 16]; bias: [NB * 16] (padded) or empty; returns [M, N]
torch::Tensor blocked_linear(torch::Tensor x, torch::Tensor wb, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "blocked_linear: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(wb.dim() == 3 && wb.is_contiguous() && wb.scalar_type() == at::kFloat && wb.size(2) == kBlock &&
                  wb.size(1) == x.size(1),
              "blocked_linear: weight must be [N/16, K, 16] float32 with K = x's columns");
  const int64_t M = x.size(0), K = x.size(1), blocks = wb.size(0);
  TORCH_CHECK(N > (blocks - 1) * kBlock && N <= blocks * kBlock, "blocked_linear: N vs weight blocks");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.is_contiguous() && bias.scalar_type() == at::kFloat && bias.numel() == blocks * kBlock),
              "blocked_linear: bias must be float32 of the padded width");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* X = x.data_ptr<float>();
  const float* W = wb.data_ptr<float>();
  const float* B = has_bias ? bias.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;  // the event loop shares this process: let it run meanwhile
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t width = std::min<int64_t>(kBlock, N - nb * kBlock);
      block_columns(X, M, K, W + nb * K * kBlock, B ? B + nb * kBlock : nullptr, Y + nb * kBlock, N, width);
    }
  });
  return y;
}
