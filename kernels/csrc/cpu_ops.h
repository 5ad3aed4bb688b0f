// The entry points of cpu_ops.cpp, paged_attention.cpp and prompt_attention.cpp
// (decoder_stack.cpp calls some of them directly, without Python).
#pragma once

#include <torch/types.h>  // a third of torch/extension.h's compile time; only the binding files include that

#include <vector>

namespace duet_cpu {

// Cascade attention's groups (cascade.h): each {prefix_tokens, s, s', ...}, sequences whose block
// tables share their first prefix_tokens / block_size blocks, wholly before their query rows.
using CascadeGroups = std::vector<std::vector<int64_t>>;

// What the decode kernel does for a cascade's sequences: each row sees only the keys from
// first[its sequence] on (0: all), and leaves the log-sum-exp of its scores in lse[row][head].
struct CascadeSuffix {
  std::vector<int64_t> first;
  std::vector<float> lse;
};

// window > 0: each query row sees its last `window` keys (itself included), a sliding window.
// `cascade`'s groups attend to their shared blocks once for all their rows (cascade.h) where
// the decode kernel serves them (heads of 64 or 128, no window); elsewhere they are ignored.
void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                     torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                     std::vector<int64_t> seq_ids, double scale, int64_t window, const CascadeGroups& cascade);
// Attention for prompt chunks (prompt_attention.cpp), with paged_attention's arguments, and
// softcap > 0: scores become softcap * tanh(score / softcap); false, having done nothing, where
// head_dim is not a multiple of its tiles' width.
bool prompt_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                      torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                      std::vector<int64_t> seq_ids, double scale, int64_t window, double softcap);
// Whether prompt_attention takes heads of head_dim.
bool prompt_attention_takes(int64_t head_dim);
// Whether bf16 prompts over a bf16 cache go by AMX tiles (the CPU, the build and the kernel's
// permission allow it, and it is not switched off), and switching it.
bool prompt_attention_amx();
void set_prompt_attention_amx(bool on);
void rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, bool add_residual);
void rope_and_cache(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions, torch::Tensor cos,
                    torch::Tensor sin, torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor slot_mapping);
void silu_and_mul(torch::Tensor out, torch::Tensor x);
// y[i] += (x[i] A^T) B^T with the A and B^T of row i's adapter slot (lora.cpp); a slot < 0 or an
// empty A leaves the row as it is.
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor row_slots, const std::vector<torch::Tensor>& a,
              const std::vector<torch::Tensor>& bt);
// destination's blocks destination_blocks[i] = source's blocks source_blocks[i] (block_copy.cpp),
// for every layer, K and V and head of the two [layers, 2, heads, blocks, block_size, head_dim]
// views; returns the copied bytes' checksum (the wrapping sum of their 64-bit words).
int64_t copy_blocks_sum(torch::Tensor destination, torch::Tensor source, torch::Tensor source_blocks,
                        torch::Tensor destination_blocks);

}  // namespace duet_cpu
