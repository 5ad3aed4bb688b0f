// The AMX way of prompt_attention.cpp's kernel (AmxWay): included there, after kMasked and
// Softmax, which it shares with the fp32 way.
#pragma once

#include "amx.h"
#include "bf16_lanes.h"
#include "kv_rows.h"

#include <atomic>
#include <vector>

namespace {

#ifdef DUET_AMX
// AmxWay: bf16 queries and keys in tiles of 16 rows. A chunk's keys are words of two dims,
// word p of key n at keys[p * kAmxKeys + n] (a tile of B: 16 pairs of dims by 16 keys); its
// values words of two keys, keys 2q and 2q + 1 at dim d in word q * head_dim + d (16 pairs of
// keys by 16 dims). Tile 0 holds A (16 query rows of 32 dims, or 16 rows' 32 probabilities),
// tiles 1-3 B, tiles 4-7 the sums (16 keys' scores each, or 16 dims' weighted sums).
constexpr int64_t kAmxRows = 16;
// A chunk's keys: a row's max, sum and sums are rescaled once a chunk. On a 2-core AMX Xeon
// (SmolLM2's heads, ms a layer at 128 / 512 / 2,048 tokens): 64 keys 0.083 / 0.679 / 9.02,
// 128 keys 0.082 / 0.593 / 7.38, 256 keys 0.128 / 0.615 / 7.52.
constexpr int64_t kAmxKeys = 128;

struct AmxWay {
  using Elem = uint16_t;  // bf16's bits
  static constexpr int64_t kRows = kAmxRows;
  static constexpr int64_t kKeys = kAmxKeys;

  template <typename Rows>
  static void put(const typename Rows::cache_t* key, const typename Rows::cache_t* value, int64_t t, int64_t head_dim,
                  uint16_t* key_dst, uint16_t* value_dst) {
    const auto* key_bits = reinterpret_cast<const uint16_t*>(key);
    const auto* value_bits = reinterpret_cast<const uint16_t*>(value);
    for (int64_t p = 0; p < head_dim / 2; ++p) {
      key_dst[2 * (p * kAmxKeys + t)] = key_bits[2 * p];
      key_dst[2 * (p * kAmxKeys + t) + 1] = key_bits[2 * p + 1];
    }
    for (int64_t d = 0; d < head_dim; ++d) value_dst[2 * ((t / 2) * head_dim + d) + t % 2] = value_bits[d];
  }
  static void clear(int64_t t, int64_t head_dim, uint16_t* key_dst, uint16_t* value_dst) {
    for (int64_t p = 0; p < head_dim / 2; ++p) key_dst[2 * (p * kAmxKeys + t)] = key_dst[2 * (p * kAmxKeys + t) + 1] = 0;
    for (int64_t d = 0; d < head_dim; ++d) value_dst[2 * ((t / 2) * head_dim + d) + t % 2] = 0;
  }
  template <typename scalar_t>
  static void query(const scalar_t* src, int64_t head_dim, float, uint16_t* dst) {
    std::memcpy(dst, src, head_dim * sizeof(uint16_t));
  }

  struct Thread {
    explicit Thread(int64_t max_rows) : probs16(max_rows * kAmxKeys), weighted(kAmxRows * 64) {
      duet_amx::TileConfig config;
      for (int t = 0; t < 8; ++t) {
        config.rows[t] = kAmxRows;
        config.bytes_per_row[t] = 64;
      }
      config.load();
    }
    ~Thread() { _tile_release(); }

    void scores(const uint16_t* q, const uint16_t* keys, int64_t rows, int64_t head_dim, float* scores) {
      for (int64_t r = 0; r < rows; r += kAmxRows) {
        for (int64_t k0 = 0; k0 < kAmxKeys; k0 += 64) {  // 64 keys a pass, 16 in each of tiles 4-7
          zero_sums();
          for (int64_t b = 0; b < head_dim / 32; ++b) {
            _tile_loadd(0, q + r * head_dim + b * 32, head_dim * sizeof(uint16_t));
            const uint16_t* pairs = keys + 2 * (b * 16 * kAmxKeys + k0);  // dims b * 32 on, as 16 rows of pairs
            _tile_loadd(1, pairs, kAmxKeys * 4);
            _tile_dpbf16ps(4, 0, 1);
            _tile_loadd(2, pairs + 2 * 16, kAmxKeys * 4);
            _tile_dpbf16ps(5, 0, 2);
            _tile_loadd(3, pairs + 2 * 32, kAmxKeys * 4);
            _tile_dpbf16ps(6, 0, 3);
            _tile_loadd(1, pairs + 2 * 48, kAmxKeys * 4);
            _tile_dpbf16ps(7, 0, 1);
          }
          float* out = scores + r * kAmxKeys + k0;
          _tile_stored(4, out, kAmxKeys * sizeof(float));
          _tile_stored(5, out + 16, kAmxKeys * sizeof(float));
          _tile_stored(6, out + 32, kAmxKeys * sizeof(float));
          _tile_stored(7, out + 48, kAmxKeys * sizeof(float));
        }
      }
    }

