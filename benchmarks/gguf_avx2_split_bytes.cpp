// Standalone prototype (no torch): the AVX2 one-row pass over 5-bit centered packed codes (Q5_0's
// gate_up, 9728 x 896), as gguf_kernel_avx2.cpp's IntActivations::dot_rows<4, PackedCodes<5, true>>
// reads them, against a "split bytes" layout that was evaluated to replace it (not adopted):
//
//   split    int16 activations x = 256 xh + xl (xh = x >> 8 signed, xl = x & 255), codes unpacked to
//            32 unsigned bytes u per 32 inputs; int32 lane = madd(maddubs(u, xh), 256) +
//            madd(maddubs(xl, u), 1), exactly madd(u, x). Bytes 4l .. 4l + 3 hold codes 2l, 2l + 1,
//            16 + 2l, 17 + 2l, so each int32 lane sums today's four products: the same outputs bit
//            for bit (checked below). Two steps (64 codes) per 40 bytes: 32 bytes of nibbles (step A
//            low, step B high) and a 64-bit plane of high bits that one vpsrlvd (A) or vpsllvd (B) of
//            its broadcast puts at bit 4 of every byte: ~12.5 vector ops per 32 codes, not ~17.
//
// Routes, timed in interleaved rounds (median per call):
//   offsets  the kernel's pass before dd287b5: prefetch where a step's offset in its row starts a
//            cache line's worth (misses ~1 line in 10 of rows that do not start on a cache line)
//   stream   the same loop, its NW rows' bytes prefetched as one stream (LineStream, dd287b5)
//   per-row  the same loop, a prefetch per row and step
//   split    the split-bytes layout, stream prefetch
//   read     a plain AVX2 read of the codes (no compute)
//
// Measured 03:20-03:55 UTC 2026-12-02, AMD EPYC (Zen 3) VM, 2 cores, AVX2/FMA/F16C, load average 4-7
// (other sessions running), 1 thread, thread clock, copies of the weight cycled to exceed the L3
// ("cold"): offsets 1.0x, stream 1.28-1.58x, per-row 1.04-1.13x, split 1.23-1.54x; split / stream
// 0.96-1.23x cold (most runs 1.0-1.06x), 1.02-1.11x on one weight (L3), 1.02-1.11x with 512 rows
// (L2). This file's run at load 7: cold 1.00 / 1.28 / 1.04 / 1.23 (read 1.38). Once the stream
// prefetch is in, 1 thread reads about as fast as the plain read loop, so the layout change (all of
// PackedCodes, dot<ROWS>, unpack_rows, the Python pack/unpack) was not made: under the ~1.15x it had
// to clear.
//
//   g++ -O3 -mavx2 -mfma -mf16c -fopenmp benchmarks/gguf_avx2_split_bytes.cpp -o /tmp/split_bytes
//   OMP_NUM_THREADS=1 THREAD_CLOCK=1 /tmp/split_bytes [copies: 14 = cold] [rows: 9728]
#include <immintrin.h>
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int64_t kK = 896, kSteps = kK / 32, kRowBytes = kSteps * 20, kPrefetchBytes = 4096;
constexpr int kRows = 4;   // weight rows per pass (kOneRowWeights)
int64_t n_rows = 9728;

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- today's layout (gguf_blocks.PackedCodes, 5 bits) ----
int plane_position(int i) { return 16 * (i % 16 % 2) + 8 * (i / 16) + i % 16 / 2; }

void pack_today(const uint8_t* u, uint8_t* out) {   // u: kK stored values 0..31
  for (int c = 0; c < kSteps; ++c) {
    const uint8_t* s = u + 32 * c;
    uint8_t* o = out + 20 * c;
    uint32_t plane = 0;
    for (int j = 0; j < 16; ++j) o[j] = (s[j] & 15) | ((s[j + 16] & 15) << 4);
    for (int i = 0; i < 32; ++i) plane |= uint32_t(s[i] >> 4 & 1) << plane_position(i);
    std::memcpy(o + 16, &plane, 4);
  }
}

enum Prefetch { kOffsets, kStream, kPerRow };

