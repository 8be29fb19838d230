// Chained Medusa heads drafting a tree in one call (on the CPU, in float32 over float32 or bfloat16 weights): per
// depth, head d's token input, its residual blocks, its vocabulary projection and the top-k of each source node, with
// no Python between them (in torch operations a depth costs ~1.9 ms on a 2-core Zen 3 for ~0.5 ms of memory to
// read). The same operations as medusa_heads.heads.MedusaHeads.draft, in the same order; the products by the stream
// kernel.
#include <immintrin.h>

#include <limits>

#include "kernels.h"

namespace {

void check_long(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kLong && t.is_contiguous(), name,
              " must be a contiguous int64 tensor on the CPU");
}

void check_matrix(const torch::Tensor& w, int64_t K, const char* name) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.size(1) == K && w.is_contiguous(), name,
              " must be a contiguous matrix of ", K, " columns on the CPU");
}

// X W^T + b by the stream kernel in a draft's order of sums (b empty: no bias; a bfloat16 b widened)
torch::Tensor product(const torch::Tensor& X, const torch::Tensor& W, const torch::Tensor& b) {
  const auto bias = b.numel() ? c10::optional<torch::Tensor>(b.to(torch::kFloat32)) : c10::nullopt;
  return medusa_heads::stream_linear(X, W, bias, true);
}

// x += silu(y), elementwise over n floats (e^x by exp8, as silu_mul)
void add_silu(float* x, const float* y, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(x + j, _mm256_add_ps(_mm256_loadu_ps(x + j), medusa_heads::silu8(_mm256_loadu_ps(y + j))));
  if (j < n) {  // the last few through the same operations, in a padded block
    alignas(32) float tail[8] = {};
    for (int64_t t = 0; j + t < n; ++t) tail[t] = y[j + t];
    _mm256_store_ps(tail, medusa_heads::silu8(_mm256_load_ps(tail)));
    for (int64_t t = 0; j + t < n; ++t) x[j + t] += tail[t];
  }
}

// the positions of the k largest of v[0..V), largest first (equal values: the lower position first)
void top_k(const float* v, int64_t V, int64_t k, int64_t* out) {
  std::vector<float> best(k, -std::numeric_limits<float>::infinity());
  int64_t filled = 0;
  for (int64_t i = 0; i < V; ++i) {
    const float x = v[i];
    if (filled == k && !(x > best[k - 1])) continue;
    int64_t j = filled < k ? filled++ : k - 1;
    for (; j > 0 && best[j - 1] < x; --j) best[j] = best[j - 1], out[j] = out[j - 1];
    best[j] = x, out[j] = i;
  }
}

}  // namespace

