// Kiln CPU kernel for 4-bit weight-only linears (decode, verification, batched decode, prefill
// chunks: M = 1..kSmallM = 128 rows of x, 2x the dequantize + GEMM it replaced at 96-128 rows).
// Symmetric weights take the rows of x two at a time (int4_rows_of_x.h), with AVX-512 VNNI dot
// products where the CPU has them, in 512-bit steps for group size 32.
//
// Weight layout = the IR's linear_q (ir/ops/quantized.py), read as is, no repacking:
//   qweight u8 [N, K/2]: row n holds w[n, 2j] in the low nibble of byte j and w[n, 2j+1] in the
//                        high nibble, values 0..15;
//   scales  f32 [N, G] (symmetric weights may also pass them as f16, `decode_scales`, which the
//           decode kernel then reads instead, as llama.cpp's Q4_0 stores them: 4.5 bits read per
//           weight instead of 5; prefill's dequantize keeps the f32 scales, the IR's exact values),
//   zeros u8 [N, G] (or none: symmetric, z = 8), G = ceil(K / group_size);
//   w[n, k] = (q[n, k] - z[n, k / gs]) * scales[n, k / gs].
//
// Integer dot products: each row of x is rounded to int8 per block of 32 values (scale = max|x| /
// 127, as llama.cpp's Q8_0 and ONNX Runtime's MatMulNBits accuracy_level 4 do) and split into its
// even and odd elements, matching the low and high nibbles. 32 bytes of a weight row (64 weights)
// then take two `maddubs` (u8 weight x s8 x -> pairs summed in int16; at most 2 * 15 * 127, no
// saturation) and one `madd` to int32 (lanes 0-3: the first 32 weights, 4-7: the next 32).
// Symmetric weights (zero point 8, the common case) fold the zero point into that step: each lane
// becomes dot * x_block_scale - 8 * (the block's rounded x summed) * x_block_scale / 4, one FMSUB
// with a per-block term computed once with x, then one FMA by the group scale, whose two lanes'
// values come from one 8-byte broadcast and a permute. With software prefetch of each row this
// runs ~1.4x the earlier per-group epilogue (whole-model decode shapes, 2 threads). Asymmetric
// weights add their zero points per group after the row's dot. Four weight rows, one from each of
// four slabs of a thread's rows, share each x load; threads split N (at::parallel_for). Needs
// AVX2 + FMA + F16C; K % 64 == 0 and group_size 32 or a multiple of 64, so that no step straddles
// two groups (the lowering dequantizes + GEMMs otherwise, as the op does for M > kSmallM = 128).
//
// Two translation units, as gemv_kernel.cpp (see int4_kernel.py): -DKILN_INT4_KERNELS compiles
// the SIMD code without torch headers; the default compiles the op against libtorch.
#include <cstdint>

extern "C" {
// x rounded for the kernel: xe/xo int8 [K/2] (even/odd elements), block_scale f32 [K/32] and
// block_quarter f32 [K/32] = (the block's rounded x summed) * block_scale / 4 (a lane's share).
void kiln_q4_prepare_x(const float* x, int64_t K, int8_t* xe, int8_t* xo, float* block_scale, float* block_quarter);
// y[n] for n in [n0, n1) of one prepared row of x: sum over groups of the dequantized dot.
// The _f16 form: symmetric weights whose scales are IEEE half (10% fewer bytes per token).
void kiln_q4_rows_f16(const int8_t* xe, const int8_t* xo, const float* block_scale, const float* block_quarter,
                      const uint8_t* q, const uint16_t* scales, int64_t K, int64_t group_size, int64_t n0,
                      int64_t n1, const float* bias, float* y);
void kiln_q4_rows(const int8_t* xe, const int8_t* xo, const float* block_scale, const float* block_quarter,
                  const uint8_t* q, const float* scales, const uint8_t* zeros, int64_t K, int64_t group_size,
                  int64_t n0, int64_t n1, const float* bias, float* y);
// y[m][n] for two prepared rows of x at once (m = 0, 1; row 1's xe/xo K/2 bytes and its block terms
// K/32 floats after row 0's), symmetric weights: each weight byte read once for both rows. Uses
// AVX-512 VNNI dot products where the CPU has them (kiln_q4_use_vnni), else AVX2.
void kiln_q4_rows_x2(const int8_t* xe, const int8_t* xo, const float* block_scale, const float* block_quarter,
                     const uint8_t* q, const float* scales, const uint16_t* half_scales, int64_t K, int64_t group_size,
                     int64_t n0, int64_t n1, const float* bias, float* y, int64_t ldy);
// Whether kiln_q4_rows_x2 uses VNNI (where the CPU has it; the default); returns the choice in force.
bool kiln_q4_use_vnni(bool wanted);
// Rows [n0, n1) of the f32 weight w [N, K] (prefill's GEMM operand), one pass over the codes.
void kiln_q4_dequantize(const uint8_t* q, const float* scales, const uint8_t* zeros, int64_t K, int64_t group_size,
                        int64_t n0, int64_t n1, float* w);
}

