// Causal attention of prompt chunks over paged KV, in tiles (flash attention's plan on a CPU).
//
// A work item is kQueryTile tokens of one sequence with the `group` query heads of one KV head:
// its rows. It walks the keys the rows see a chunk at a time (the Way's kKeys). Scores and the
// weighted sum of values are small matrix products, done as outer products into registers (a
// query's or a probability's broadcast times a vector of keys, or of a value's dims), with the
// softmax online between them: a running max and sum per row, the sum of values rescaled when
// the max grows. The keys and values are unpacked to fp32 (keys transposed, chunk by chunk), so
// the products read contiguous floats whatever the cache holds: fp32, bf16, or int8 / fp8 codes
// with their scales; once for all the items of a sequence of several query tiles, by the item
// itself for a sequence of one (decode rows under batch_invariant, which all take this kernel).
// Items are taken heaviest first by whichever thread is free, so a causal prompt's long last
// rows do not leave one core waiting.
//
// On CPUs with AMX-BF16, a bf16 model's prompts over a bf16 cache go by AMX tiles instead
// (AmxWay): the keys and values repacked as the tiles read them (pairs of a key's dims, pairs of
// two keys' values), tdpbf16ps for the scores (scaled after, in fp32, as torch's flash kernel
// scales them) and for the weighted sum, with the probabilities rounded to bf16 (to nearest
// even, as torch's flash kernel rounds them for its bf16 product) and summed as rounded, so the
// weights that multiply the values are the ones the output is divided by.
//
// torch's SDPA (its CPU flash kernel) took about 3.5 ms a layer on a 512-token SmolLM2 prompt
// here, about 85 GFLOP/s where the cores reach over 400 in a large matmul.

#include "cpu_ops.h"
#include "kv_rows.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int kRowTile = 6;  // 6 x 4 accumulators and 4 operands: 28 of 32 registers
#else
constexpr int kRowTile = 3;  // 3 x 4 accumulators and 4 operands: AVX2's 16 registers
#endif
constexpr int kTileVectors = 4;  // vectors across a tile: keys for scores, a value's dims for the sum
constexpr int kTileWidth = kTileVectors * kLanes;
constexpr int kKeyChunk = kTileWidth;
constexpr int64_t kQueryTile = 16;  // tokens of a work item
constexpr float kMasked = -std::numeric_limits<float>::max();  // a score no key reaches (no infinities: -ffast-math)

// scores[r][k] = q[r] . key k for kRowTile rows of q (fp32, rows head_dim apart) and a chunk's
// keys, transposed: key k's dim d at keys[d * kKeyChunk + k].
inline void score_tile(const float* q, const float* keys, int64_t head_dim, float* scores) {
  vf acc[kRowTile][kTileVectors] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    vf k[kTileVectors];
    for (int j = 0; j < kTileVectors; ++j) k[j] = load_lanes(keys + d * kKeyChunk + j * kLanes);
    for (int r = 0; r < kRowTile; ++r) {
      const float x = q[r * head_dim + d];
      for (int j = 0; j < kTileVectors; ++j) acc[r][j] += x * k[j];
    }
  }
  for (int r = 0; r < kRowTile; ++r)
    for (int j = 0; j < kTileVectors; ++j) std::memcpy(scores + r * kKeyChunk + j * kLanes, &acc[r][j], sizeof(vf));
}

// sums[r] = sums[r] * rescale[r] + sum over the chunk's keys k of probs[r][k] * value k, over
// kTileVectors vectors of the values' dims (values fp32, rows head_dim apart; sums likewise).
inline void value_tile(const float* probs, const float* values, int64_t head_dim, const float* rescale, float* sums) {
  vf acc[kRowTile][kTileVectors];
  for (int r = 0; r < kRowTile; ++r)
    for (int j = 0; j < kTileVectors; ++j) acc[r][j] = load_lanes(sums + r * head_dim + j * kLanes) * rescale[r];
  for (int k = 0; k < kKeyChunk; ++k) {
    vf v[kTileVectors];
    for (int j = 0; j < kTileVectors; ++j) v[j] = load_lanes(values + k * head_dim + j * kLanes);
    for (int r = 0; r < kRowTile; ++r) {
      const float p = probs[r * kKeyChunk + k];
      for (int j = 0; j < kTileVectors; ++j) acc[r][j] += p * v[j];
    }
  }
  for (int r = 0; r < kRowTile; ++r)
    for (int j = 0; j < kTileVectors; ++j) std::memcpy(sums + r * head_dim + j * kLanes, &acc[r][j], sizeof(vf));
}

