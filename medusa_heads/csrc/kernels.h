// The C++ kernels of the CPU decoding step (medusa_heads/kernels.py builds them into one module).
#pragma once
#include <torch/extension.h>

#include <cmath>

namespace medusa_heads {

// y = weight * x / sqrt(mean(x^2) + eps) over one row of K values (the squares summed in double)
inline void norm_row(const float* x, const float* weight, int64_t K, float eps, float* y) {
  double squares = 0;
  for (int64_t k = 0; k < K; ++k) squares += double(x[k]) * x[k];
  const float scale = 1.0f / std::sqrt(float(squares / K) + eps);
  for (int64_t k = 0; k < K; ++k) y[k] = weight[k] * (x[k] * scale);
}

torch::Tensor stream_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& bias);
torch::Tensor rms_norm(torch::Tensor& hidden, const torch::Tensor& weight, double eps,
                       const c10::optional<torch::Tensor>& delta);
torch::Tensor rotary_write(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                           const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& keys,
                           torch::Tensor& values, const torch::Tensor& rows, const torch::Tensor& slots);
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor decoder_layers(torch::Tensor hidden, const std::vector<torch::Tensor>& params, bool qkv_fused,
                             std::vector<int64_t> qkv_sizes, bool gate_up_fused, std::vector<int64_t> gate_up_sizes,
                             const torch::Tensor& final_norm, double eps, int64_t route, const torch::Tensor& cos,
                             const torch::Tensor& sin, torch::Tensor& keys, torch::Tensor& values,
                             const torch::Tensor& rows, const torch::Tensor& slots,
                             const c10::optional<torch::Tensor>& subset, int64_t visible,
                             const std::vector<c10::optional<torch::Tensor>>& masks, double scaling);

}  // namespace medusa_heads