#ifdef KILN_INT4_KERNELS
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>

namespace kiln_q4 {

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The per-lane factor of one 64-weight step (lanes 0-3 cover weights [0, 32), lanes 4-7 [32, 64)):
// p[0] in lanes 0-3, p[1] in lanes 4-7: one 8-byte broadcast and a permute.
static inline __m256 pair_at(const float* p) {
  const __m256i idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  return _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p))), idx);
}

// Group scales as f32 lanes: p[0] in lanes 0-3 and p[1] in 4-7 (pair), or p[0] in all (one).
static inline __m256 scale_pair(const float* p) { return pair_at(p); }
static inline __m256 scale_one(const float* p) { return _mm256_set1_ps(*p); }
static inline __m256 scale_pair(const uint16_t* p) {
  const __m256i idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  int32_t two;
  std::memcpy(&two, p, sizeof two);
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two))), idx);
}
static inline __m256 scale_one(const uint16_t* p) { return _mm256_set1_ps(_cvtsh_ss(*p)); }

// Each weight row asks for the bytes this far ahead of the step it reads (measured: 1.1-1.3x).
constexpr int kPrefetchBytes = 1024;

// int32 lanes: lanes 0-3 the dot of weights [0, 32) of a 64-weight step with x, 4-7 of [32, 64).
static inline __m256i dot64(__m256i w, __m256i e, __m256i o) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, o));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// y[n0 + r * stride] for R symmetric rows (zero point 8). Groups of 32 pair up within a step; larger
// groups (multiples of 64) cover whole steps, so both lanes take one scale.
template <int R, class Scale>
static void symmetric_rows(const int8_t* xe, const int8_t* xo, const float* block_scale, const float* block_quarter,
                           const uint8_t* q, const Scale* scales, int64_t K, int64_t gs, int64_t n0, int64_t stride,
                           const float* bias, float* y) {
  const int64_t G = (K + gs - 1) / gs, row_bytes = K / 2;
  const __m256 eight = _mm256_set1_ps(8.f);
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t byte = 0; byte < row_bytes; byte += 32) {
    const int64_t block = byte / 16;  // x block of 32 values at lanes 0-3
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xe + byte));
    const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xo + byte));
    const __m256 xs = pair_at(block_scale + block), zero_term = _mm256_mul_ps(eight, pair_at(block_quarter + block));
    for (int r = 0; r < R; r++) {
      const uint8_t* w = q + (n0 + r * stride) * row_bytes + byte;
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i dot = dot64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), e, o);
      const __m256 centered = _mm256_fmsub_ps(_mm256_cvtepi32_ps(dot), xs, zero_term);
      const Scale* s = scales + (n0 + r * stride) * G;
      const __m256 ws = gs == 32 ? scale_pair(s + block) : scale_one(s + byte * 2 / gs);
      acc[r] = _mm256_fmadd_ps(centered, ws, acc[r]);
    }
  }
  for (int r = 0; r < R; r++) y[n0 + r * stride] = hsum(acc[r]) + (bias ? bias[n0 + r * stride] : 0.f);
}