// How a row's scores become weights: the AMX way scales them (its queries are not), both cap them
// at softcap (> 0) as softcap * tanh(score / softcap).
struct Softmax {
  float scale, softcap, inverse_cap;
};

// A way to compute the products: its chunks of keys (kKeys), how a chunk's keys and values are
// unpacked (``put``: key and value rows of token t of the chunk; ``clear``: slot t holds no
// token), a tile's query rows held, and the scores, softmax and weighted sums computed for
// ``rows`` rows (a multiple of kRows).
// FloatWay: fp32 FMAs over keys unpacked to fp32 and transposed, queries scaled before.
struct FloatWay {
  using Elem = float;
  static constexpr int64_t kRows = kRowTile;
  static constexpr int64_t kKeys = kKeyChunk;

  template <typename Rows>
  static void put(const typename Rows::cache_t* key, const typename Rows::cache_t* value, int64_t t, int64_t head_dim,
                  float* key_dst, float* value_dst) {
    const float key_scale = Rows::scale(key, head_dim), value_scale = Rows::scale(value, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) {
      key_dst[d * kKeyChunk + t] = Rows::value(key, d) * key_scale;
      value_dst[t * head_dim + d] = Rows::value(value, d) * value_scale;
    }
  }
  static void clear(int64_t t, int64_t head_dim, float* key_dst, float* value_dst) {
    for (int64_t d = 0; d < head_dim; ++d) key_dst[d * kKeyChunk + t] = value_dst[t * head_dim + d] = 0.f;
  }
  template <typename scalar_t>
  static void query(const scalar_t* src, int64_t head_dim, float scale, float* dst) {
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * scale;
  }

  struct Thread {
    explicit Thread(int64_t) {}
    // Row r's chunk of scores (of scaled queries) in, as weights (0 outside [seen, visible)).
    void softmax(int64_t, float* p, int64_t seen, int64_t visible, const Softmax& how, float& row_max, float& row_sum,
                 float& rescale) {
      if (how.softcap > 0)
        for (int64_t k = seen; k < visible; ++k) p[k] = how.softcap * tanhf(p[k] * how.inverse_cap);
      float chunk_max = kMasked;
      for (int64_t k = seen; k < visible; ++k) chunk_max = std::max(chunk_max, p[k]);
      const float new_max = std::max(row_max, chunk_max);
      rescale = row_max == kMasked ? 0.f : expf(row_max - new_max);
      row_max = new_max;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < kKeyChunk; ++k) {
        p[k] = k >= seen && k < visible ? expf(p[k] - new_max) : 0.f;
        sum += p[k];
      }
      row_sum = row_sum * rescale + sum;
    }
    void scores(const float* q, const float* keys, int64_t rows, int64_t head_dim, float* scores) {
      for (int64_t r = 0; r < rows; r += kRows) score_tile(q + r * head_dim, keys, head_dim, scores + r * kKeyChunk);
    }
    void values(const float* probs, const float* values, int64_t rows, int64_t head_dim, const float* rescale, float* sums) {
      for (int64_t r = 0; r < rows; r += kRows)
        for (int64_t d = 0; d < head_dim; d += kTileWidth)
          value_tile(probs + r * kKeyChunk, values + d, head_dim, rescale + r, sums + r * head_dim + d);
    }
  };
};

#include "prompt_attention_amx.h"  // AmxWay, where the build has AMX

struct WorkItem {
  int64_t seq;          // index into the call's sequences
  int64_t kv_head;
  int64_t first_token;  // of the sequence's query tokens
  int64_t first_chunk;  // the first key chunk its rows see (0 but under a window)
  int64_t chunks;       // key chunks up to the last its rows see
};

