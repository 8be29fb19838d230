// The C++ kernels of the CPU decoding step (medusa_heads/kernels.py builds them into one module).
#pragma once
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>

namespace medusa_heads {

// y = weight * x / sqrt(mean(x^2) + eps) over one row of K values (the squares summed in double; no weight: 1)
inline void norm_row(const float* x, const float* weight, int64_t K, float eps, float* y) {
  double squares = 0;
  for (int64_t k = 0; k < K; ++k) squares += double(x[k]) * x[k];
  const float scale = 1.0f / std::sqrt(float(squares / K) + eps);
  if (weight)
    for (int64_t k = 0; k < K; ++k) y[k] = weight[k] * (x[k] * scale);
  else
    for (int64_t k = 0; k < K; ++k) y[k] = x[k] * scale;
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// e^x for 8 floats: 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its Taylor series to r^7 (relative
// error below 1e-7); 0 below -87.3 (where e^x leaves the normal floats), x clamped to 88.3 above
inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.3f);
  const __m256 zero_below = _mm256_cmp_ps(x, low, _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, low), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147182f), x);  // ln 2 as a float and what it lacks
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-1.90465430e-9f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), zero_below);
}

// g / (1 + e^-g) for 8 floats
inline __m256 silu8(__m256 g) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// x W^T + b by the stream kernel, for float32 or bfloat16 W (and bfloat16 x over bfloat16 W; stream_linear.cpp).
// draft: a draft's product, whose sums may round in another order (faster where the caches hold W)
torch::Tensor stream_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& bias, bool draft);
// x W^T + b over W laid out by columns (speed.columns), each output's sum in one order whatever the rows
torch::Tensor columns_linear(const torch::Tensor& x, const torch::Tensor& columns,
                             const c10::optional<torch::Tensor>& bias, int64_t N);
torch::Tensor rms_norm(torch::Tensor& hidden, const torch::Tensor& weight, double eps,
                       const c10::optional<torch::Tensor>& delta);
torch::Tensor rotary_write(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                           const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& keys,
                           torch::Tensor& values, const torch::Tensor& rows, const torch::Tensor& slots);
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor attend(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                     const torch::Tensor& rows, int64_t visible, const c10::optional<torch::Tensor>& mask, double scaling);
torch::Tensor decoder_layers(torch::Tensor hidden, const std::vector<torch::Tensor>& params, bool qkv_fused,
                             std::vector<int64_t> qkv_sizes, bool gate_up_fused, std::vector<int64_t> gate_up_sizes,
                             const torch::Tensor& final_norm, double eps, int64_t route, const torch::Tensor& cos,
                             const torch::Tensor& sin, torch::Tensor& keys, torch::Tensor& values,
                             const torch::Tensor& rows, const torch::Tensor& slots,
                             const c10::optional<torch::Tensor>& subset, int64_t visible,
                             const std::vector<c10::optional<torch::Tensor>>& masks, double scaling);
torch::Tensor chained_draft(const torch::Tensor& hidden, const torch::Tensor& root, const torch::Tensor& embeddings,
                            double eps, const std::vector<torch::Tensor>& params, int64_t layers,
                            const std::vector<torch::Tensor>& levels, int64_t topk,
                            const c10::optional<torch::Tensor>& token_map);
std::vector<torch::Tensor> greedy_accept(const torch::Tensor& tokens, const torch::Tensor& logits,
                                         const torch::Tensor& parents, const torch::Tensor& retrieve);
void commit_moves(torch::Tensor& keys, torch::Tensor& values, const torch::Tensor& lengths, const torch::Tensor& keep,
                  const torch::Tensor& counts);

}  // namespace medusa_heads