// Rows [n0, n1), four at a time, one from each of four equal slabs: four(n, slab) takes rows n,
// n + slab, n + 2 slab, n + 3 slab. Each slab's weights and scales stream front to back, eight long
// streams the prefetchers keep ahead of (measured 1.4x four neighbouring rows, whose reads make one
// stream). Leftover rows follow one at a time: one(n).
template <class Four, class One>
static void in_slabs(int64_t n0, int64_t n1, Four four, One one) {
  const int64_t slab = (n1 - n0) / 4;
  for (int64_t j = 0; j < slab; j++) four(n0 + j, slab);
  for (int64_t n = n0 + 4 * slab; n < n1; n++) one(n);
}

template <class Scale>
static void symmetric_slabs(const int8_t* xe, const int8_t* xo, const float* block_scale, const float* block_quarter,
                            const uint8_t* q, const Scale* scales, int64_t K, int64_t gs, int64_t n0, int64_t n1,
                            const float* bias, float* y) {
  in_slabs(
      n0, n1,
      [&](int64_t n, int64_t slab) {
        symmetric_rows<4>(xe, xo, block_scale, block_quarter, q, scales, K, gs, n, slab, bias, y);
      },
      [&](int64_t n) { symmetric_rows<1>(xe, xo, block_scale, block_quarter, q, scales, K, gs, n, 0, bias, y); });
}

// acc[r] += the 64 weights at `byte` of row n0 + r * stride times x, scaled per lane by x's block
// scales times the rows' group scales (ws[r]).
template <int R>
static inline void step(const int8_t* xe, const int8_t* xo, __m256 xs, const uint8_t* q, int64_t row_bytes,
                        int64_t n0, int64_t stride, int64_t byte, const __m256* ws, __m256* acc) {
  const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xe + byte));
  const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xo + byte));
  for (int r = 0; r < R; r++) {
    const uint8_t* w = q + (n0 + r * stride) * row_bytes + byte;
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    const __m256 dot = _mm256_cvtepi32_ps(dot64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), e, o));
    acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(xs, ws[r]), acc[r]);
  }
}

// y[n0 + r * stride] for R rows with zero points. Groups of 32 pair up within a 64-weight step; larger
// groups (multiples of 64) span whole steps. group_sum: the rounded x summed per group.
template <int R>
static void rows_times_x(const int8_t* xe, const int8_t* xo, const float* block_scale, const float* group_sum,
                         const uint8_t* q, const float* scales, const uint8_t* zeros, int64_t K, int64_t gs,
                         int64_t n0, int64_t stride, const float* bias, float* y) {
  const int64_t G = (K + gs - 1) / gs, row_bytes = K / 2;
  __m256 acc[R], ws[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  if (gs == 32) {
    for (int64_t byte = 0, g = 0; byte < row_bytes; byte += 32, g += 2) {
      for (int r = 0; r < R; r++) ws[r] = pair_at(scales + (n0 + r * stride) * G + g);
      step<R>(xe, xo, pair_at(block_scale + g), q, row_bytes, n0, stride, byte, ws, acc);
    }
  } else {
    for (int64_t g = 0; g < G; g++) {
      for (int r = 0; r < R; r++) ws[r] = _mm256_set1_ps(scales[(n0 + r * stride) * G + g]);
      const int64_t end = std::min(row_bytes, (g + 1) * gs / 2);
      for (int64_t byte = g * gs / 2; byte < end; byte += 32)
        step<R>(xe, xo, pair_at(block_scale + byte / 16), q, row_bytes, n0, stride, byte, ws, acc);
    }
  }
  for (int r = 0; r < R; r++) {
    const int64_t n = n0 + r * stride;
    float zero_term = 0.f;  // sum_g s[n, g] * z[n, g] * (sum of the rounded x over group g)
    for (int64_t g = 0; g < G; g++) zero_term += scales[n * G + g] * (float)zeros[n * G + g] * group_sum[g];
    y[n] = hsum(acc[r]) - zero_term + (bias ? bias[n] : 0.f);
  }
}

namespace avx2 {
static inline __m256i dot_codes(__m256i lo, __m256i hi, __m256i e, __m256i o) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, o));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#define KILN_Q4_DOT dot_codes
#include "int4_rows_of_x.h"
#undef KILN_Q4_DOT
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
namespace vnni {
static inline __m256i dot_codes(__m256i lo, __m256i hi, __m256i e, __m256i o) {
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, e), hi, o);
}
#define KILN_Q4_DOT dot_codes
#include "int4_rows_of_x.h"
#undef KILN_Q4_DOT

