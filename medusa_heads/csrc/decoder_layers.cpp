// A Llama-family decoder's layers for one pass in one call: per layer the fused operations of decoder_ops.cpp, the
// products by the step's kernel route and the attention (attention.cpp or torch's sdpa), with no Python between
// them (the loop in Python costs ~50 us a layer, as much as a small model's layer takes in everything but its
// products).
#include <ATen/core/dispatch/Dispatcher.h>

#include "kernels.h"

namespace {

enum Route : int64_t { kAten = 0, kStream = 1, kPacked = 2, kDraft = 3, kColumns = 4 };  // lean.Native.ROUTES
constexpr int64_t kFewQueries = 64;  // passes of up to this many tokens attend by attention.cpp (2.7x faster than
                                     // sdpa at 4 tokens over 200 keys, 1.3x at 64 on a 2-core EPYC), others by sdpa

c10::optional<torch::Tensor> bias_of(const torch::Tensor& bias) {
  return bias.numel() ? c10::optional<torch::Tensor>(bias) : c10::nullopt;  // an empty tensor: no bias
}

// x W^T + b of N outputs; W: the weight, or its copy by columns (columns route) or packed (packed route)
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, int64_t route,
                      int64_t N) {
  if (route == kStream || route == kDraft)  // a draft's sums may round in another order
    return medusa_heads::stream_linear(x, weight, bias_of(bias), route == kDraft);
  if (route == kColumns) return medusa_heads::columns_linear(x, weight, bias_of(bias), N);
  if (weight.scalar_type() != x.scalar_type()) {  // a bfloat16 model's pass (in float32): other routes take bfloat16
    const auto dtype = weight.scalar_type();
    return product(x.to(dtype), weight, bias.to(dtype), route, N).to(x.scalar_type());
  }
  if (route == kPacked) {  // oneDNN's linear over the weight's packed copy (what speed._packed_linear calls)
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                           c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                           c10::optional<c10::string_view>)>();
    return op.call(x.contiguous(), weight, bias_of(bias), "none", c10::List<c10::optional<at::Scalar>>(),
                   c10::optional<c10::string_view>(""));
  }
  return at::linear(x, weight, bias_of(bias));
}

// the products of the linear layers that read x: one over their fused weights, split, or one per layer;
// params: (weight, bias) per product
std::vector<torch::Tensor> products(const torch::Tensor& x, const torch::Tensor* params, bool fused,
                                    at::IntArrayRef sizes, int64_t route) {
  if (fused) {
    int64_t N = 0;
    for (const int64_t size : sizes) N += size;
    return product(x, params[0], params[1], route, N).split_with_sizes(sizes, -1);
  }
  std::vector<torch::Tensor> out;
  for (size_t p = 0; p < sizes.size(); ++p)
    out.push_back(product(x, params[2 * p], params[2 * p + 1], route, sizes[p]));
  return out;
}

// an RMS norm over each head (D values) of x (B, n, heads * D), rows possibly strided (Qwen3's q/k norms)
torch::Tensor head_norm(const torch::Tensor& x, const torch::Tensor& weight, int64_t D, double eps) {
  auto out = torch::empty(x.sizes(), x.options());
  const int64_t B = x.size(0), n = x.size(1), heads = x.size(2) / D;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) {
      const float* row = x.data_ptr<float>() + b * x.stride(0) + i * x.stride(1);
      float* y = out.data_ptr<float>() + (b * n + i) * heads * D;
      for (int64_t h = 0; h < heads; ++h)
        medusa_heads::norm_row(row + h * D, weight.data_ptr<float>(), D, float(eps), y + h * D);
    }
  return out;
}

}  // namespace