    // Row r's chunk of scores (unscaled) in: scaled, soft-capped, and the weights rounded to
    // bf16 (to nearest even) into row r of the tile of probabilities, summed as rounded.
    void softmax(int64_t r, float* p, int64_t seen, int64_t visible, const Softmax& how, float& row_max, float& row_sum,
                 float& rescale) {
      float scale = how.scale;
      if (how.softcap > 0) {
        for (int64_t k = seen; k < visible; ++k) p[k] = how.softcap * tanhf(p[k] * how.scale * how.inverse_cap);
        scale = 1.f;
      }
      const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512 v[kAmxKeys / 16];
      __mmask16 in[kAmxKeys / 16];
      __m512 most = _mm512_set1_ps(kMasked);
      for (int j = 0; j < kAmxKeys / 16; ++j) {
        const __m512i k = _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * j));
        in[j] = _mm512_cmpge_epi32_mask(k, _mm512_set1_epi32(static_cast<int>(seen))) &
                _mm512_cmplt_epi32_mask(k, _mm512_set1_epi32(static_cast<int>(visible)));
        v[j] = _mm512_mul_ps(_mm512_loadu_ps(p + 16 * j), _mm512_set1_ps(scale));
        most = _mm512_mask_max_ps(most, in[j], most, v[j]);
      }
      const float new_max = std::max(row_max, _mm512_reduce_max_ps(most));
      rescale = row_max == kMasked ? 0.f : expf(row_max - new_max);
      row_max = new_max;
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < kAmxKeys / 16; ++j) {
        uint16_t* out = probs16.data() + r * kAmxKeys + 16 * j;
        if (in[j] == 0) {  // no key here this row sees
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_setzero_si256());
          continue;
        }
        // a score less the max, at least -87 (e^-87, 1.6e-38, is nothing beside the max's weight, 1);
        // lanes of keys the row does not see may overflow, and are zeroed
        const __m512 x = _mm512_max_ps(_mm512_sub_ps(v[j], _mm512_set1_ps(new_max)), _mm512_set1_ps(-87.f));
        const __m256i bf16 = to_bf16(_mm512_maskz_mov_ps(in[j], exp_lanes(x)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16);
        sum = _mm512_add_ps(sum, widen(bf16));
      }
      row_sum = row_sum * rescale + _mm512_reduce_add_ps(sum);
    }

    // The weighted sums of the probabilities softmax left in the tile (the scores unused).
    void values(const float*, const uint16_t* values, int64_t rows, int64_t head_dim, const float* rescale, float* sums) {
      for (int64_t r = 0; r < rows; r += kAmxRows) {
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
          zero_sums();
          for (int64_t step = 0; step < kAmxKeys / 32; ++step) {
            _tile_loadd(0, probs16.data() + r * kAmxKeys + step * 32, kAmxKeys * sizeof(uint16_t));
            const uint16_t* pairs = values + 2 * (step * 16 * head_dim + d0);  // keys step * 32 on, in pairs
            _tile_loadd(1, pairs, head_dim * 4);
            _tile_dpbf16ps(4, 0, 1);
            _tile_loadd(2, pairs + 2 * 16, head_dim * 4);
            _tile_dpbf16ps(5, 0, 2);
            _tile_loadd(3, pairs + 2 * 32, head_dim * 4);
            _tile_dpbf16ps(6, 0, 3);
            _tile_loadd(1, pairs + 2 * 48, head_dim * 4);
            _tile_dpbf16ps(7, 0, 1);
          }
          _tile_stored(4, weighted.data(), 64 * sizeof(float));
          _tile_stored(5, weighted.data() + 16, 64 * sizeof(float));
          _tile_stored(6, weighted.data() + 32, 64 * sizeof(float));
          _tile_stored(7, weighted.data() + 48, 64 * sizeof(float));
          for (int64_t row = 0; row < kAmxRows; ++row) {
            float* sum = sums + (r + row) * head_dim + d0;
            const __m512 keep = _mm512_set1_ps(rescale[r + row]);
            for (int64_t d = 0; d < 64; d += 16)
              _mm512_storeu_ps(sum + d, _mm512_fmadd_ps(_mm512_loadu_ps(sum + d), keep, _mm512_loadu_ps(weighted.data() + row * 64 + d)));
          }
        }
      }
    }

   private:
    static void zero_sums() {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
    }
    std::vector<uint16_t> probs16;
    std::vector<float> weighted;  // 16 rows' sums for 64 dims
  };
};

std::atomic<bool> amx_attention{true};  // where permitted (set_prompt_attention_amx)
#endif

}  // namespace