// 512-bit steps (128 weights: lanes 4b..4b+3 hold x block b of four) for group size 32, then a
// 256-bit step for a last 64 weights (K = 576 is 4.5 such steps). Four consecutive per-block
// values (x's scales, its zero-point terms, the rows' group scales) each fill four lanes.
static inline __m512 quads(__m128 four) {
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(four));
}
static inline __m512 quad_at(const float* p) { return quads(_mm_loadu_ps(p)); }
static inline __m512 quad_at(const uint16_t* p) {
  return quads(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

template <int R, class Scale>
static void symmetric_rows_x2_g32(const int8_t* xe, const int8_t* xo, const float* block_scale,
                                  const float* block_quarter, int64_t blocks, const uint8_t* q, const Scale* scales,
                                  int64_t K, int64_t n0, int64_t stride, const float* bias, float* y, int64_t ldy) {
  const int64_t G = K / 32, row_bytes = K / 2, wide_end = row_bytes / 64 * 64;
  const __m512 eight = _mm512_set1_ps(8.f);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t byte = 0; byte < wide_end; byte += 64) {
    const int64_t block = byte / 16;
    const __m512i e0 = _mm512_loadu_si512(xe + byte), o0 = _mm512_loadu_si512(xo + byte);
    const __m512i e1 = _mm512_loadu_si512(xe + row_bytes + byte), o1 = _mm512_loadu_si512(xo + row_bytes + byte);
    const __m512 xs0 = quad_at(block_scale + block), xs1 = quad_at(block_scale + blocks + block);
    const __m512 zt0 = _mm512_mul_ps(eight, quad_at(block_quarter + block));
    const __m512 zt1 = _mm512_mul_ps(eight, quad_at(block_quarter + blocks + block));
    for (int r = 0; r < R; r++) {
      const uint8_t* w = q + (n0 + r * stride) * row_bytes + byte;
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i codes = _mm512_loadu_si512(w);
      const __m512i lo = _mm512_and_si512(codes, low4), hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low4);
      const __m512 ws = quad_at(scales + (n0 + r * stride) * G + block);
      const __m512i d0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, e0), hi, o0);
      const __m512i d1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, e1), hi, o1);
      acc[r][0] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(d0), xs0, zt0), ws, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(d1), xs1, zt1), ws, acc[r][1]);
    }
  }
  float tail[R][2] = {};
  if (wide_end < row_bytes) {  // the last 32 bytes: one 256-bit step, as symmetric_rows_x2's
    const int64_t byte = wide_end, block = byte / 16;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i e0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xe + byte));
    const __m256i o0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xo + byte));
    const __m256i e1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xe + row_bytes + byte));
    const __m256i o1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xo + row_bytes + byte));
    const __m256 xs0 = pair_at(block_scale + block), xs1 = pair_at(block_scale + blocks + block);
    const __m256 zt0 = _mm256_mul_ps(_mm256_set1_ps(8.f), pair_at(block_quarter + block));
    const __m256 zt1 = _mm256_mul_ps(_mm256_set1_ps(8.f), pair_at(block_quarter + blocks + block));
    for (int r = 0; r < R; r++) {
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (n0 + r * stride) * row_bytes + byte));
      const __m256i lo = _mm256_and_si256(codes, low), hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low);
      const __m256 ws = scale_pair(scales + (n0 + r * stride) * G + block);
      tail[r][0] = hsum(_mm256_mul_ps(_mm256_fmsub_ps(_mm256_cvtepi32_ps(dot_codes(lo, hi, e0, o0)), xs0, zt0), ws));
      tail[r][1] = hsum(_mm256_mul_ps(_mm256_fmsub_ps(_mm256_cvtepi32_ps(dot_codes(lo, hi, e1, o1)), xs1, zt1), ws));
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < 2; m++)
      y[m * ldy + n0 + r * stride] = hsum512(acc[r][m]) + tail[r][m] + (bias ? bias[n0 + r * stride] : 0.f);
}

