// Shared by the kernels that use Intel AMX tiles (gguf_rows.cpp's amx_gemm, AMX-BF16; gguf_i8gemm.cpp's LM-head
// screen, AMX-INT8): the tile configuration's memory layout (palette 1) and whether the process may use the tiles.
// Plain C++: the tile instructions themselves are compiled by function attribute in each kernel.
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

namespace servelm_amx {

// ldtilecfg's 64 bytes: palette 1, then each tile's bytes a row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// CPUID leaf 7 EDX bits of the AMX features.
constexpr unsigned kBf16 = 1u << 22, kTile = 1u << 24, kInt8 = 1u << 25;

// Whether the CPU has every one of ``features`` (CPUID) and Linux grants this process the tile state (asked on
// each call: the request is idempotent; a kernel before 5.16 has none, and the answer is no). Callers keep the
// answer in a static.
inline bool granted(unsigned features) {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || (edx & features) != features) return false;
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

}  // namespace servelm_amx