template <Prefetch P>
void pass_today(const int16_t* xq, const uint8_t* w, const float* scaled, const int32_t* correction, float* out) {
  __m256 acc[kRows];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const int64_t ahead = std::max<int64_t>(kPrefetchBytes, kRows * kRowBytes);
  const uintptr_t start = reinterpret_cast<uintptr_t>(w) + ahead;
  uintptr_t line = start & ~uintptr_t{63};
  for (int64_t c = 0; c < kSteps; ++c) {
    if (P == kStream) {
      for (const uintptr_t end = start + (c + 1) * kRows * 20; line < end; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
    } else if (P == kPerRow || ((c * 20) & 63) < 20) {
      for (int r = 0; r < kRows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * kRowBytes + c * 20) + ahead, _MM_HINT_T0);
    }
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 32));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 32 + 16));
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* p = w + r * kRowBytes + c * 20;
      const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      int32_t plane;
      std::memcpy(&plane, p + 16, 4);
      const __m256i high = _mm256_srlv_epi32(_mm256_set1_epi32(plane), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256i w0 = _mm256_or_si256(_mm256_and_si256(words, _mm256_set1_epi16(0x0F)),
                                         _mm256_and_si256(_mm256_slli_epi16(high, 4), _mm256_set1_epi16(0x10)));
      const __m256i w1 = _mm256_srli_epi16(_mm256_or_si256(words, _mm256_and_si256(high, _mm256_set1_epi16(0x100))), 4);
      __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
      sum = _mm256_sub_epi32(sum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(correction + c * 8)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(scaled + r * kSteps + c), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = hsum(acc[r]);
}

// ---- split-bytes layout ----
int code_at(int b) { const int l = b / 4, m = b % 4; return m < 2 ? 2 * l + m : 14 + 2 * l + m; }

// plane bit of byte b: step A (shifted right by l / 2) or B (shifted left by 4 - l / 2) of the
// plane half (32 bits) its 32-bit lane l reads from the broadcast 64-bit plane (l odd: the high half)
int split_position(int b, bool second) {
  const int l = b / 4, m = b % 4;
  return 32 * (l & 1) + 8 * m + (second ? l / 2 : 4 + l / 2);
}

void pack_split(const uint8_t* u, uint8_t* out) {   // kSteps even
  for (int pair = 0; pair < kSteps / 2; ++pair) {
    const uint8_t* a = u + 64 * pair;
    const uint8_t* b = a + 32;
    uint8_t* o = out + 40 * pair;
    uint64_t plane = 0;
    for (int q = 0; q < 32; ++q) {
      o[q] = (a[code_at(q)] & 15) | ((b[code_at(q)] & 15) << 4);
      plane |= uint64_t(a[code_at(q)] >> 4 & 1) << split_position(q, false);
      plane |= uint64_t(b[code_at(q)] >> 4 & 1) << split_position(q, true);
    }
    std::memcpy(o + 32, &plane, 8);
  }
}

void split_activations(const int16_t* xq, int8_t* xh, uint8_t* xl) {
  for (int c = 0; c < kSteps; ++c)
    for (int b = 0; b < 32; ++b) {
      const int16_t x = xq[32 * c + code_at(b)];
      xh[32 * c + b] = int8_t(x >> 8);
      xl[32 * c + b] = uint8_t(x & 255);
    }
}

inline __m256i split_lanes(__m256i u, const int8_t* xh, const uint8_t* xl, const int32_t* correction) {
  const __m256i high = _mm256_maddubs_epi16(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xh)));
  const __m256i low = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xl)), u);
  const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(high, _mm256_set1_epi16(256)),
                                       _mm256_madd_epi16(low, _mm256_set1_epi16(1)));
  return _mm256_sub_epi32(sum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(correction)));
}

void pass_split(const int8_t* xh, const uint8_t* xl, const uint8_t* w, const float* scaled, const int32_t* correction,
                float* out) {
  __m256 acc[kRows];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const int64_t ahead = std::max<int64_t>(kPrefetchBytes, kRows * kRowBytes);
  const uintptr_t start = reinterpret_cast<uintptr_t>(w) + ahead;
  uintptr_t line = start & ~uintptr_t{63};
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  const __m256i shift_a = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), shift_b = _mm256_setr_epi32(4, 4, 3, 3, 2, 2, 1, 1);
  for (int64_t c = 0; c < kSteps; c += 2) {
    for (const uintptr_t end = start + (c + 2) * kRows * 20; line < end; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
    for (int second = 0; second < 2; ++second)
      for (int r = 0; r < kRows; ++r) {
        const uint8_t* p = w + r * kRowBytes + c * 20;
        const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i plane = _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32)));
        const __m256i u = second
            ? _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low4),
                              _mm256_and_si256(_mm256_sllv_epi32(plane, shift_b), bit4))
            : _mm256_or_si256(_mm256_and_si256(nibbles, low4), _mm256_and_si256(_mm256_srlv_epi32(plane, shift_a), bit4));
        const int64_t step = c + second;
        const __m256i sum = split_lanes(u, xh + 32 * step, xl + 32 * step, correction + 8 * step);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(scaled + r * kSteps + step), acc[r]);
      }
  }
  for (int r = 0; r < kRows; ++r) out[r] = hsum(acc[r]);
}