template <class Scale>
static void symmetric_slabs_x2_g32(const int8_t* xe, const int8_t* xo, const float* block_scale,
                                   const float* block_quarter, int64_t blocks, const uint8_t* q, const Scale* scales,
                                   int64_t K, int64_t n0, int64_t n1, const float* bias, float* y, int64_t ldy) {
  const int64_t slab = (n1 - n0) / 4;
  for (int64_t j = 0; j < slab; j++)
    symmetric_rows_x2_g32<4>(xe, xo, block_scale, block_quarter, blocks, q, scales, K, n0 + j, slab, bias, y, ldy);
  for (int64_t n = n0 + 4 * slab; n < n1; n++)
    symmetric_rows_x2_g32<1>(xe, xo, block_scale, block_quarter, blocks, q, scales, K, n, 0, bias, y, ldy);
}
}  // namespace vnni
#pragma GCC pop_options

static bool use_vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");

}  // namespace kiln_q4

extern "C" {
bool kiln_q4_use_vnni(bool wanted) {
  kiln_q4::use_vnni = wanted && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  return kiln_q4::use_vnni;
}

void kiln_q4_rows_x2(const int8_t* xe, const int8_t* xo, const float* block_scale, const float* block_quarter,
                     const uint8_t* q, const float* scales, const uint16_t* half_scales, int64_t K, int64_t group_size,
                     int64_t n0, int64_t n1, const float* bias, float* y, int64_t ldy) {
  const int64_t blocks = K / 32;
  if (kiln_q4::use_vnni && group_size == 32) {  // 512-bit steps
    if (half_scales)
      return kiln_q4::vnni::symmetric_slabs_x2_g32(xe, xo, block_scale, block_quarter, blocks, q, half_scales, K, n0,
                                                   n1, bias, y, ldy);
    return kiln_q4::vnni::symmetric_slabs_x2_g32(xe, xo, block_scale, block_quarter, blocks, q, scales, K, n0, n1,
                                                 bias, y, ldy);
  }
  if (kiln_q4::use_vnni) {
    if (half_scales)
      return kiln_q4::vnni::symmetric_slabs_x2(xe, xo, block_scale, block_quarter, blocks, q, half_scales, K,
                                               group_size, n0, n1, bias, y, ldy);
    return kiln_q4::vnni::symmetric_slabs_x2(xe, xo, block_scale, block_quarter, blocks, q, scales, K, group_size,
                                             n0, n1, bias, y, ldy);
  }
  if (half_scales)
    return kiln_q4::avx2::symmetric_slabs_x2(xe, xo, block_scale, block_quarter, blocks, q, half_scales, K,
                                             group_size, n0, n1, bias, y, ldy);
  kiln_q4::avx2::symmetric_slabs_x2(xe, xo, block_scale, block_quarter, blocks, q, scales, K, group_size, n0, n1,
                                    bias, y, ldy);
}

void kiln_q4_prepare_x(const float* x, int64_t K, int8_t* xe, int8_t* xo, float* block_scale, float* block_quarter) {
  for (int64_t b = 0; b < K / 32; b++) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    block_scale[b] = scale;
    int sum = 0;
    for (int i = 0; i < 32; i += 2) {
      const int8_t even = (int8_t)std::nearbyint(x[b * 32 + i] * inverse);
      const int8_t odd = (int8_t)std::nearbyint(x[b * 32 + i + 1] * inverse);
      xe[(b * 32 + i) / 2] = even;
      xo[(b * 32 + i) / 2] = odd;
      sum += even + odd;
    }
    block_quarter[b] = sum * scale / 4.f;
  }
}

