// The small operations of a Llama-family decoder layer, each fused into one pass over its data (float32, CPU):
// an RMS norm (with the residual add before it), the rotary embedding of queries and keys with the keys' and
// values' write into the cache, and the gated activation. Eager mode runs each as 5-20 separate operations.
// Built with -ffp-contract=off: the products and sums round as in transformers' own modeling code.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

#include "kernels.h"

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements a thread takes at least: a decoding pass's run on one thread

// g / (1 + e^-g) * u for 8 floats
__m256 silu_mul8(__m256 g, __m256 u) { return _mm256_mul_ps(medusa_heads::silu8(g), u); }

void check_float_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be float32 on the CPU");
  TORCH_CHECK(t.stride(-1) == 1, name, "'s last dimension must be contiguous");
}

}  // namespace

namespace medusa_heads {

// hidden += delta (when given, in place), then weight * hidden / sqrt(mean(hidden^2) + eps) per row
torch::Tensor rms_norm(torch::Tensor& hidden, const torch::Tensor& weight, double eps,
                       const c10::optional<torch::Tensor>& delta) {
  check_float_cpu(hidden, "hidden");
  check_float_cpu(weight, "weight");
  TORCH_CHECK(hidden.is_contiguous(), "hidden must be contiguous (it is updated in place)");
  const int64_t K = hidden.size(-1), M = hidden.numel() / K;
  TORCH_CHECK(weight.numel() == K, "weight's size differs from the hidden size");
  float* h = hidden.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* d = nullptr;
  if (delta.has_value()) {
    TORCH_CHECK(delta->sizes() == hidden.sizes(), "delta's shape differs from hidden's");
    check_float_cpu(*delta, "delta");
    TORCH_CHECK(delta->is_contiguous(), "delta must be contiguous");
    d = delta->data_ptr<float>();
  }
  auto out = torch::empty_like(hidden);
  float* y = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kGrain / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = h + m * K;
      if (d)
        for (int64_t k = 0; k < K; ++k) row[k] = row[k] + d[m * K + k];
      norm_row(row, w, K, float(eps), y + m * K);
    }
  });
  return out;
}

// queries and keys (B, n, heads * D) rotated by cos / sin (B, n, D) as q * cos + rotate_half(q) * sin; the rotated
// queries returned as (B, heads, n, D), the rotated keys and the values written into the cache layer (R, kv_heads,
// S, D) at rows[b], slots[b, i]
torch::Tensor rotary_write(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                           const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& keys,
                           torch::Tensor& values, const torch::Tensor& rows, const torch::Tensor& slots) {
  for (const torch::Tensor* t : {&query, &key, &value, &cos, &sin, static_cast<const torch::Tensor*>(&keys),
                                 static_cast<const torch::Tensor*>(&values)})
    check_float_cpu(*t, "rotary_write: each float input");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && slots.scalar_type() == torch::kLong, "rows and slots must be int64");
  const int64_t B = query.size(0), n = query.size(1), D = cos.size(-1), half = D / 2;
  const int64_t heads = query.size(2) / D, kv_heads = key.size(2) / D, S = keys.size(2);
  TORCH_CHECK(D % 2 == 0 && keys.size(3) == D && keys.size(1) == kv_heads && value.size(2) == key.size(2) &&
                  keys.sizes() == values.sizes() && cos.size(0) == B && cos.size(1) == n,
              "rotary_write: sizes do not match");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "the cache layers must be contiguous");
  auto out = torch::empty({B, heads, n, D}, query.options());
  auto rows_ = rows.accessor<int64_t, 1>();
  auto slots_ = slots.accessor<int64_t, 2>();
  float* q_out = out.data_ptr<float>();
  float* k_cache = keys.data_ptr<float>();
  float* v_cache = values.data_ptr<float>();
  auto rotate = [&](const float* x, const float* c, const float* s, float* y) {
    for (int64_t j = 0; j < half; ++j) y[j] = x[j] * c[j] + (-x[j + half]) * s[j];
    for (int64_t j = half; j < D; ++j) y[j] = x[j] * c[j] + x[j - half] * s[j];
  };
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(rows_[b] >= 0 && rows_[b] < keys.size(0), "rotary_write: row out of range");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(slots_[b][i] >= 0 && slots_[b][i] < S, "rotary_write: slot out of range");
  }
  const int64_t grain = std::max<int64_t>(1, kGrain / ((heads + 2 * kv_heads) * D));
  at::parallel_for(0, B * n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / n, i = t % n, r = rows_[b], slot = slots_[b][i];
      const float* c = cos.data_ptr<float>() + b * cos.stride(0) + i * cos.stride(1);
      const float* s = sin.data_ptr<float>() + b * sin.stride(0) + i * sin.stride(1);
      const float* q = query.data_ptr<float>() + b * query.stride(0) + i * query.stride(1);
      for (int64_t h = 0; h < heads; ++h) rotate(q + h * D, c, s, q_out + ((b * heads + h) * n + i) * D);
      const float* k = key.data_ptr<float>() + b * key.stride(0) + i * key.stride(1);
      const float* v = value.data_ptr<float>() + b * value.stride(0) + i * value.stride(1);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = ((r * kv_heads + h) * S + slot) * D;
        rotate(k + h * D, c, s, k_cache + at);
        for (int64_t j = 0; j < D; ++j) v_cache[at + j] = v[h * D + j];
      }
    }
  });
  return out;
}

// silu(gate) * up, elementwise (both (..., I), rows possibly strided; e^x by exp8, within 1e-7 of torch's)
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  check_float_cpu(gate, "gate");
  check_float_cpu(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.dim() == 3, "silu_mul: gate and up must be (B, n, I) alike");
  if (gate.numel() > kGrain) return at::silu(gate) * up;  // a prefill: torch's vectorized, threaded operations
  auto out = torch::empty(gate.sizes(), gate.options());
  const int64_t B = gate.size(0), n = gate.size(1), I = gate.size(2);
  float* y = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) {
      const float* g = gate.data_ptr<float>() + b * gate.stride(0) + i * gate.stride(1);
      const float* u = up.data_ptr<float>() + b * up.stride(0) + i * up.stride(1);
      float* o = y + (b * n + i) * I;
      int64_t j = 0;
      for (; j + 8 <= I; j += 8) _mm256_storeu_ps(o + j, silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
      if (j < I) {  // the last few through the same operations, in a padded block
        alignas(32) float tail[3][8] = {};
        for (int64_t t = 0; j + t < I; ++t) tail[0][t] = g[j + t], tail[1][t] = u[j + t];
        _mm256_store_ps(tail[2], silu_mul8(_mm256_load_ps(tail[0]), _mm256_load_ps(tail[1])));
        for (int64_t t = 0; j + t < I; ++t) o[j + t] = tail[2][t];
      }
    }
  return out;
}

}  // namespace medusa_heads
