// y = x W^T + b over W laid out by columns (medusa_heads.speed.columns: blocks of 16 outputs, k by k), so that each
// multiply-add serves 16 outputs of one row of x and no sum needs adding across a register's lanes at its end: every
// output's sum runs over k in one order in its own lane, whatever the rows beside it (a tree pass's rows round as a
// plain step's). float32 W: fused multiply-adds of float32 x. bfloat16 W (where the CPU has AVX512-BF16): x rounded
// to bfloat16 and multiplied in pairs of k (32 products into 16 sums an instruction), each sum in float32.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kBlock = 16;  // outputs a block (one AVX-512 register of float32 sums, two of AVX2)
#ifdef __AVX512F__
constexpr int kTileRows = 16;  // rows of x a pass over a block of W (their sums in 16 of AVX-512's 32 registers)
#else
constexpr int kTileRows = 6;  // (AVX2's 16 registers: 2 x 6 sums)
#endif
constexpr int64_t kAhead = 1024;  // bytes of W fetched ahead of the sums

// sums[m] = x[m] . w over 16 outputs for R rows of float32 x; w: K vectors of 16 float32 weights. Each lane's fused
// multiply-adds run in the same order in both versions, so they give the same sums: the one of one AVX-512 register
// a row (wide_tile) for 4 rows or more, the one of two AVX2 registers a row (two chains of sums) below.
#ifdef __AVX512F__
template <int R>
void wide_tile(const float* __restrict w, const float* __restrict x, int64_t K, int64_t stride, float* __restrict y,
               int64_t N, int64_t outputs, const float* __restrict b) {
  __m512 sums[R];
  for (int m = 0; m < R; ++m) sums[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * k) + kAhead, _MM_HINT_T0);  // a cache line a k
    const __m512 wk = _mm512_loadu_ps(w + 16 * k);
    for (int m = 0; m < R; ++m) sums[m] = _mm512_fmadd_ps(wk, _mm512_set1_ps(x[m * stride + k]), sums[m]);
  }
  for (int m = 0; m < R; ++m) {
    alignas(64) float s[kBlock];
    _mm512_store_ps(s, sums[m]);
    for (int64_t j = 0; j < outputs; ++j) y[m * N + j] = b ? s[j] + b[j] : s[j];
  }
}
#endif

template <int R>
void float_tile(const float* __restrict w, const float* __restrict x, int64_t K, int64_t stride, float* __restrict y,
                int64_t N, int64_t outputs, const float* __restrict b) {
  __m256 lo[R], hi[R];
  for (int m = 0; m < R; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * k) + kAhead, _MM_HINT_T0);  // a cache line a k
    const __m256 w0 = _mm256_loadu_ps(w + 16 * k), w1 = _mm256_loadu_ps(w + 16 * k + 8);
    for (int m = 0; m < R; ++m) {
      const __m256 xm = _mm256_broadcast_ss(x + m * stride + k);
      lo[m] = _mm256_fmadd_ps(w0, xm, lo[m]);
      hi[m] = _mm256_fmadd_ps(w1, xm, hi[m]);
    }
  }
  for (int m = 0; m < R; ++m) {
    alignas(32) float sums[kBlock];
    _mm256_store_ps(sums, lo[m]);
    _mm256_store_ps(sums + 8, hi[m]);
    for (int64_t j = 0; j < outputs; ++j) y[m * N + j] = b ? sums[j] + b[j] : sums[j];
  }
}

template <int R>
void float_rows(const float* w, const float* x, int64_t rows, int64_t K, int64_t stride, float* y, int64_t N,
                int64_t outputs, const float* b) {
  if constexpr (R > 1) {
    if (rows < R) return float_rows<R - 1>(w, x, rows, K, stride, y, N, outputs, b);
  }
#ifdef __AVX512F__
  if constexpr (R >= 4) {
    wide_tile<R>(w, x, K, stride, y, N, outputs, b);
    return;
  }
#endif
  if constexpr (R <= 6) float_tile<R>(w, x, K, stride, y, N, outputs, b);  // (with AVX-512: below 4 rows)
}

#ifdef __AVX512BF16__
// the same over bfloat16 pairs: w holds P pairs of k for 16 outputs (32 bfloat16, a register); x: R rows of P pairs
template <int R, typename O>
void pairs_tile(const at::BFloat16* __restrict w, const int32_t* __restrict x, int64_t P, int64_t stride,
                O* __restrict y, int64_t N, int64_t outputs, const float* __restrict b) {
  __m512 sums[R];
  for (int m = 0; m < R; ++m) sums[m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 32 * p) + kAhead, _MM_HINT_T0);  // a cache line a pair
    const __m512bh wp = (__m512bh)_mm512_loadu_si512(w + 32 * p);
    for (int m = 0; m < R; ++m)
      sums[m] = _mm512_dpbf16_ps(sums[m], wp, (__m512bh)_mm512_set1_epi32(x[m * stride + p]));
  }
  for (int m = 0; m < R; ++m) {
    alignas(64) float s[kBlock];
    _mm512_store_ps(s, sums[m]);
    for (int64_t j = 0; j < outputs; ++j) y[m * N + j] = O(b ? s[j] + b[j] : s[j]);
  }
}