// 32 weights (16 bytes of codes) at a time: nibbles split and interleaved back into column order,
// widened to f32 and mapped to (q - z) * scale = q * scale - z * scale by one FMA.
void kiln_q4_dequantize(const uint8_t* q, const float* scales, const uint8_t* zeros, int64_t K, int64_t group_size,
                        int64_t n0, int64_t n1, float* w) {
  const int64_t G = (K + group_size - 1) / group_size;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = q + n * K / 2;
    float* out = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t g = n * G + k / group_size;
      const __m256 scale = _mm256_set1_ps(scales[g]);
      const __m256 offset = _mm256_set1_ps(-(zeros ? zeros[g] : 8) * scales[g]);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
      const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      const __m128i ordered[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
      for (int half = 0; half < 2; half++)
        for (int eight = 0; eight < 2; eight++) {
          const __m128i codes = eight ? _mm_srli_si128(ordered[half], 8) : ordered[half];
          const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
          _mm256_storeu_ps(out + k + 16 * half + 8 * eight, _mm256_fmadd_ps(values, scale, offset));
        }
    }
  }
}

void kiln_q4_rows_f16(const int8_t* xe, const int8_t* xo, const float* block_scale, const float* block_quarter,
                      const uint8_t* q, const uint16_t* scales, int64_t K, int64_t group_size, int64_t n0,
                      int64_t n1, const float* bias, float* y) {
  kiln_q4::symmetric_slabs(xe, xo, block_scale, block_quarter, q, scales, K, group_size, n0, n1, bias, y);
}

void kiln_q4_rows(const int8_t* xe, const int8_t* xo, const float* block_scale, const float* block_quarter,
                  const uint8_t* q, const float* scales, const uint8_t* zeros, int64_t K, int64_t group_size,
                  int64_t n0, int64_t n1, const float* bias, float* y) {
  if (!zeros)
    return kiln_q4::symmetric_slabs(xe, xo, block_scale, block_quarter, q, scales, K, group_size, n0, n1, bias, y);
  const int64_t G = (K + group_size - 1) / group_size;
  float group_sum[G];  // the rounded x summed per group, in x's units
  for (int64_t g = 0; g < G; g++) {
    group_sum[g] = 0.f;
    for (int64_t b = g * group_size / 32; b < std::min(K, (g + 1) * group_size) / 32; b++)
      group_sum[g] += 4.f * block_quarter[b];
  }
  kiln_q4::in_slabs(
      n0, n1,
      [&](int64_t n, int64_t slab) {
        kiln_q4::rows_times_x<4>(xe, xo, block_scale, group_sum, q, scales, zeros, K, group_size, n, slab, bias, y);
      },
      [&](int64_t n) {
        kiln_q4::rows_times_x<1>(xe, xo, block_scale, group_sum, q, scales, zeros, K, group_size, n, 0, bias, y);
      });
}
}

#else  // ---------------------------------------------------------------- torch binding TU

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <algorithm>
#include <vector>

namespace kiln_q4 {

constexpr int64_t kSmallM = 128;      // rows of x above this: dequantize once and run one GEMM (prefill)
constexpr int64_t kRowsPerTask = 64;  // rows of W per parallel task (64 x K/2 bytes)

// The f32 weight [N, K] (prefill): one GEMM beats re-reading the packed rows per row of x.
static at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros, int64_t K,
                             int64_t group_size) {
  const int64_t N = q.size(0);
  at::Tensor w = at::empty({N, K}, scales.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const uint8_t* zp = zeros.defined() ? zeros.data_ptr<uint8_t>() : nullptr;
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    kiln_q4_dequantize(qp, sp, zp, K, group_size, n0, n1, wp);
  });
  return w;
}

