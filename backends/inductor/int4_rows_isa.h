// Kiln's int4 kernel for several rows of x, the parts its two forms share: included by
// int4_kernel.cpp (the SIMD translation unit) inside namespace kiln_q4. The records of rounded
// rows of x (XRow), then per instruction set (kiln_q4::avx2: 256-bit vectors; kiln_q4::vnni,
// compiled for AVX-512 VNNI: 512-bit) the vector primitives, and in each the kernels over them:
// int4_many_rows.h (panels staged per call) and int4_panels.h (panels packed at lowering).
// Hashed with int4_kernel.cpp for the build.

static inline float to_f32(float s) { return s; }
static inline float to_f32(uint16_t s) { return _cvtsh_ss(s); }
static inline float to_f32(uint8_t z) { return z; }
static inline __m128 load_four(const float* p) { return _mm_loadu_ps(p); }
static inline __m128 load_four(const uint16_t* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline __m128 load_four(const uint8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(four)));
}
static inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One prepared row of x (kiln_q4_prepare_rows): a record of record_bytes(K).
struct XRow {
  const int8_t* even;  // [K / 2] x[2j] rounded to int8 in its block of 32
  const int8_t* odd;   // [K / 2] x[2j + 1]
  const float* scale;  // [K / 32] the block's scale: max|x| / 127
  const float* zero;   // [K / 32] 8 * (the block's rounded x summed) * scale: zero point 8's share
};

static inline int64_t record_bytes(int64_t K) { return (K + K / 4 + 63) / 64 * 64; }

static inline XRow x_row(const uint8_t* records, int64_t K, int64_t m) {
  const uint8_t* record = records + m * record_bytes(K);
  const float* scale = reinterpret_cast<const float*>(record + K);
  return {reinterpret_cast<const int8_t*>(record), reinterpret_cast<const int8_t*>(record + K / 2), scale,
          scale + K / 32};
}

constexpr int64_t kTileRows = 16;  // results of this many rows of each slab gather before going to y

// Bytes of a staged panel: per block of 32 weights, 4 code vectors, scales and zero points / 8.
static inline int64_t panel_bytes(int64_t K) { return K / 32 * 6 * 64; }

