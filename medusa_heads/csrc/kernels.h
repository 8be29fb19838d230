// The C++ kernels of the CPU decoding step (medusa_heads/kernels.py builds them into one module).
#pragma once
#include <torch/extension.h>

namespace medusa_heads {

torch::Tensor stream_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& bias);
torch::Tensor rms_norm(torch::Tensor& hidden, const torch::Tensor& weight, double eps,
                       const c10::optional<torch::Tensor>& delta);
torch::Tensor rotary_write(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                           const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& keys,
                           torch::Tensor& values, const torch::Tensor& rows, const torch::Tensor& slots);
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);

}  // namespace medusa_heads
