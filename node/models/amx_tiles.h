// What every AMX kernel here needs (int8_amx.cpp, prefill_attention.cpp): the tile state
// granted by Linux, the tile configuration record, and the compiler fence around tile ops.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#define FEDKV_AMX 1

namespace fedkv_tiles {

// Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); once per process.
inline bool request() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// GCC's tile intrinsics are asm statements that do not tell the compiler they read or write
// memory: without this fence it drops the stores a tile load reads, or reuses values from
// before a tile store.
inline void fence() { asm volatile("" : : : "memory"); }

// ldtilecfg's 64-byte record (palette 1); every reserved byte must be zero.
struct alignas(64) Config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace fedkv_tiles
#endif
