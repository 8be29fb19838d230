// y = x W^T + b in float32 for a few rows of x: each row of W is read once from memory for all of them, so a
// decoding step's products run at the memory's speed (oneDNN and MKL reorder or block for larger products).
// W is float32, or bfloat16 (half the memory to read; widened to float32 exactly, then summed as float32). A bfloat16
// model's product (bfloat16 x over a bfloat16 W) sums in float32 too, by the CPU's bfloat16 pair products where it
// has them (AVX512-BF16), else widened, and rounds the sums to bfloat16 once.
// Built for the CPU at hand (-march=native) by medusa_heads/kernels.py; needs AVX2 and FMA.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kRows = 8;      // rows of x per pass over a row of W (their 8 sums stay in registers, 8 chains of
                                  // fused multiply-adds in flight: 6-12 rows ~20 % faster than in fours on a Zen 3)
constexpr int64_t kOutputs = 16;  // rows of W per parallel work item
constexpr int64_t kAhead = 1024;  // bytes of W fetched ahead of the sums (a few % on a Zen 3, at any rows)
constexpr int kChains = 4;        // a draft's sums: chains per row (chained_tile)
constexpr int64_t kChainedRows = 3;  // and its rows per pass over a row of W (their 12 sums stay in registers)

inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const at::BFloat16* w) {  // a bfloat16 is the high half of a float32
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

// y[m] = w . x[m] (+ b) for R rows of x and one row of w (R known at compile time: the R sums stay in registers,
// and each load of w serves R products). Each sum runs in the same order whatever R is, so a row's product is
// the same in a pass of one row as in a pass of many.
template <int R, typename T, typename O>
void dot_tile(const T* __restrict w, const float* __restrict x, int64_t K, O* __restrict y, int64_t N,
              const float* __restrict b) {
  constexpr int64_t line = 64 / sizeof(T), ahead = kAhead / sizeof(T);  // weights per cache line, fetched ahead
  __m256 sums[R];
  for (int m = 0; m < R; ++m) sums[m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (k % line == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k + ahead), _MM_HINT_T0);
    const __m256 wk = load8(w + k);
    for (int m = 0; m < R; ++m) sums[m] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + m * K + k), sums[m]);
  }
  for (int m = 0; m < R; ++m) {
    float s = medusa_heads::horizontal_sum(sums[m]);
    for (int64_t j = k; j < K; ++j) s += float(w[j]) * x[m * K + j];
    y[m * N] = b ? s + *b : s;
  }
}

// the same for a draft's products (any order of the sums will do): each row's sum in kChains chains of fused
// multiply-adds, so that the adds' latency does not bound a product whose W the caches hold (a draft's
// projection, 8,192 x 576 in bfloat16: 4x faster with warm caches on a Zen 3)
template <int R, typename T, typename O>
void chained_tile(const T* __restrict w, const float* __restrict x, int64_t K, O* __restrict y, int64_t N,
                  const float* __restrict b) {
  constexpr int64_t line = 64 / sizeof(T), ahead = kAhead / sizeof(T);
  __m256 sums[R][kChains];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < kChains; ++c) sums[m][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * kChains <= K; k += 8 * kChains) {
    for (int64_t j = k; j < k + 8 * kChains; j += line)
      _mm_prefetch(reinterpret_cast<const char*>(w + j + ahead), _MM_HINT_T0);
    for (int c = 0; c < kChains; ++c) {
      const __m256 wk = load8(w + k + 8 * c);
      for (int m = 0; m < R; ++m)
        sums[m][c] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + m * K + k + 8 * c), sums[m][c]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 wk = load8(w + k);
    for (int m = 0; m < R; ++m) sums[m][0] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + m * K + k), sums[m][0]);
  }
  for (int m = 0; m < R; ++m) {
    __m256 sum = sums[m][0];
    for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, sums[m][c]);
    float s = medusa_heads::horizontal_sum(sum);
    for (int64_t j = k; j < K; ++j) s += float(w[j]) * x[m * K + j];
    y[m * N] = b ? s + *b : s;
  }
}

template <typename T, int R, bool chained, typename O>
void dot_rows(const T* w, const float* x, int64_t rows, int64_t K, O* y, int64_t N, const float* b) {
  if constexpr (R > 1) {
    if (rows < R) return dot_rows<T, R - 1, chained>(w, x, rows, K, y, N, b);
  }
  if constexpr (chained)
    chained_tile<R>(w, x, K, y, N, b);
  else
    dot_tile<R>(w, x, K, y, N, b);
}

// f(n, m, rows) for every row n of W and every tile of up to `tile` rows of x from row m, kOutputs rows of W a
// parallel work item
template <int64_t tile, typename F>
void over_outputs(int64_t M, int64_t N, const F& f) {
  at::parallel_for(0, (N + kOutputs - 1) / kOutputs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * kOutputs; n < std::min(end * kOutputs, N); ++n)
      for (int64_t m = 0; m < M; m += tile) f(n, m, std::min(tile, M - m));
  });
}