// Attends the query rows of the sequences seq_ids names (the call's tensors: PagedCall, kv_rows.h),
// the products the Way's.
template <typename Way, typename scalar_t, typename Rows>
void prompt_attention_kernel(const PagedCall<scalar_t, typename Rows::cache_t>& call, const std::vector<int64_t>& seq_ids,
                             double scale, int64_t window, double softcap) {
  using Elem = typename Way::Elem;
  constexpr int64_t kKeys = Way::kKeys;  // a chunk of keys
  const int64_t head_dim = call.head_dim, num_kv_heads = call.num_kv_heads, group = call.group;
  const int64_t num_seqs = static_cast<int64_t>(seq_ids.size());
  const int64_t chunk_elems = kKeys * head_dim;

  // Key chunk c of KV head h of sequence i (seq_ids' i-th), unpacked as the Way reads it; the
  // slots past the sequence's keys zero.
  auto unpack = [&](int64_t i, int64_t h, int64_t c, Elem* key_dst, Elem* value_dst) {
    const int64_t s = seq_ids[i], key0 = c * kKeys;
    const int64_t count = std::min<int64_t>(kKeys, call.lens[s] - key0);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t offset = call.kv_offset(s, h, key0 + t);
      Way::template put<Rows>(call.k_ptr + offset, call.v_ptr + offset, t, head_dim, key_dst, value_dst);
    }
    for (int64_t t = count; t < kKeys; ++t) Way::clear(t, head_dim, key_dst, value_dst);
  };

  // A sequence of more than one query tile has its keys and values unpacked once for all its
  // items (chunk c of KV head h at (first[i] + c) * num_kv_heads + h); one of a single tile (a
  // decode row, a short chunk) has each chunk unpacked by its item as it goes, into its
  // thread's buffer. Either way a row's arithmetic is the same.
  std::vector<int64_t> first_chunk(num_seqs + 1, 0);
  for (int64_t i = 0; i < num_seqs; ++i) {
    const bool shared = call.query_len(seq_ids[i]) > kQueryTile;
    first_chunk[i + 1] = first_chunk[i] + (shared ? (call.lens[seq_ids[i]] + kKeys - 1) / kKeys : 0);
  }
  const int64_t num_chunks = first_chunk[num_seqs] * num_kv_heads;
  std::vector<Elem> keys(num_chunks * chunk_elems), values(num_chunks * chunk_elems);
  std::vector<int64_t> chunk_seq(first_chunk[num_seqs]);
  for (int64_t i = 0; i < num_seqs; ++i) std::fill(chunk_seq.begin() + first_chunk[i], chunk_seq.begin() + first_chunk[i + 1], i);
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t h = index % num_kv_heads, i = chunk_seq[index / num_kv_heads];
      unpack(i, h, index / num_kv_heads - first_chunk[i], keys.data() + index * chunk_elems, values.data() + index * chunk_elems);
    }
  });

  std::vector<WorkItem> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t s = seq_ids[i], query_len = call.query_len(s), context = call.context_len(s);
    for (int64_t first = 0; first < query_len; first += kQueryTile) {
      const int64_t last_position = context + std::min(first + kQueryTile, query_len) - 1;
      // With a window, the chunks before the first key any of its rows sees are skipped: for a
      // row they are masked whole, which would leave its max, sum and output as they were.
      const int64_t first_chunk_seen = window > 0 ? std::max<int64_t>(0, context + first - window + 1) / kKeys : 0;
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({i, h, first, first_chunk_seen, last_position / kKeys + 1});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.chunks - a.first_chunk > b.chunks - b.first_chunk; });

  const int64_t max_rows = (kQueryTile * group + Way::kRows - 1) / Way::kRows * Way::kRows;
  const float scale_f = static_cast<float>(scale);
  const Softmax how{scale_f, static_cast<float>(softcap), softcap > 0 ? static_cast<float>(1.0 / softcap) : 0.f};
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // row r: query head h * group + r % group of the item's token r / group (rows past the
    // last token repeat its position, with a zero query, to fill the last tile)
    typename Way::Thread products(max_rows);
    std::vector<Elem> q(max_rows * head_dim);
    std::vector<float> sums(max_rows * head_dim), scores(max_rows * kKeys);
    std::vector<Elem> own_keys(chunk_elems), own_values(chunk_elems);  // a single tile's chunk
    std::vector<float> row_max(max_rows), row_sum(max_rows), rescale(max_rows);
    std::vector<int64_t> position(max_rows);
    for (int64_t index = next_item++; index < static_cast<int64_t>(items.size()); index = next_item++) {
      const WorkItem& item = items[index];
      const int64_t s = seq_ids[item.seq], h = item.kv_head;
      const int64_t query_len = call.query_len(s), context = call.context_len(s);
      const int64_t tokens = std::min(kQueryTile, query_len - item.first_token);
      const int64_t rows = (tokens * group + Way::kRows - 1) / Way::kRows * Way::kRows;
      std::fill(q.begin(), q.end(), Elem{});
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = std::min(r / group, tokens - 1);
        position[r] = context + item.first_token + token;
        row_max[r] = kMasked;
        row_sum[r] = 0.f;
        if (r >= tokens * group) continue;
        const scalar_t* src = call.query_at(call.starts[s] + item.first_token + token, h * group + r % group);
        Way::query(src, head_dim, scale_f, q.data() + r * head_dim);
      }
      std::fill(sums.begin(), sums.begin() + rows * head_dim, 0.f);
      const bool shared = first_chunk[item.seq + 1] > first_chunk[item.seq];
      for (int64_t c = item.first_chunk; c < item.chunks; ++c) {
        const Elem* chunk_keys = own_keys.data();
        const Elem* chunk_values = own_values.data();
        if (shared) {
          const int64_t chunk = (first_chunk[item.seq] + c) * num_kv_heads + h;
          chunk_keys = keys.data() + chunk * chunk_elems;
          chunk_values = values.data() + chunk * chunk_elems;
        } else {
          unpack(item.seq, h, c, own_keys.data(), own_values.data());
        }
        products.scores(q.data(), chunk_keys, rows, head_dim, scores.data());
        for (int64_t r = 0; r < rows; ++r) {  // the online softmax, this chunk's keys in
          // keys [seen, visible) of the chunk: up to the row's own, and within its window
          const int64_t visible = std::clamp<int64_t>(position[r] - c * kKeys + 1, 0, kKeys);
          const int64_t seen = window > 0 ? std::clamp<int64_t>(position[r] - window + 1 - c * kKeys, 0, kKeys) : 0;
          products.softmax(r, scores.data() + r * kKeys, seen, visible, how, row_max[r], row_sum[r], rescale[r]);
        }
        products.values(scores.data(), chunk_values, rows, head_dim, rescale.data(), sums.data());
      }
      for (int64_t r = 0; r < tokens * group; ++r) {
        scalar_t* dst = call.out_at(call.starts[s] + item.first_token + r / group, h * group + r % group);
        const float inverse = 1.f / row_sum[r];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<scalar_t>(sums[r * head_dim + d] * inverse);
      }
    }
  });
}

}  // namespace

