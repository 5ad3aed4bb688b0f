// AMX's tiles, as the kernels that use them ask for them (gguf_bf16.cpp's products,
// prompt_attention.cpp's bf16 attention): DUET_AMX where the build targets AMX-BF16, the
// process's permission, and a tile configuration.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#define DUET_AMX 1

namespace duet_amx {

// Linux gives a process AMX's tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); without them a tile instruction is SIGILL.
inline bool permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  void load() const {
    asm volatile("" : : "r"(this) : "memory");  // GCC does not see ldtilecfg read the stores (it dropped them)
    _tile_loadconfig(this);
  }
};

}  // namespace duet_amx
#endif
