// The moves of a cache commit in one loop (medusa_heads.cache.TreeCache.commit): per row, the kept tokens of the last
// pass go from their slots to the first ones past the row's length, in every layer and head of the key and value
// buffers. torch's indexed copies of the same take ~0.3 ms a tree step on a 2-core EPYC (cold caches), most of it
// set-up: the bytes moved are a few tens of kilobytes.
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"

// keys, values (layers, B, heads, slots, D), contiguous, of one dtype; lengths (B,): each row's committed tokens;
// keep (B, a): keep[b, j] the offset past lengths[b] of the token that moves to offset j, for j < counts[b] (B,).
void medusa_heads::commit_moves(torch::Tensor& keys, torch::Tensor& values, const torch::Tensor& lengths,
                                const torch::Tensor& keep, const torch::Tensor& counts) {
  TORCH_CHECK(keys.dim() == 5 && keys.sizes() == values.sizes() && keys.scalar_type() == values.scalar_type() &&
                  keys.is_contiguous() && values.is_contiguous() && keys.device().is_cpu() && values.device().is_cpu(),
              "commit_moves: contiguous CPU key and value buffers (layers, B, heads, slots, D) of one shape expected");
  const int64_t layers = keys.size(0), B = keys.size(1), heads = keys.size(2), slots = keys.size(3);
  TORCH_CHECK(keep.scalar_type() == torch::kLong && keep.dim() == 2 && keep.size(0) == B &&
                  lengths.scalar_type() == torch::kLong && lengths.numel() == B &&
                  counts.scalar_type() == torch::kLong && counts.numel() == B,
              "commit_moves: int64 lengths (B,), keep (B, a) and counts (B,) expected");
  const int64_t a = keep.size(1), row_bytes = keys.size(4) * keys.element_size();
  const auto kept = keep.accessor<int64_t, 2>();
  const auto length = lengths.accessor<int64_t, 1>(), count = counts.accessor<int64_t, 1>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(count[b] >= 0 && count[b] <= a, "commit_moves: a count exceeds keep's columns");
    for (int64_t j = 0; j < count[b]; ++j)
      TORCH_CHECK(kept[b][j] >= 0 && length[b] + std::max(j, kept[b][j]) < slots, "commit_moves: a slot out of range");
  }
  std::vector<char> staged(a * row_bytes);  // a head's kept rows, read before any is written (sources may overlap)
  for (torch::Tensor* buffer : {&keys, &values}) {
    char* data = static_cast<char*>(buffer->data_ptr());
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t b = 0; b < B; ++b) {
        bool moves = false;
        for (int64_t j = 0; j < count[b]; ++j) moves |= kept[b][j] != j;
        if (!moves) continue;
        for (int64_t h = 0; h < heads; ++h) {
          char* head = data + (((l * B + b) * heads + h) * slots + length[b]) * row_bytes;
          for (int64_t j = 0; j < count[b]; ++j)
            std::memcpy(staged.data() + j * row_bytes, head + kept[b][j] * row_bytes, row_bytes);
          std::memcpy(head, staged.data(), count[b] * row_bytes);
        }
      }
  }
}