namespace duet_cpu {

bool prompt_attention_takes(int64_t head_dim) { return head_dim % kTileWidth == 0; }

bool prompt_attention_amx() {
#ifdef DUET_AMX
  return amx_attention.load() && duet_amx::permitted();
#else
  return false;
#endif
}

void set_prompt_attention_amx(bool on) {
#ifdef DUET_AMX
  TORCH_CHECK(!on || duet_amx::permitted(), "AMX tiles need a CPU with AMX-BF16 (and a build for it)");
  amx_attention.store(on);
#else
  TORCH_CHECK(!on, "AMX tiles need a CPU with AMX-BF16 (and a build for it)");
#endif
}

bool prompt_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                      torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                      std::vector<int64_t> seq_ids, double scale, int64_t window, double softcap) {
  if (!prompt_attention_takes(query.size(2))) return false;  // value tiles span a row's dims
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out need a contiguous last dim");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key and value caches must share a dtype");
  DUET_DISPATCH(query.scalar_type(), scalar_t, [&] {
    dispatch_rows<scalar_t>(key_cache, [&](auto rows) {
      using Rows = decltype(rows);
      const PagedCall<scalar_t, typename Rows::cache_t> call(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                             query_start_loc);
#ifdef DUET_AMX
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<Rows, FloatRows<c10::BFloat16>>) {
        if (duet_cpu::prompt_attention_amx())
          return prompt_attention_kernel<AmxWay, scalar_t, Rows>(call, seq_ids, scale, window, softcap);
      }
#endif
      prompt_attention_kernel<FloatWay, scalar_t, Rows>(call, seq_ids, scale, window, softcap);
    });
  });
  return true;
}

}  // namespace duet_cpu
