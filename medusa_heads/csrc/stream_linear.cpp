// y = x W^T + b in float32 for a few rows of x: each row of W is read once from memory for all of them, so a
// decoding step's products run at the memory's speed (oneDNN and MKL reorder or block for larger products).
// Built for the CPU at hand (-march=native) by medusa_heads/kernels.py; needs AVX2 and FMA.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"

namespace {

constexpr int64_t kRows = 4;     // rows of x per pass over a row of W (their sums stay in registers)
constexpr int64_t kOutputs = 16;  // rows of W per parallel work item
constexpr int64_t kGroupedAbove = 8;  // passes of more rows take W's rows in threes (measured faster only there:
                                      // 12 sums in registers; 16 rows 5 % faster than in pairs on an AMD EPYC)

// y[m, c] = w[c] . x[m] (+ b[c]) for R rows of x and C rows of w (both known at compile time: the R x C sums stay
// in registers, and each load of x serves C products, each load of w R of them)
template <int R, int C>
void dot_tile(const float* __restrict w, const float* __restrict x, int64_t K, float* __restrict y, int64_t N,
              const float* __restrict b) {
  __m256 sums[C][R];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < R; ++m) sums[c][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wk[C];
    for (int c = 0; c < C; ++c) wk[c] = _mm256_loadu_ps(w + c * K + k);
    for (int m = 0; m < R; ++m) {
      const __m256 xk = _mm256_loadu_ps(x + m * K + k);
      for (int c = 0; c < C; ++c) sums[c][m] = _mm256_fmadd_ps(wk[c], xk, sums[c][m]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < R; ++m) {
      float s = medusa_heads::horizontal_sum(sums[c][m]);
      for (int64_t j = k; j < K; ++j) s += w[c * K + j] * x[m * K + j];
      y[m * N + c] = b ? s + b[c] : s;
    }
}

template <int C>
void dot_rows(const float* w, const float* x, int64_t rows, int64_t K, float* y, int64_t N, const float* b) {
  switch (rows) {
    case 4: dot_tile<4, C>(w, x, K, y, N, b); break;
    case 3: dot_tile<3, C>(w, x, K, y, N, b); break;
    case 2: dot_tile<2, C>(w, x, K, y, N, b); break;
    default: dot_tile<1, C>(w, x, K, y, N, b);
  }
}

}  // namespace

torch::Tensor medusa_heads::stream_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "stream_linear: x must be float32 on the CPU");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(),
              "stream_linear: weight must be a contiguous float32 matrix");
  TORCH_CHECK(x.size(-1) == weight.size(1), "stream_linear: x and weight sizes differ");
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = rows.size(0), K = rows.size(1), N = weight.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* X = rows.data_ptr<float>();
  const float* W = weight.data_ptr<float>();
  const float* B = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
                "stream_linear: bias must be a contiguous float32 vector of the outputs' size");
    B = bias->data_ptr<float>();
  }
  float* Y = out.data_ptr<float>();
  at::parallel_for(0, (N + kOutputs - 1) / kOutputs, 1, [=](int64_t begin, int64_t end) {
    const int64_t last = std::min(end * kOutputs, N);
    const int64_t group = M > kGroupedAbove ? 3 : 1;
    for (int64_t n = begin * kOutputs; n < last;) {
      const int64_t c = std::min(group, last - n);
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min(kRows, M - m);
        if (c == 3)
          dot_rows<3>(W + n * K, X + m * K, rows, K, Y + m * N + n, N, B ? B + n : nullptr);
        else if (c == 2)
          dot_rows<2>(W + n * K, X + m * K, rows, K, Y + m * N + n, N, B ? B + n : nullptr);
        else
          dot_rows<1>(W + n * K, X + m * K, rows, K, Y + m * N + n, N, B ? B + n : nullptr);
      }
      n += c;
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.reshape(shape);
}

