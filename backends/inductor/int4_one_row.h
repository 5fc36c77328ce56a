// Kiln's int4 kernel for one row of x (decode): included by int4_kernel.cpp inside namespace
// kiln_q4, after int4_rows_isa.h (XRow). Hashed with int4_kernel.cpp for the build.
//
// Batch invariance: a row of x gets, bit for bit, the result it gets among many rows (the kernels
// of int4_many_rows.h and int4_panels.h, any M up to kSmallM), so a request decodes the same tokens
// alone and in a batch. Every int4 kernel computes each output the same way: x rounded per block of
// 32 into the same record (kiln_q4_prepare_rows), then per block b in order
//     acc = fma(fmsub(float(dot_b), x_scale_b, zero_term_b), w_scale_b, acc),   y = acc + bias
// with dot_b the block's exact integer dot product and zero_term_b = x_zero_b (symmetric, zero point
// 8) or x_zero_b * (z / 8). Integer sums are exact in any order; only this f32 sequence is fixed.
//
// Here four weight rows (one from each of four slabs of a thread's rows: eight long streams the
// prefetchers keep ahead of, measured 1.4x four neighbouring rows) share each load of x. A 64-weight
// step of a row gives eight int32 lanes (dwords of two blocks, `dot64`); three `hadd`s turn the four
// rows' lanes into the rows' whole block dots, [rows 0-3 at block b | rows 0-3 at block b + 1], and
// the f32 arithmetic runs on the four rows at once, block b then b + 1.

// Rows [n0, n1), four at a time, one from each of four equal slabs: four(n, slab) takes rows n,
// n + slab, n + 2 slab, n + 3 slab. Leftover rows follow one at a time: one(n).
template <class Four, class One>
static void in_slabs(int64_t n0, int64_t n1, Four four, One one) {
  const int64_t slab = (n1 - n0) / 4;
  for (int64_t j = 0; j < slab; j++) four(n0 + j, slab);
  for (int64_t n = n0 + 4 * slab; n < n1; n++) one(n);
}

// Four rows' values at groups g0 (lo) and g1 (hi), as f32 lanes in row order.
template <class Value>
static inline void four_values(const Value* const (&v)[4], int64_t g0, int64_t g1, __m128& lo, __m128& hi) {
  lo = _mm_setr_ps(to_f32(v[0][g0]), to_f32(v[1][g0]), to_f32(v[2][g0]), to_f32(v[3][g0]));
  hi = g1 == g0 ? lo : _mm_setr_ps(to_f32(v[0][g1]), to_f32(v[1][g1]), to_f32(v[2][g1]), to_f32(v[3][g1]));
}
// Groups of 32: each row's two adjacent scales in one load, then a shuffle into rows.
static inline void adjacent_scales(const float* const (&s)[4], int64_t g, __m128& lo, __m128& hi) {
  __m128 t[4];
  for (int r = 0; r < 4; r++) t[r] = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s[r] + g)));
  const __m128 t01 = _mm_unpacklo_ps(t[0], t[1]), t23 = _mm_unpacklo_ps(t[2], t[3]);  // [r0 r1 r0' r1']
  lo = _mm_movelh_ps(t01, t23);
  hi = _mm_movehl_ps(t23, t01);
}
static inline void adjacent_scales(const uint16_t* const (&s)[4], int64_t g, __m128& lo, __m128& hi) {
  int32_t two[4];
  for (int r = 0; r < 4; r++) std::memcpy(&two[r], s[r] + g, sizeof two[r]);
  const __m256 f = _mm256_cvtph_ps(_mm_setr_epi32(two[0], two[1], two[2], two[3]));  // [r0 r0' r1 r1' | r2 ..]
  const __m128 a = _mm256_castps256_ps128(f), b = _mm256_extractf128_ps(f, 1);
  lo = _mm_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
  hi = _mm_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
}

// y[n[r]] for r < count of rows n[0..3] (repeats allowed) with prepared row x: the int4 kernels'
// per-block arithmetic (above). kZeroPoints: u8 zero points, else symmetric (zero point 8).
template <bool kZeroPoints, class Scale>
static void four_rows(const XRow& x, const uint8_t* q, const Scale* scales, const uint8_t* zeros, int64_t K,
                      int64_t gs, const int64_t (&n)[4], int count, const float* bias, float* y) {
  const int64_t G = (K + gs - 1) / gs, row_bytes = K / 2;
  const uint8_t* codes[4];
  const Scale* s[4];
  const uint8_t* z[4];
  for (int r = 0; r < 4; r++) {
    codes[r] = q + n[r] * row_bytes;
    s[r] = scales + n[r] * G;
    z[r] = kZeroPoints ? zeros + n[r] * G : nullptr;
  }
  __m128 acc = _mm_setzero_ps();
  for (int64_t byte = 0; byte < row_bytes; byte += 32) {
    const int64_t b = byte / 16;  // the step's first block of 32
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.even + byte));
    const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.odd + byte));
    __m256i d[4];
    for (int r = 0; r < 4; r++) {
      _mm_prefetch(reinterpret_cast<const char*>(codes[r] + byte) + kPrefetchBytes, _MM_HINT_T0);
      d[r] = dot64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[r] + byte)), e, o);
    }
    const __m256i dots = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
    const int64_t g0 = b * 32 / gs, g1 = (b + 1) * 32 / gs;
    __m128 ws0, ws1;
    if (gs == 32) adjacent_scales(s, g0, ws0, ws1);
    else four_values(s, g0, g1, ws0, ws1);
    __m256 zero_term = pair_at(x.zero + b);
    if constexpr (kZeroPoints) {
      __m128 z0, z1;
      four_values(z, g0, g1, z0, z1);
      zero_term = _mm256_mul_ps(zero_term, _mm256_mul_ps(_mm256_set_m128(z1, z0), _mm256_set1_ps(1.f / 8)));
    }
    const __m256 v = _mm256_fmsub_ps(_mm256_cvtepi32_ps(dots), pair_at(x.scale + b), zero_term);
    acc = _mm_fmadd_ps(_mm256_castps256_ps128(v), ws0, acc);
    acc = _mm_fmadd_ps(_mm256_extractf128_ps(v, 1), ws1, acc);
  }
  alignas(16) float out[4];
  _mm_store_ps(out, acc);
  for (int r = 0; r < count; r++) y[n[r]] = bias ? out[r] + bias[n[r]] : out[r];
}

// y[n] for n in [n0, n1): four rows from the slabs at a time, each leftover row alone (its lanes
// repeat it).
template <bool kZeroPoints, class Scale>
static void one_row(const XRow& x, const uint8_t* q, const Scale* scales, const uint8_t* zeros, int64_t K,
                    int64_t gs, int64_t n0, int64_t n1, const float* bias, float* y) {
  in_slabs(
      n0, n1,
      [&](int64_t n, int64_t slab) {
        const int64_t rows[4] = {n, n + slab, n + 2 * slab, n + 3 * slab};
        four_rows<kZeroPoints>(x, q, scales, zeros, K, gs, rows, 4, bias, y);
      },
      [&](int64_t n) {
        const int64_t rows[4] = {n, n, n, n};
        four_rows<kZeroPoints>(x, q, scales, zeros, K, gs, rows, 1, bias, y);
      });
}
