// Greedy verification of a tree in one call (float32 or bfloat16 logits on the CPU): the base model's argmax at
// every node, the longest root-to-leaf path whose every token is its parent's argmax, and the bonus token, the
// argmax at the path's last node. The results of medusa_heads.acceptance.accept for greedy acceptance, whose dozen
// torch operations cost ~0.1 ms each after a step's products have emptied the caches.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "kernels.h"

namespace {

// the position of the largest of v[0..V): the first of equal ones, and a NaN is larger than any number (as torch's
// argmax has it)
int64_t argmax(const float* v, int64_t V) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), unordered = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 x = _mm256_loadu_ps(v + j);
    top = _mm256_max_ps(top, x);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float best = lanes[0];
  for (int l = 1; l < 8; ++l) best = std::max(best, lanes[l]);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (int64_t t = j; t < V; ++t) {
    nan |= std::isnan(v[t]);
    best = std::max(best, v[t]);
  }
  if (nan) {
    for (int64_t t = 0; t < V; ++t)
      if (std::isnan(v[t])) return t;
  }
  const __m256 wanted = _mm256_set1_ps(best);
  for (j = 0; j + 8 <= V; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + j), wanted, _CMP_EQ_OQ));
    if (hits) return j + __builtin_ctz(hits);
  }
  for (; j < V; ++j)
    if (v[j] == best) return j;
  return 0;
}

}  // namespace

// tokens (B, n): the tree's tokens; logits (B, n, V): the base model's at its nodes; parents (n,) or (B, n): each
// node's parent; retrieve (P, depth + 1) or (B, P, depth + 1): the nodes of each root-to-leaf path, -1 padded
// (medusa_heads.tree.Tree). Returns each row's chosen path (B, depth + 1), its accepted candidates below the root
// (B,) and the bonus token (B,); of equally long paths, the first.
std::vector<torch::Tensor> medusa_heads::greedy_accept(const torch::Tensor& tokens, const torch::Tensor& logits,
                                                       const torch::Tensor& parents, const torch::Tensor& retrieve) {
  const bool halves = logits.scalar_type() == torch::kBFloat16;  // a bfloat16 model's: widened exactly, same argmax
  TORCH_CHECK(logits.device().is_cpu() && (halves || logits.scalar_type() == torch::kFloat32) && logits.dim() == 3,
              "greedy_accept: float32 or bfloat16 logits (B, n, V) on the CPU expected");
  const int64_t B = logits.size(0), n = logits.size(1), V = logits.size(2);
  TORCH_CHECK(tokens.scalar_type() == torch::kLong && tokens.dim() == 2 && tokens.size(0) == B && tokens.size(1) == n,
              "greedy_accept: int64 tokens (B, n) expected");
  TORCH_CHECK(parents.scalar_type() == torch::kLong && retrieve.scalar_type() == torch::kLong && retrieve.dim() >= 2,
              "greedy_accept: int64 parents and retrieve expected");
  const auto rows = halves ? logits.to(torch::kFloat32).contiguous() : logits.contiguous();
  const auto parents_of = parents.expand({B, n});
  const auto parent = parents_of.accessor<int64_t, 2>();
  const auto paths_of = retrieve.expand({B, retrieve.size(-2), retrieve.size(-1)});
  const auto paths = paths_of.accessor<int64_t, 3>();
  const auto token = tokens.accessor<int64_t, 2>();
  const int64_t P = paths_of.size(1), width = paths_of.size(2);
  TORCH_CHECK(P > 0 && width > 0, "greedy_accept: a tree has at least one path");
  std::vector<int64_t> target(B * n);
  const float* L = rows.data_ptr<float>();
  at::parallel_for(0, B * n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) target[r] = argmax(L + r * V, V);
  });
  auto options = tokens.options().dtype(torch::kLong);
  auto path = torch::empty({B, width}, options), count = torch::empty({B}, options), next = torch::empty({B}, options);
  auto chosen = path.accessor<int64_t, 2>();
  auto accepted_of = count.accessor<int64_t, 1>(), bonus = next.accessor<int64_t, 1>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* argmax_at = target.data() + b * n;
    int64_t best = 0, longest = -1;
    for (int64_t p = 0; p < P; ++p) {
      int64_t accepted = 0;
      for (int64_t j = 1; j < width; ++j) {
        const int64_t node = paths[b][p][j];
        if (node < 0 || token[b][node] != argmax_at[parent[b][node]]) break;
        ++accepted;
      }
      if (accepted > longest) best = p, longest = accepted;
    }
    for (int64_t j = 0; j < width; ++j) chosen[b][j] = paths[b][best][j];
    accepted_of[b] = longest;
    bonus[b] = argmax_at[paths[b][best][longest]];
  }
  return {path, count, next};
}