template <int R, typename O>
void pairs_rows(const at::BFloat16* w, const int32_t* x, int64_t rows, int64_t P, int64_t stride, O* y, int64_t N,
                int64_t outputs, const float* b) {
  if constexpr (R > 1) {
    if (rows < R) return pairs_rows<R - 1>(w, x, rows, P, stride, y, N, outputs, b);
  }
  pairs_tile<R>(w, x, P, stride, y, N, outputs, b);
}
#endif

// f(block, m, rows) for every block of 16 outputs and every tile of rows of x from row m: as few tiles as kTileRows
// allows, of even heights (9 rows: 5 and 4, not 8 and 1, whose one chain of sums would wait on each multiply-add)
template <typename F>
void over_blocks(int64_t M, int64_t blocks, const F& f) {
  const int64_t tiles = (M + kTileRows - 1) / kTileRows, height = (M + tiles - 1) / std::max<int64_t>(tiles, 1);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t m = 0; m < M; m += height) f(j, m, std::min(height, M - m));
  });
}

}  // namespace

// x (..., K) float32 or bfloat16; columns: W (N, K) as speed.columns lays it out, float32 (blocks, K, 16) or
// bfloat16 (blocks, P, 16, 2) with P = ceil(K / 2), zeros past N and K; bias: N values in x's dtype or none.
// Returns (..., N) in x's dtype (a bfloat16 x's sums rounded to bfloat16 once).
torch::Tensor medusa_heads::columns_linear(const torch::Tensor& x, const torch::Tensor& columns,
                                          const c10::optional<torch::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "columns_linear: x must be float32 or bfloat16 on the CPU");
  const bool halves = columns.scalar_type() == torch::kBFloat16;
  const int64_t K = x.size(-1), blocks = (N + kBlock - 1) / kBlock, P = (K + 1) / 2;
  TORCH_CHECK(columns.is_contiguous() && columns.size(0) == blocks &&
                  (halves ? columns.dim() == 4 && columns.size(1) == P && columns.size(2) == kBlock &&
                                columns.size(3) == 2
                          : columns.scalar_type() == torch::kFloat32 && columns.dim() == 3 &&
                                columns.size(1) == K && columns.size(2) == kBlock),
              "columns_linear: columns must be speed.columns' layout of an (N, K) weight");
  TORCH_CHECK(halves || x.scalar_type() == torch::kFloat32, "columns_linear: bfloat16 x needs bfloat16 columns");
  const auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* B = nullptr;
  torch::Tensor wide_bias;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type(),
                "columns_linear: bias must be N values in x's dtype");
    wide_bias = bias->to(torch::kFloat32).contiguous();
    B = wide_bias.data_ptr<float>();
  }
  if (!halves) {
    const float *W = columns.data_ptr<float>(), *X = rows.data_ptr<float>();
    float* Y = out.data_ptr<float>();
    over_blocks(M, blocks, [=](int64_t j, int64_t m, int64_t tile) {
      const int64_t n = j * kBlock;
      float_rows<kTileRows>(W + n * K, X + m * K, tile, K, K, Y + m * N + n, N, std::min(kBlock, N - n),
                            B ? B + n : nullptr);
    });
  } else {
#ifdef __AVX512BF16__
    std::vector<at::BFloat16> pairs(M * 2 * P, at::BFloat16(0.0f));  // x's rows in bfloat16, K padded to 2 P
    if (x.scalar_type() == torch::kBFloat16) {
      for (int64_t m = 0; m < M; ++m) std::copy_n(rows.data_ptr<at::BFloat16>() + m * K, K, pairs.data() + m * 2 * P);
    } else {  // rounded to the nearest bfloat16, 16 at a time (at::BFloat16's scalar rounding: 4 ms of an 8-row pass)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; k += 16) {
          const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
          const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, rows.data_ptr<float>() + m * K + k));
          _mm256_mask_storeu_epi16(pairs.data() + m * 2 * P + k, mask, (__m256i)h);
        }
    }
    const auto* W = columns.data_ptr<at::BFloat16>();
    const auto* X = reinterpret_cast<const int32_t*>(pairs.data());
    auto run = [&](auto* Y) {
      over_blocks(M, blocks, [=](int64_t j, int64_t m, int64_t tile) {
        const int64_t n = j * kBlock;
        pairs_rows<kTileRows>(W + n * 2 * P, X + m * P, tile, P, P, Y + m * N + n, N, std::min(kBlock, N - n),
                              B ? B + n : nullptr);
      });
    };
    if (x.scalar_type() == torch::kBFloat16)
      run(out.data_ptr<at::BFloat16>());
    else
      run(out.data_ptr<float>());
#else
    TORCH_CHECK(false, "columns_linear: bfloat16 columns need a CPU with AVX512-BF16");
#endif
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.reshape(shape);
}
