// The attention of a pass of a few queries (a decoding step, a tree) over the cache, one query row at a time:
// scores over the visible slots, an exact two-pass softmax, the weighted values, written in the layout the output
// product reads (B, n, heads * D). torch's sdpa costs ~13 us a layer for one query over 200 keys on a 2-core
// EPYC, most of it set-up; a row here does the work alone, and its result does not depend on the pass's other
// rows (a token's attention rounds alike in a plain step and in any tree).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <limits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kWorkPerThread = 1 << 17;  // multiply-adds a thread takes at least (below: one thread)
constexpr float kMasked = -1e30f;             // an additive mask at or below this hides its key
constexpr int64_t kMaxChunks = 16;            // head sizes up to 128 (8 floats a chunk)

// softmax(scale * q . k_j + mask_j) . v over the visible keys the mask does not hide, for one query row; D a multiple
// of 8 up to 128 (C = D / 8 when known at compile time: the sums stay in registers). Every sum runs over those keys
// alone, in slot order, so a row sums alike whatever hidden slots lie between them (a tree's other branches): as the
// same token's row does in a plain step. seen, scores: room for `visible` entries.
template <int C>
void attend_row(const float* q, const float* keys, const float* values, int64_t visible, int64_t D,
                const float* mask, int64_t mask_stride, float scale, int64_t* seen, float* scores, float* out) {
  const int64_t chunks = C ? C : D / 8;
  float top = -std::numeric_limits<float>::infinity();
  int64_t count = 0;
  for (int64_t j = 0; j < visible; ++j) {
    const float bias = mask ? mask[j * mask_stride] : 0.0f;
    if (bias <= kMasked) continue;
    const float* k = keys + j * D;
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    for (int64_t c = 1; c < chunks; ++c) sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), sum);
    seen[count] = j;
    scores[count] = medusa_heads::horizontal_sum(sum) * scale + bias;
    top = std::max(top, scores[count++]);
  }
  if (count == 0) {  // every key hidden: zeros
    for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
    return;
  }
  for (int64_t j = 0; j < count; ++j) scores[j] = scores[j] - top;
  int64_t j = 0;
  __m256 totals = _mm256_setzero_ps();
  for (; j + 8 <= count; j += 8) {
    const __m256 e = medusa_heads::exp8(_mm256_loadu_ps(scores + j));
    _mm256_storeu_ps(scores + j, e);
    totals = _mm256_add_ps(totals, e);
  }
  float total = medusa_heads::horizontal_sum(totals);
  if (j < count) {  // the last few through the same exp, in a padded block
    alignas(32) float tail[8];
    for (int64_t t = 0; t < 8; ++t) tail[t] = j + t < count ? scores[j + t] : -std::numeric_limits<float>::infinity();
    _mm256_store_ps(tail, medusa_heads::exp8(_mm256_load_ps(tail)));
    for (int64_t t = 0; j + t < count; ++t) scores[j + t] = tail[t], total += tail[t];
  }
  __m256 acc[kMaxChunks];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    if (scores[j] == 0.0f) continue;
    const __m256 p = _mm256_set1_ps(scores[j]);
    const float* v = values + seen[j] * D;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / total);
  for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inverse));
}

}  // namespace

// query (B, heads, n, D); keys, values: one cache layer (R, kv_heads, S, D), batch row b's at cache row rows[b], its
// first `visible` slots seen; mask: additive (B, 1 or heads, n, visible), or none. Returns (B, n, heads * D).
torch::Tensor medusa_heads::attend(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                                   const torch::Tensor& rows, int64_t visible, const c10::optional<torch::Tensor>& mask,
                                   double scaling) {
  TORCH_CHECK(query.dim() == 4 && query.is_contiguous() && query.scalar_type() == torch::kFloat32 &&
                  keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == torch::kFloat32 && values.scalar_type() == torch::kFloat32,
              "attend: float32 contiguous query (B, heads, n, D) and cache layers (R, kv_heads, S, D) expected");
  const int64_t B = query.size(0), heads = query.size(1), n = query.size(2), D = query.size(3);
  const int64_t kv_heads = keys.size(1), S = keys.size(2);
  TORCH_CHECK(keys.size(3) == D && D % 8 == 0 && D <= 8 * kMaxChunks && heads % kv_heads == 0 && visible <= S && rows.numel() == B &&
                  rows.scalar_type() == torch::kLong,
              "attend: sizes do not match (head size a multiple of 8 up to 128, heads a multiple of the key/value heads)");
  const float* m = nullptr;
  int64_t mb = 0, mh = 0, mi = 0, mj = 0;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4 && mask->scalar_type() == torch::kFloat32 && mask->size(0) == B &&
                    (mask->size(1) == 1 || mask->size(1) == heads) && mask->size(2) == n && mask->size(3) == visible,
                "attend: an additive float32 mask (B, 1 or heads, n, visible) expected");
    m = mask->data_ptr<float>();
    mb = mask->stride(0), mh = mask->size(1) == 1 ? 0 : mask->stride(1), mi = mask->stride(2), mj = mask->stride(3);
  }
  auto rows_ = rows.accessor<int64_t, 1>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(rows_[b] >= 0 && rows_[b] < keys.size(0), "attend: row out of range");
  auto out = torch::empty({B, n, heads * D}, query.options());
  const float* q = query.data_ptr<float>();
  const float* k = keys.data_ptr<float>();
  const float* v = values.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const float scale = float(scaling);
  const int64_t group = heads / kv_heads;
  const int64_t grain = std::max<int64_t>(1, kWorkPerThread / std::max<int64_t>(1, 2 * visible * D));
  at::parallel_for(0, B * heads * n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(visible);
    std::vector<int64_t> seen(visible);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (heads * n), h = item / n % heads, i = item % n;
      const int64_t at = (rows_[b] * kv_heads + h / group) * S * D;
      const float* row_mask = m ? m + b * mb + h * mh + i * mi : nullptr;
      const float* qi = q + ((b * heads + h) * n + i) * D;
      float* yi = y + (b * n + i) * heads * D + h * D;
      if (D == 64)
        attend_row<8>(qi, k + at, v + at, visible, D, row_mask, mj, scale, seen.data(), scores.data(), yi);
      else if (D == 128)
        attend_row<16>(qi, k + at, v + at, visible, D, row_mask, mj, scale, seen.data(), scores.data(), yi);
      else
        attend_row<0>(qi, k + at, v + at, visible, D, row_mask, mj, scale, seen.data(), scores.data(), yi);
    }
  });
  return out;
}
