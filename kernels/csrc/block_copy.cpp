// Whole KV blocks copied between two [layers, 2, heads, blocks, block_size, head_dim] views (a KV
// cache and a transfer's packed run, kv_transfer/wire.py), with the copied bytes' checksum taken
// in the same pass: the sum of their 64-bit words, wrapping (kv_transfer/faults.py's `checksum`
// of the packed run; a sum is the same in any order). A transfer packed, then read the run again
// for its checksum, on each side: two passes over every byte where one does.

#include "cpu_ops.h"

#include <cstdint>
#include <cstring>

namespace duet_cpu {
namespace {

// Copies `words` 64-bit words from `source` to `destination` and returns their wrapping sum
// (eight sums side by side: the loop vectorises, and is bound by memory).
uint64_t copy_and_sum(char* __restrict destination, const char* __restrict source, int64_t words) {
  uint64_t sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= words; k += 8) {
    uint64_t lanes[8];
    std::memcpy(lanes, source + 8 * k, sizeof lanes);
    std::memcpy(destination + 8 * k, lanes, sizeof lanes);
    for (int j = 0; j < 8; ++j) sums[j] += lanes[j];
  }
  uint64_t sum = 0;
  for (; k < words; ++k) {
    uint64_t word;
    std::memcpy(&word, source + 8 * k, 8);
    std::memcpy(destination + 8 * k, &word, 8);
    sum += word;
  }
  for (uint64_t lane : sums) sum += lane;
  return sum;
}

void check_blocks(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 6, name, ": a CPU tensor [layers, 2, heads, blocks, block_size, head_dim]");
  TORCH_CHECK(t.stride(5) == 1 && t.stride(4) == t.size(5) && t.stride(3) == t.size(4) * t.size(5),
              name, ": each block's rows contiguous, blocks one after another");
}

}  // namespace

int64_t copy_blocks_sum(torch::Tensor destination, torch::Tensor source, torch::Tensor source_blocks,
                        torch::Tensor destination_blocks) {
  check_blocks(destination, "destination");
  check_blocks(source, "source");
  TORCH_CHECK(destination.scalar_type() == source.scalar_type(), "source and destination of one dtype");
  for (int d : {0, 1, 2, 4, 5}) TORCH_CHECK(destination.size(d) == source.size(d), "source and destination differ in dim ", d);
  TORCH_CHECK(source_blocks.scalar_type() == torch::kInt64 && destination_blocks.scalar_type() == torch::kInt64 &&
                  source_blocks.dim() == 1 && source_blocks.is_contiguous() && destination_blocks.is_contiguous() &&
                  source_blocks.numel() == destination_blocks.numel(),
              "one int64 block id on each side per block copied");
  const int64_t element = source.element_size();
  const int64_t block_bytes = source.stride(3) * element;
  TORCH_CHECK(block_bytes % 8 == 0, "a block of a multiple of 8 bytes");
  const int64_t n = source_blocks.numel();
  const int64_t* from = source_blocks.data_ptr<int64_t>();
  const int64_t* to = destination_blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(from[i] >= 0 && from[i] < source.size(3) && to[i] >= 0 && to[i] < destination.size(3), "a block id out of range");
  }
  char* out = static_cast<char*>(destination.data_ptr());
  const char* in = static_cast<const char*>(source.data_ptr());
  uint64_t sum = 0;
  for (int64_t layer = 0; layer < source.size(0); ++layer) {
    for (int64_t kv = 0; kv < source.size(1); ++kv) {
      for (int64_t head = 0; head < source.size(2); ++head) {
        const char* row_in = in + (layer * source.stride(0) + kv * source.stride(1) + head * source.stride(2)) * element;
        char* row_out = out + (layer * destination.stride(0) + kv * destination.stride(1) + head * destination.stride(2)) * element;
        for (int64_t i = 0; i < n; ++i) {
          sum += copy_and_sum(row_out + to[i] * block_bytes, row_in + from[i] * block_bytes, block_bytes / 8);
        }
      }
    }
  }
  return static_cast<int64_t>(sum);
}

}  // namespace duet_cpu