// hidden (B, n, H): the embedded tokens, updated in place as the residual stream; returns the final norm of the
// last layer's output (its output itself where final_norm is empty, as for an EAGLE-style draft's layer). Per layer,
// params holds: input norm (empty: none, the first layer only), q norm, k norm (empty tensors where the model has none),
// (weight, bias) of the q/k/v products (one fused, or three), of o, the post-attention norm, (weight, bias) of the
// gate/up products (one fused, or two), of down. The keys and values are written into cache layer i of keys /
// values (layers, R, kv_heads, S, D) at rows[b], slots[b, j]; the attention reads its first `visible` slots, of
// the rows `subset` lists (all rows when not given), through masks[i].
torch::Tensor medusa_heads::decoder_layers(torch::Tensor hidden, const std::vector<torch::Tensor>& params,
                                           bool qkv_fused, std::vector<int64_t> qkv_sizes, bool gate_up_fused,
                                           std::vector<int64_t> gate_up_sizes, const torch::Tensor& final_norm,
                                           double eps, int64_t route, const torch::Tensor& cos, const torch::Tensor& sin,
                                           torch::Tensor& keys, torch::Tensor& values, const torch::Tensor& rows,
                                           const torch::Tensor& slots, const c10::optional<torch::Tensor>& subset,
                                           int64_t visible, const std::vector<c10::optional<torch::Tensor>>& masks,
                                           double scaling) {
  TORCH_CHECK(qkv_sizes.size() == 3 && gate_up_sizes.size() == 2, "decoder_layers: q/k/v and gate/up sizes expected");
  const int64_t per_layer = 3 + (qkv_fused ? 2 : 6) + 2 + 1 + (gate_up_fused ? 2 : 4) + 2;
  const int64_t layers = keys.size(0), B = hidden.size(0), n = hidden.size(1), D = cos.size(-1);
  TORCH_CHECK(int64_t(params.size()) == layers * per_layer && int64_t(masks.size()) == layers,
              "decoder_layers: params or masks do not match the cache's layers");
  c10::optional<torch::Tensor> delta;  // the last layer's MLP output, added to hidden by the next norm
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* p = params.data() + i * per_layer;
    const torch::Tensor &input_norm = p[0], &q_norm = p[1], &k_norm = p[2];
    p += 3;
    TORCH_CHECK(input_norm.numel() || i == 0, "decoder_layers: only the first layer may lack its input norm");
    auto qkv = products(input_norm.numel() ? rms_norm(hidden, input_norm, eps, delta) : hidden, p, qkv_fused,
                        qkv_sizes, route);
    p += qkv_fused ? 2 : 6;
    if (q_norm.numel()) {
      qkv[0] = head_norm(qkv[0], q_norm, D, eps);
      qkv[1] = head_norm(qkv[1], k_norm, D, eps);
    }
    auto layer_keys = keys.select(0, i), layer_values = values.select(0, i);
    auto query = rotary_write(qkv[0], qkv[1], qkv[2], cos, sin, layer_keys, layer_values, rows, slots);
    torch::Tensor attended;
    if (n <= kFewQueries && D % 8 == 0 && D <= 128) {  // what attend computes
      attended = attend(query, layer_keys, layer_values, rows, visible, masks[i], scaling);
    } else {
      auto seen_keys = layer_keys.narrow(2, 0, visible), seen_values = layer_values.narrow(2, 0, visible);
      if (subset.has_value()) {
        seen_keys = seen_keys.index_select(0, *subset);
        seen_values = seen_values.index_select(0, *subset);
      }
      attended = at::scaled_dot_product_attention(query, seen_keys, seen_values, masks[i], 0.0, false, scaling,
                                                  /*enable_gqa=*/true)
                     .transpose(1, 2)
                     .reshape({B, n, -1});
    }
    auto out = product(attended, p[0], p[1], route, hidden.size(2));
    const torch::Tensor& post_norm = p[2];
    p += 3;
    auto gate_up = products(rms_norm(hidden, post_norm, eps, out), p, gate_up_fused, gate_up_sizes, route);
    p += gate_up_fused ? 2 : 4;
    delta = product(silu_mul(gate_up[0], gate_up[1]), p[0], p[1], route, hidden.size(2));
  }
  if (!final_norm.numel()) return hidden.add_(*delta);
  return rms_norm(hidden, final_norm, eps, delta);
}