namespace avx2 {
using Codes = __m256i;
using Lanes = __m256;
constexpr int64_t kVectorBytes = 32;
constexpr int kGroups = 2;       // of four rows: a panel of 8 weight rows
constexpr int kLanes = 8;
constexpr int kMostRowsOfX = 4;  // accumulators (and 8 code vectors) in 16 ymm registers
static inline Codes load_codes(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline Codes load_half(const void* p) { return load_codes(p); }  // never: K / 2 is whole vectors
static inline void store_codes(Codes* p, Codes c) { _mm256_store_si256(p, c); }
static inline Codes low_nibbles(Codes c) { return _mm256_and_si256(c, _mm256_set1_epi8(0x0F)); }
static inline Codes high_nibbles(Codes c) { return _mm256_and_si256(_mm256_srli_epi16(c, 4), _mm256_set1_epi8(0x0F)); }
// Four rows' vectors to four chunk vectors: v[j] dword r of 128-bit lane k = row r's dword j there.
static inline void transpose_rows(Codes (&v)[4]) {
  const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  v[0] = _mm256_unpacklo_epi64(t0, t2);
  v[1] = _mm256_unpackhi_epi64(t0, t2);
  v[2] = _mm256_unpacklo_epi64(t1, t3);
  v[3] = _mm256_unpackhi_epi64(t1, t3);
}
// 128-bit lane k of v[g] to lane g of v[k].
static inline void transpose_lanes(Codes (&v)[kGroups]) {
  const __m256i low = _mm256_permute2x128_si256(v[0], v[1], 0x20), high = _mm256_permute2x128_si256(v[0], v[1], 0x31);
  v[0] = low;
  v[1] = high;
}
static inline Lanes join_groups(const __m128 (&g)[kGroups]) { return _mm256_set_m128(g[1], g[0]); }
// The block's dot for every row (int32 lanes) with x's 16 even / odd bytes there, a dword of x
// broadcast per code vector; the int16 sums stay below 8 * 2 * 15 * 127 = 30480.
static inline Codes block_dot(const Codes (&lo)[4], const Codes (&hi)[4], const int8_t* xe, const int8_t* xo) {
  __m256i pairs = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int j = 0; j < 4; j++) {
    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(four_bytes(xe + 4 * j))));
    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(hi[j], _mm256_set1_epi32(four_bytes(xo + 4 * j))));
  }
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
static inline void store_groups(float* out, int64_t g_stride, Lanes v) {
  _mm_storeu_ps(out, _mm256_castps256_ps128(v));
  _mm_storeu_ps(out + g_stride, _mm256_extractf128_ps(v, 1));
}
static inline Lanes broadcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline Lanes set_lanes(float v) { return _mm256_set1_ps(v); }
static inline Codes as_codes(Lanes v) { return _mm256_castps_si256(v); }
static inline Lanes as_lanes(Codes v) { return _mm256_castsi256_ps(v); }
// The first `count` (1..8; even for f16) of eight values as f32, zeros after (masked: never past them).
static inline __m256i first_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline Lanes load_values(const float* p, int64_t count) {
  return count >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes(count));
}
static inline Lanes load_values(const uint16_t* p, int64_t count) {
  const __m128i halves = count >= 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                    : _mm_maskload_epi32(reinterpret_cast<const int*>(p),
                                                         _mm256_castsi256_si128(first_lanes(count / 2)));
  return _mm256_cvtph_ps(halves);
}
static inline Lanes load_values(const uint8_t* p, int64_t count) {
  alignas(8) uint8_t v[8] = {};
  std::memcpy(v, p, std::min<int64_t>(count, 8));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
}
static inline Lanes load_lanes(const float* p) { return _mm256_load_ps(p); }
static inline void store_lanes(float* p, Lanes v) { _mm256_store_ps(p, v); }
static inline Lanes zero_lanes() { return _mm256_setzero_ps(); }
static inline Lanes to_float(Codes c) { return _mm256_cvtepi32_ps(c); }
static inline Lanes fmadd(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
static inline Lanes fmsub(Lanes a, Lanes b, Lanes c) { return _mm256_fmsub_ps(a, b, c); }
static inline Lanes mul(Lanes a, Lanes b) { return _mm256_mul_ps(a, b); }
static inline Lanes add(Lanes a, Lanes b) { return _mm256_add_ps(a, b); }
static inline Lanes load_unaligned(const float* p) { return _mm256_loadu_ps(p); }
static inline void store_unaligned(float* p, Lanes v) { _mm256_storeu_ps(p, v); }
#include "int4_many_rows.h"
#include "int4_panels.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")
namespace vnni {
using Codes = __m512i;
using Lanes = __m512;
constexpr int64_t kVectorBytes = 64;
constexpr int kGroups = 4;       // a panel of 16 weight rows
constexpr int kLanes = 16;
constexpr int kMostRowsOfX = 8;  // accumulators, 8 code vectors and temporaries in 32 zmm registers
static inline Codes load_codes(const void* p) { return _mm512_loadu_si512(p); }
static inline Codes load_half(const void* p) {
  return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline void store_codes(Codes* p, Codes c) { _mm512_store_si512(p, c); }
static inline Codes low_nibbles(Codes c) { return _mm512_and_si512(c, _mm512_set1_epi8(0x0F)); }
static inline Codes high_nibbles(Codes c) { return _mm512_and_si512(_mm512_srli_epi16(c, 4), _mm512_set1_epi8(0x0F)); }
static inline void transpose_rows(Codes (&v)[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  v[0] = _mm512_unpacklo_epi64(t0, t2);
  v[1] = _mm512_unpackhi_epi64(t0, t2);
  v[2] = _mm512_unpacklo_epi64(t1, t3);
  v[3] = _mm512_unpackhi_epi64(t1, t3);
}
static inline void transpose_lanes(Codes (&v)[kGroups]) {
  const __m512i t0 = _mm512_shuffle_i32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_i32x4(v[0], v[1], 0xEE);
  const __m512i t2 = _mm512_shuffle_i32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_i32x4(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
  v[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
  v[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
  v[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
}
static inline Lanes join_groups(const __m128 (&g)[kGroups]) {
  const __m256 low = _mm256_set_m128(g[1], g[0]), high = _mm256_set_m128(g[3], g[2]);
  return _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
}
// Two chains of four dpbusd (low and high nibbles), x's dwords broadcast from memory.
static inline Codes block_dot(const Codes (&lo)[4], const Codes (&hi)[4], const int8_t* xe, const int8_t* xo) {
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int j = 0; j < 4; j++) {
    a = _mm512_dpbusd_epi32(a, lo[j], _mm512_set1_epi32(four_bytes(xe + 4 * j)));
    b = _mm512_dpbusd_epi32(b, hi[j], _mm512_set1_epi32(four_bytes(xo + 4 * j)));
  }
  return _mm512_add_epi32(a, b);
}
static inline void store_groups(float* out, int64_t g_stride, Lanes v) {
  _mm_storeu_ps(out, _mm512_castps512_ps128(v));
  _mm_storeu_ps(out + g_stride, _mm512_extractf32x4_ps(v, 1));
  _mm_storeu_ps(out + 2 * g_stride, _mm512_extractf32x4_ps(v, 2));
  _mm_storeu_ps(out + 3 * g_stride, _mm512_extractf32x4_ps(v, 3));
}
static inline Lanes broadcast(const float* p) { return _mm512_set1_ps(*p); }
static inline Lanes set_lanes(float v) { return _mm512_set1_ps(v); }
static inline Codes as_codes(Lanes v) { return _mm512_castps_si512(v); }
static inline Lanes as_lanes(Codes v) { return _mm512_castsi512_ps(v); }
// The first `count` (1..16) of sixteen values as f32, zeros after (masked: never past them).
static inline __mmask16 first_lanes(int64_t count) { return (__mmask16)((1u << std::min<int64_t>(count, 16)) - 1); }
static inline Lanes load_values(const float* p, int64_t count) { return _mm512_maskz_loadu_ps(first_lanes(count), p); }
static inline Lanes load_values(const uint16_t* p, int64_t count) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(count), p));
}
static inline Lanes load_values(const uint8_t* p, int64_t count) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(first_lanes(count), p)));
}
static inline Lanes load_lanes(const float* p) { return _mm512_load_ps(p); }
static inline void store_lanes(float* p, Lanes v) { _mm512_store_ps(p, v); }
static inline Lanes zero_lanes() { return _mm512_setzero_ps(); }
static inline Lanes to_float(Codes c) { return _mm512_cvtepi32_ps(c); }
static inline Lanes fmadd(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
static inline Lanes fmsub(Lanes a, Lanes b, Lanes c) { return _mm512_fmsub_ps(a, b, c); }
static inline Lanes mul(Lanes a, Lanes b) { return _mm512_mul_ps(a, b); }
static inline Lanes add(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }
static inline Lanes load_unaligned(const float* p) { return _mm512_loadu_ps(p); }
static inline void store_unaligned(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
#include "int4_many_rows.h"
#include "int4_panels.h"
}  // namespace vnni
#pragma GCC pop_options