at::Tensor linear_q4(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales_in,
                     const std::optional<at::Tensor>& zeros_in, const std::optional<at::Tensor>& bias_in,
                     int64_t group_size, const std::optional<at::Tensor>& decode_scales_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "kiln::linear_q4: x must be CPU float32");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous(),
              "kiln::linear_q4: qweight must be a contiguous uint8 [N, K/2]");
  const int64_t N = q.size(0), K = q.size(1) * 2, G = (K + group_size - 1) / group_size;
  TORCH_CHECK(K % 64 == 0 && (group_size == 32 || group_size % 64 == 0),
              "kiln::linear_q4: K must be a multiple of 64 and group_size 32 or a multiple of 64, got K=", K,
              " group_size=", group_size);
  TORCH_CHECK(x_in.size(-1) == K, "kiln::linear_q4: x has K=", x_in.size(-1), ", the weight K=", K);
  at::Tensor scales = scales_in.contiguous();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N * G, "kiln::linear_q4: scales must be f32 [N, G]");
  // decode_scales: the same scales as f16, read by the decode kernel instead (symmetric weights)
  at::Tensor half = decode_scales_in ? decode_scales_in->contiguous() : at::Tensor();
  TORCH_CHECK(!half.defined() || (half.scalar_type() == at::kHalf && half.numel() == N * G && !zeros_in),
              "kiln::linear_q4: decode_scales must be f16 [N, G], for symmetric weights (no zeros)");
  at::Tensor zeros = zeros_in ? zeros_in->contiguous() : at::Tensor();
  TORCH_CHECK(!zeros.defined() || (zeros.scalar_type() == at::kByte && zeros.numel() == N * G),
              "kiln::linear_q4: zeros must be uint8 [N, G]");
  at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == N),
              "kiln::linear_q4: bias must be f32 [N]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.numel() / K;
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  if (M > kSmallM) {
    at::Tensor w = dequantize(q, scales, zeros, K, group_size);
    at::Tensor x2 = x.view({M, K});
    return (bias.defined() ? at::addmm(bias, x2, w.t()) : at::mm(x2, w.t())).view(shape);
  }
  // x rounded to int8 per block of 32 (even/odd split), once per row per call, into a scratch
  // buffer kept per thread: a decode step makes ~120 of these calls, and tensor allocations were
  // a good part of each small call's cost.
  const int64_t blocks = K / 32;
  thread_local std::vector<float> scratch;
  scratch.resize(M * (K / 4 + 2 * blocks));  // xe, xo: K/2 int8 each = K/4 floats in all
  int8_t* xe = reinterpret_cast<int8_t*>(scratch.data());
  int8_t* xo = xe + M * K / 2;
  float* block_scale = scratch.data() + M * K / 4;
  float* block_quarter = block_scale + M * blocks;
  const float* xp = x.data_ptr<float>();
  auto prepare = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      kiln_q4_prepare_x(xp + m * K, K, xe + m * K / 2, xo + m * K / 2, block_scale + m * blocks,
                        block_quarter + m * blocks);
  };
  if (M >= 4) at::parallel_for(0, M, 2, prepare);  // scalar rounding: split over threads when rows are many
  else prepare(0, M);
  at::Tensor y = at::empty(shape, x.options());
  const uint8_t* zp = zeros.defined() ? zeros.data_ptr<uint8_t>() : nullptr;
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const uint16_t* hp = half.defined() ? reinterpret_cast<const uint16_t*>(half.data_ptr<at::Half>()) : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t t0, int64_t t1) {
    int64_t m = 0;
    if (!zp)  // symmetric: rows of x two at a time, each weight byte read once for both
      for (; m + 2 <= M && M > 1; m += 2)
        kiln_q4_rows_x2(xe + m * K / 2, xo + m * K / 2, block_scale + m * blocks, block_quarter + m * blocks, qp, sp,
                        hp, K, group_size, t0 * kRowsPerTask, std::min(N, t1 * kRowsPerTask), bp, yp + m * N, N);
    for (; m < M; m++) {
      const int64_t n0 = t0 * kRowsPerTask, n1 = std::min(N, t1 * kRowsPerTask);
      if (hp)
        kiln_q4_rows_f16(xe + m * K / 2, xo + m * K / 2, block_scale + m * blocks, block_quarter + m * blocks, qp, hp,
                         K, group_size, n0, n1, bp, yp + m * N);
      else
        kiln_q4_rows(xe + m * K / 2, xo + m * K / 2, block_scale + m * blocks, block_quarter + m * blocks, qp, sp, zp,
                     K, group_size, n0, n1, bp, yp + m * N);
    }
  });
  return y;
}

}  // namespace kiln_q4

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("q4_use_vnni(bool wanted) -> bool", [](bool wanted) { return kiln_q4_use_vnni(wanted); });
  m.def("linear_q4(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size, "
        "Tensor? decode_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_q4", &kiln_q4::linear_q4); }

#endif  // KILN_INT4_KERNELS