// hidden (B, H), float32: each row's last accepted hidden state; root (B,): its next token, the tree's root.
// embeddings: the lm_head rows the heads' token inputs read (RMS-normalised with eps). params, per head: its token
// input's weight, `layers` residual blocks' (weight, bias), its projection's weight and bias (empty: none). Weights
// and embeddings float32 or bfloat16 (a bfloat16 model's heads: their sums and states in float32 all the same).
// levels, per depth d: sources, parents, children, source_of_child, ranks (medusa_heads.tree.Level). token_map: the
// token ids of a draft vocabulary's logits (absent: the logits are token ids). Returns the candidate tokens of the
// tree's head nodes, (B, nodes - 1).
torch::Tensor medusa_heads::chained_draft(const torch::Tensor& hidden, const torch::Tensor& root,
                                          const torch::Tensor& embeddings, double eps,
                                          const std::vector<torch::Tensor>& params, int64_t layers,
                                          const std::vector<torch::Tensor>& levels, int64_t topk,
                                          const c10::optional<torch::Tensor>& token_map) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == torch::kFloat32 && hidden.dim() == 2,
              "chained_draft: hidden must be (B, H) float32 on the CPU");
  const int64_t B = hidden.size(0), H = hidden.size(1), per_head = 2 * layers + 3, depths = levels.size() / 5;
  TORCH_CHECK(root.device().is_cpu() && root.scalar_type() == torch::kLong, "chained_draft: root must be int64");
  check_matrix(embeddings, H, "chained_draft: embeddings");
  const bool halves = embeddings.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(halves || embeddings.scalar_type() == torch::kFloat32,
              "chained_draft: embeddings must be float32 or bfloat16");
  TORCH_CHECK(root.numel() == B && levels.size() % 5 == 0 && int64_t(params.size()) >= depths * per_head,
              "chained_draft: root, levels or params do not match");
  for (const auto& t : levels) check_long(t, "chained_draft: each level tensor");
  if (token_map.has_value()) check_long(*token_map, "chained_draft: token_map");
  int64_t nodes = 1;
  for (int64_t d = 0; d < depths; ++d) nodes += levels[5 * d + 2].numel();
  auto tokens = torch::empty({B, nodes}, root.options());
  int64_t* tok = tokens.data_ptr<int64_t>();
  const auto roots = root.contiguous();
  for (int64_t b = 0; b < B; ++b) tok[b * nodes] = roots.data_ptr<int64_t>()[b];
  std::vector<float> row(H);  // a bfloat16 embedding's row, widened
  torch::Tensor state = hidden.contiguous();  // (B * m, H): the previous depth's source states
  int64_t previous = 1;                       // m: sources per row at the previous depth
  for (int64_t d = 0; d < depths; ++d) {
    const torch::Tensor* level = levels.data() + 5 * d;
    const int64_t *sources = level[0].data_ptr<int64_t>(), *parents = level[1].data_ptr<int64_t>();
    const int64_t *children = level[2].data_ptr<int64_t>(), *source_of_child = level[3].data_ptr<int64_t>();
    const int64_t* ranks = level[4].data_ptr<int64_t>();
    const int64_t m = level[0].numel(), c = level[2].numel();
    TORCH_CHECK(level[1].numel() == m && level[3].numel() == c && level[4].numel() == c,
                "chained_draft: a level's sizes do not match");
    auto x = torch::empty({B * m, H}, hidden.options()), features = torch::empty({B * m, H}, hidden.options());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < m; ++j) {
        TORCH_CHECK(parents[j] >= 0 && parents[j] < previous && sources[j] >= 0 && sources[j] < nodes,
                    "chained_draft: a level's node out of range");
        const int64_t token = tok[b * nodes + sources[j]];
        TORCH_CHECK(token >= 0 && token < embeddings.size(0), "chained_draft: token out of range");
        const float* parent = state.data_ptr<float>() + (b * previous + parents[j]) * H;
        std::copy_n(parent, H, x.data_ptr<float>() + (b * m + j) * H);
        const float* embedding = halves ? row.data() : embeddings.data_ptr<float>() + token * H;
        if (halves) std::copy_n(embeddings.data_ptr<at::BFloat16>() + token * H, H, row.data());
        norm_row(embedding, nullptr, H, float(eps), features.data_ptr<float>() + (b * m + j) * H);
      }
    const torch::Tensor* p = params.data() + d * per_head;
    x += product(features, p[0], torch::Tensor());
    for (int64_t l = 0; l < layers; ++l)
      add_silu(x.data_ptr<float>(), product(x, p[1 + 2 * l], p[2 + 2 * l]).data_ptr<float>(), B * m * H);
    const auto logits = product(x, p[2 * layers + 1], p[2 * layers + 2]);
    const int64_t V = logits.size(1);
    TORCH_CHECK(topk >= 1 && topk <= V, "chained_draft: topk out of range");
    std::vector<int64_t> top(B * m * topk);
    for (int64_t r = 0; r < B * m; ++r) top_k(logits.data_ptr<float>() + r * V, V, topk, top.data() + r * topk);
    const int64_t* map = token_map.has_value() ? token_map->data_ptr<int64_t>() : nullptr;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < c; ++i) {
        TORCH_CHECK(source_of_child[i] >= 0 && source_of_child[i] < m && ranks[i] >= 0 && ranks[i] < topk &&
                        children[i] > 0 && children[i] < nodes,
                    "chained_draft: a level's child out of range");
        const int64_t at = top[(b * m + source_of_child[i]) * topk + ranks[i]];
        tok[b * nodes + children[i]] = map ? map[at] : at;
      }
    state = x, previous = m;
  }
  return tokens.narrow(1, 1, nodes - 1);
}
