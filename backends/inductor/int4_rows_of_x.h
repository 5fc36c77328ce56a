// Kiln's int4 kernel for two rows of x at a time (symmetric weights): included by int4_kernel.cpp
// twice, inside namespace kiln_q4::avx2 and, compiled for AVX-512 VNNI, kiln_q4::vnni, each with
// its own KILN_Q4_DOT (the int32 dot of 64 codes with x's even and odd bytes). Needs pair_at,
// scale_pair, scale_one, hsum and kPrefetchBytes from int4_kernel.cpp. Hashed with it for the build.
//
// Each 32-byte step of a weight row is loaded and split into nibbles once, then used for both
// rows of x (their bytes are in L1): the loads, the unpacking and the group scale are shared,
// which a loop over rows of x redid per row. Four weight rows (one from each of four slabs, as
// symmetric_slabs) by two rows of x: eight accumulators.

// y[m * ldy + n0 + r * stride] for R weight rows and rows m = 0, 1 of x (xe/xo K/2 apart, the
// block terms `blocks` apart).
template <int R, class Scale>
static void symmetric_rows_x2(const int8_t* xe, const int8_t* xo, const float* block_scale,
                              const float* block_quarter, int64_t blocks, const uint8_t* q, const Scale* scales,
                              int64_t K, int64_t gs, int64_t n0, int64_t stride, const float* bias, float* y,
                              int64_t ldy) {
  const int64_t G = (K + gs - 1) / gs, row_bytes = K / 2;
  const __m256 eight = _mm256_set1_ps(8.f);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t byte = 0; byte < row_bytes; byte += 32) {
    const int64_t block = byte / 16;
    const __m256i e0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xe + byte));
    const __m256i o0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xo + byte));
    const __m256i e1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xe + row_bytes + byte));
    const __m256i o1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xo + row_bytes + byte));
    const __m256 xs0 = pair_at(block_scale + block), xs1 = pair_at(block_scale + blocks + block);
    const __m256 zt0 = _mm256_mul_ps(eight, pair_at(block_quarter + block));
    const __m256 zt1 = _mm256_mul_ps(eight, pair_at(block_quarter + blocks + block));
    for (int r = 0; r < R; r++) {
      const uint8_t* w = q + (n0 + r * stride) * row_bytes + byte;
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i lo = _mm256_and_si256(codes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low4);
      const Scale* s = scales + (n0 + r * stride) * G;
      const __m256 ws = gs == 32 ? scale_pair(s + block) : scale_one(s + byte * 2 / gs);
      const __m256 c0 = _mm256_fmsub_ps(_mm256_cvtepi32_ps(KILN_Q4_DOT(lo, hi, e0, o0)), xs0, zt0);
      const __m256 c1 = _mm256_fmsub_ps(_mm256_cvtepi32_ps(KILN_Q4_DOT(lo, hi, e1, o1)), xs1, zt1);
      acc[r][0] = _mm256_fmadd_ps(c0, ws, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(c1, ws, acc[r][1]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < 2; m++)
      y[m * ldy + n0 + r * stride] = hsum(acc[r][m]) + (bias ? bias[n0 + r * stride] : 0.f);
}

// Rows [n0, n1) of W for two rows of x, in four slabs (as symmetric_slabs).
template <class Scale>
static void symmetric_slabs_x2(const int8_t* xe, const int8_t* xo, const float* block_scale,
                               const float* block_quarter, int64_t blocks, const uint8_t* q, const Scale* scales,
                               int64_t K, int64_t gs, int64_t n0, int64_t n1, const float* bias, float* y,
                               int64_t ldy) {
  const int64_t slab = (n1 - n0) / 4;
  for (int64_t j = 0; j < slab; j++)
    symmetric_rows_x2<4>(xe, xo, block_scale, block_quarter, blocks, q, scales, K, gs, n0 + j, slab, bias, y, ldy);
  for (int64_t n = n0 + 4 * slab; n < n1; n++)
    symmetric_rows_x2<1>(xe, xo, block_scale, block_quarter, blocks, q, scales, K, gs, n, 0, bias, y, ldy);
}