template <bool chained, typename T, typename O>
void products(const T* W, const float* X, int64_t M, int64_t K, int64_t N, const float* B, O* Y) {
  constexpr int64_t tile = chained ? kChainedRows : kRows;
  over_outputs<tile>(M, N, [=](int64_t n, int64_t m, int64_t rows) {
    dot_rows<T, tile, chained>(W + n * K, X + m * K, rows, K, Y + m * N + n, N, B ? B + n : nullptr);
  });
}

template <typename T, typename O>
void products(bool chained, const T* W, const float* X, int64_t M, int64_t K, int64_t N, const float* B, O* Y) {
  chained ? products<true>(W, X, M, K, N, B, Y) : products<false>(W, X, M, K, N, B, Y);
}

#ifdef __AVX512BF16__
// a bfloat16 model's product where the CPU multiplies bfloat16 pairs itself (AVX512-BF16: 32 products summed into 16
// float32 lanes an instruction, half the loads and instructions of widening): one chain of sums a row, over k in
// steps of 32 (the last one masked), the same whatever the rows; on a Zen 4 1.3-1.4x faster than widening at 1-8 rows
template <int R>
void pairs_tile(const at::BFloat16* __restrict w, const at::BFloat16* __restrict x, int64_t K,
                at::BFloat16* __restrict y, int64_t N, const float* __restrict b) {
  constexpr int64_t ahead = kAhead / 2;  // weights fetched ahead
  __m512 sums[R];
  for (int m = 0; m < R; ++m) sums[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {  // 32 weights: a cache line
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    _mm_prefetch(reinterpret_cast<const char*>(w + k + ahead), _MM_HINT_T0);
    const __m512bh wk = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < R; ++m)
      sums[m] = _mm512_dpbf16_ps(sums[m], wk, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
  }
  for (int m = 0; m < R; ++m) {
    const float s = _mm512_reduce_add_ps(sums[m]);
    y[m * N] = at::BFloat16(b ? s + *b : s);
  }
}

template <int R>
void pairs_rows(const at::BFloat16* w, const at::BFloat16* x, int64_t rows, int64_t K, at::BFloat16* y, int64_t N,
                const float* b) {
  if constexpr (R > 1) {
    if (rows < R) return pairs_rows<R - 1>(w, x, rows, K, y, N, b);
  }
  pairs_tile<R>(w, x, K, y, N, b);
}
#endif

// a bfloat16 tensor's values in float32 (exactly)
std::vector<float> widened(const torch::Tensor& t) {
  const auto* h = t.data_ptr<at::BFloat16>();
  return std::vector<float>(h, h + t.numel());
}

}  // namespace

torch::Tensor medusa_heads::stream_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                         const c10::optional<torch::Tensor>& bias, bool draft) {
  const bool model_halves = x.scalar_type() == torch::kBFloat16;  // a bfloat16 model's product
  TORCH_CHECK(x.device().is_cpu() && (model_halves || x.scalar_type() == torch::kFloat32),
              "stream_linear: x must be float32 or bfloat16 on the CPU");
  const bool halves = weight.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (halves || weight.scalar_type() == torch::kFloat32) && weight.is_contiguous(),
              "stream_linear: weight must be a contiguous float32 or bfloat16 matrix");
  TORCH_CHECK(halves || !model_halves, "stream_linear: bfloat16 x needs a bfloat16 weight");
  TORCH_CHECK(x.size(-1) == weight.size(1), "stream_linear: x and weight sizes differ");
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = rows.size(0), K = rows.size(1), N = weight.size(0);
  auto out = torch::empty({M, N}, x.options());
  std::vector<float> b_wide;  // a bfloat16 model's bias in float32
  const float* B = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type() && bias->is_contiguous(),
                "stream_linear: bias must be a contiguous vector of the outputs' size, in x's dtype");
    if (model_halves) b_wide = widened(*bias);
    B = model_halves ? b_wide.data() : bias->data_ptr<float>();
  }
  if (model_halves) {
    const auto* W = weight.data_ptr<at::BFloat16>();
    auto* Y = out.data_ptr<at::BFloat16>();
#ifdef __AVX512BF16__
    const auto* X = rows.data_ptr<at::BFloat16>();
    over_outputs<kRows>(M, N, [=](int64_t n, int64_t m, int64_t tile) {
      pairs_rows<kRows>(W + n * K, X + m * K, tile, K, Y + m * N + n, N, B ? B + n : nullptr);
    });
#else
    const auto X = widened(rows);
    products(draft, W, X.data(), M, K, N, B, Y);
#endif
  } else if (halves) {
    products(draft, weight.data_ptr<at::BFloat16>(), rows.data_ptr<float>(), M, K, N, B, out.data_ptr<float>());
  } else {
    products(draft, weight.data_ptr<float>(), rows.data_ptr<float>(), M, K, N, B, out.data_ptr<float>());
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.reshape(shape);
}