float read_all(const uint8_t* w, int64_t bytes) {
  __m256i acc = _mm256_setzero_si256();
  for (int64_t i = 0; i + 32 <= bytes; i += 32)
    acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
  return float(_mm256_extract_epi32(acc, 0));
}

double now() {
  timespec ts;
  clock_gettime(std::getenv("THREAD_CLOCK") ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

}  // namespace

int main(int argc, char** argv) {
  const int copies = argc > 1 ? std::atoi(argv[1]) : 1;
  if (argc > 2) n_rows = std::atoi(argv[2]) / kRows * kRows;
  std::mt19937 g(1);
  std::vector<int16_t> xq(kK);
  for (auto& v : xq) v = int16_t(int(g() % 65025) - 32512);   // the a16 range
  std::vector<int32_t> correction(kSteps * 8);   // 16 x each lane's inputs (codes stored + 16)
  for (int c = 0; c < kSteps; ++c)
    for (int l = 0; l < 8; ++l)
      correction[c * 8 + l] = 16 * (xq[32 * c + 2 * l] + xq[32 * c + 2 * l + 1] + xq[32 * c + 16 + 2 * l] +
                                    xq[32 * c + 17 + 2 * l]);
  std::vector<int8_t> xh(kK);
  std::vector<uint8_t> xl(kK);
  split_activations(xq.data(), xh.data(), xl.data());
  std::vector<float> scaled(n_rows * kSteps);
  for (auto& v : scaled) v = float(g() % 1000) * 1e-5f;
  std::vector<std::vector<uint8_t>> today(copies, std::vector<uint8_t>(n_rows * kRowBytes)), split(today);
  std::vector<uint8_t> u(kK);
  for (int copy = 0; copy < copies; ++copy)
    for (int64_t n = 0; n < n_rows; ++n) {
      for (auto& v : u) v = uint8_t(g() % 32);
      pack_today(u.data(), today[copy].data() + n * kRowBytes);
      pack_split(u.data(), split[copy].data() + n * kRowBytes);
    }
  const char* names[] = {"offsets", "stream", "per-row", "split", "read"};
  auto run = [&](int route, int copy, float* y) {
    const uint8_t* w = (route == 3 ? split : today)[copy].data();
    if (route == 4) {
      y[0] = read_all(w, n_rows * kRowBytes);
      return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n_rows; j += kRows) {
      const uint8_t* wj = w + j * kRowBytes;
      const float* sj = scaled.data() + j * kSteps;
      if (route == 0) pass_today<kOffsets>(xq.data(), wj, sj, correction.data(), y + j);
      if (route == 1) pass_today<kStream>(xq.data(), wj, sj, correction.data(), y + j);
      if (route == 2) pass_today<kPerRow>(xq.data(), wj, sj, correction.data(), y + j);
      if (route == 3) pass_split(xh.data(), xl.data(), wj, sj, correction.data(), y + j);
    }
  };
  std::vector<float> expected(n_rows), y(n_rows);
  run(0, 0, expected.data());
  run(3, 0, y.data());
  const bool same = std::memcmp(expected.data(), y.data(), n_rows * sizeof(float)) == 0;
  std::printf("%d threads, %d copies of %lld x %lld: split equals today's bit for bit: %s\n", omp_get_max_threads(),
              copies, static_cast<long long>(n_rows), static_cast<long long>(kK), same ? "yes" : "NO");
  std::vector<std::vector<double>> times(5);
  const int reps = std::max<int64_t>(40, 40 * 9728 / n_rows);
  for (int round = 0; round < 15; ++round)
    for (int route = 0; route < 5; ++route) {
      const double t0 = now();
      for (int i = 0; i < reps; ++i) run(route, i % copies, y.data());
      times[route].push_back((now() - t0) / reps);
    }
  double base = 0;
  for (int route = 0; route < 5; ++route) {
    std::sort(times[route].begin(), times[route].end());
    const double median = times[route][times[route].size() / 2];
    if (route == 0) base = median;
    std::printf("%-8s %8.1f us  %5.2f GB/s  %.2fx\n", names[route], median * 1e6, n_rows * kRowBytes / median / 1e9,
                base / median);
  }
  return same ? 0 : 1;
}
