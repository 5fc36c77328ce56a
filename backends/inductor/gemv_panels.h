// Kiln CPU fp32 linear over panel-major weights, any number of rows of x: included by
// gemv_kernel.cpp inside its SIMD translation unit (namespace kiln_gemv; needs tail_mask and
// use_avx512). Split out to keep each file readable; hashed with it for the build.
//
// Layout ("panels", pack_linear_weight in gemv_kernel.py): Wt [K, N] cut into panels of `width`
// columns (32 or 64; the last panel holds what is left), each stored [K, width] row after row,
// panel after panel. A panel is one sequential stream the hardware prefetcher follows on its own,
// so a thread that computes while it streams keeps the memory busy: a whole SmolLM2-135M step over
// 8 tokens costs 1.17x one token, where the slab kernels' interleaved streams (gemv_kernel.cpp,
// gemv_many_rows.h) cost 1.44x, and one token is 6% faster
// (bench/results/step_cost-panels-epyc-x-in-place.md, AMD EPYC).
//
// Order of sums: every output element is one FMA chain from its bias (or 0) over k = 0..K-1,
// whatever the number of rows, the ISA or the thread split (threads take whole panels), so a row's
// result is the same bits alone or among others (batch-invariant decode).
#pragma once

// Rows of weights a many-row pass takes before the next row tile reuses them from L1: the
// accumulators go to y and back once per chunk. One row streams the whole panel in one pass.
constexpr int64_t kPanelChunk = 128;

// The next chunk's weight rows, asked for into L2 while this chunk's row tiles run: the hardware
// prefetcher runs only a little ahead of the first tile's reads, so without this the memory idles
// while the other tiles compute from cache (16 rows of x: SmolLM2's linears 25-26 ms against 30-31
// in the probe, AMD EPYC). Each of a chunk's `passes` row tiles asks for every passes-th row, its
// turn. One row of x streams on the hardware prefetcher alone (faster so).
struct Ahead {
  const char* next = nullptr;  // the next chunk's first row (the next panel's after a panel's last)
  int64_t row_bytes = 0;
  int pass = 0, passes = 1;
  inline void ask(int64_t k, int64_t& turn) const {
    if (next && turn == pass)
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(next + k * row_bytes + b, _MM_HINT_T1);
    if (++turn == passes) turn = 0;
  }
};

// ---- AVX-512: a register tile of up to 6 rows x 64 columns (NV = 4) or 12 x 32 (NV = 2) ----
#pragma GCC push_options
#pragma GCC target("avx512f")
template <int MB, int NV, bool Masked>
static inline void panel_tile512(const float* xk, int64_t ldx, const float* w, int64_t rs, int64_t kn, const float* init,
                                 int64_t ldi, float* y, int64_t ldy, __mmask16 last, const Ahead& ahead) {
  __m512 a[MB][NV];
  for (int m = 0; m < MB; m++)
    for (int v = 0; v < NV; v++) {
      const float* src = init ? init + m * ldi + 16 * v : nullptr;
      a[m][v] = !src ? _mm512_setzero_ps() : Masked && v == NV - 1 ? _mm512_maskz_loadu_ps(last, src) : _mm512_loadu_ps(src);
    }
  for (int64_t k = 0, turn = 0; k < kn; k++) {
    ahead.ask(k, turn);
    __m512 wv[NV];
    for (int v = 0; v < NV; v++)
      wv[v] = Masked && v == NV - 1 ? _mm512_maskz_loadu_ps(last, w + k * rs + 16 * v) : _mm512_loadu_ps(w + k * rs + 16 * v);
    for (int m = 0; m < MB; m++) {
      const __m512 b = _mm512_set1_ps(xk[m * ldx + k]);
      for (int v = 0; v < NV; v++) a[m][v] = _mm512_fmadd_ps(wv[v], b, a[m][v]);
    }
  }
  store_tile512<MB, NV, Masked>(a, y, ldy, last);
}

template <int NV, bool Masked>
static void panel_tile512_rows(int mb, const float* xk, int64_t ldx, const float* w, int64_t rs, int64_t kn,
                               const float* init, int64_t ldi, float* y, int64_t ldy, __mmask16 last,
                               const Ahead& ahead) {
  switch (mb) {  // callers keep mb <= 24 / NV (24 accumulators)
#define KILN_TILE(R) \
  case R: return panel_tile512<(R <= 24 / NV ? R : 1), NV, Masked>(xk, ldx, w, rs, kn, init, ldi, y, ldy, last, ahead);
    KILN_TILE(1) KILN_TILE(2) KILN_TILE(3) KILN_TILE(4) KILN_TILE(5) KILN_TILE(6)
    KILN_TILE(7) KILN_TILE(8) KILN_TILE(9) KILN_TILE(10) KILN_TILE(11) KILN_TILE(12)
#undef KILN_TILE
  }
}
#pragma GCC pop_options

// ---- AVX2: a register tile of up to 3 rows x 32 columns (NV = 4 vectors of 8), or one row x 64 ----
template <int MB, int NV, bool Masked>
static inline void panel_tile256(const float* xk, int64_t ldx, const float* w, int64_t rs, int64_t kn, const float* init,
                                 int64_t ldi, float* y, int64_t ldy, __m256i last, const Ahead& ahead) {
  __m256 a[MB][NV];
  for (int m = 0; m < MB; m++)
    for (int v = 0; v < NV; v++) {
      const float* src = init ? init + m * ldi + 8 * v : nullptr;
      a[m][v] = !src ? _mm256_setzero_ps() : Masked && v == NV - 1 ? _mm256_maskload_ps(src, last) : _mm256_loadu_ps(src);
    }
  for (int64_t k = 0, turn = 0; k < kn; k++) {
    ahead.ask(k, turn);
    __m256 b[MB];
    for (int m = 0; m < MB; m++) b[m] = _mm256_broadcast_ss(xk + m * ldx + k);
    for (int v = 0; v < NV; v++) {
      const __m256 wv = Masked && v == NV - 1 ? _mm256_maskload_ps(w + k * rs + 8 * v, last) : _mm256_loadu_ps(w + k * rs + 8 * v);
      for (int m = 0; m < MB; m++) a[m][v] = _mm256_fmadd_ps(wv, b[m], a[m][v]);
    }
  }
  for (int m = 0; m < MB; m++)
    for (int v = 0; v < NV; v++) {
      if (Masked && v == NV - 1) _mm256_maskstore_ps(y + m * ldy + 8 * v, last, a[m][v]);
      else _mm256_storeu_ps(y + m * ldy + 8 * v, a[m][v]);
    }
}

template <int NV, bool Masked>
static void panel_tile256_rows(int mb, const float* xk, int64_t ldx, const float* w, int64_t rs, int64_t kn,
                               const float* init, int64_t ldi, float* y, int64_t ldy, __m256i last,
                               const Ahead& ahead) {
  switch (mb) {
    case 1: return panel_tile256<1, NV, Masked>(xk, ldx, w, rs, kn, init, ldi, y, ldy, last, ahead);
    case 2: return panel_tile256<2, NV, Masked>(xk, ldx, w, rs, kn, init, ldi, y, ldy, last, ahead);
    default: return panel_tile256<3, NV, Masked>(xk, ldx, w, rs, kn, init, ldi, y, ldy, last, ahead);
  }
}

// Columns [c, c + n) of one panel (row stride rs) over weight rows [k0, k0 + kn), every row of x in
// tiles of up to max_rows; accumulators from the bias row (k0 = 0) or y.
static void panel_columns(const float* x, int64_t ldx, int64_t M, const float* w, int64_t rs, int64_t k0, int64_t kn,
                          const float* bias, int64_t c, int64_t n, float* y, int64_t ldy) {
  const bool wide = use_avx512;
  const int cols = wide ? 16 : 8, max_rows = wide ? (n > 32 ? 6 : 12) : 3;
  const int nv = (int)((n + cols - 1) / cols), tail = (int)(n - (nv - 1) * cols);
  const bool masked = tail != cols;
  const __mmask16 last = (__mmask16)((1u << tail) - 1);
  const int64_t ldi = k0 ? ldy : 0;
  const int nb = (int)((M + max_rows - 1) / max_rows);
  for (int b = 0, m0 = 0; b < nb; b++) {
    const int mb = (int)(M / nb + (b < M % nb ? 1 : 0));
    Ahead ahead;
    if (M > 1) ahead = Ahead{reinterpret_cast<const char*>(w + kn * rs), rs * (int64_t)sizeof(float), b, nb};
    const float* xk = x + m0 * ldx + k0;
    const float* init = k0 ? y + m0 * ldy + c : bias ? bias + c : nullptr;
    float* yb = y + m0 * ldy + c;
    if (wide) {
      if (nv == 4 && !masked) panel_tile512_rows<4, false>(mb, xk, ldx, w, rs, kn, init, ldi, yb, ldy, last, ahead);
      else if (nv == 2 && !masked) panel_tile512_rows<2, false>(mb, xk, ldx, w, rs, kn, init, ldi, yb, ldy, last, ahead);
      else  // a narrow last panel: 16 columns at a time
        for (int v = 0; v < nv; v++) {
          const __mmask16 mask = v == nv - 1 ? last : (__mmask16)0xFFFF;
          const float* iv = init ? init + 16 * v : nullptr;
          panel_tile512_rows<1, true>(mb, xk, ldx, w + 16 * v, rs, kn, iv, ldi, yb + 16 * v, ldy, mask, Ahead{});
        }
    } else if (M == 1 && n == 64) {  // one row reads a 64-column panel in one pass, as with AVX-512
      panel_tile256<1, 8, false>(xk, ldx, w, rs, kn, init, ldi, yb, ldy, tail_mask(8), ahead);
    } else {
      for (int64_t g = 0; g < n; g += 32) {  // 32 columns (4 vectors of 8) at a time
        const int64_t gn = std::min<int64_t>(32, n - g);
        const float* ig = init ? init + g : nullptr;
        if (gn == 32) panel_tile256_rows<4, false>(mb, xk, ldx, w + g, rs, kn, ig, ldi, yb + g, ldy, tail_mask(8), g ? Ahead{} : ahead);
        else
          for (int64_t v = 0; v < gn; v += 8)
            panel_tile256_rows<1, true>(mb, xk, ldx, w + g + v, rs, kn, ig ? ig + v : nullptr, ldi, yb + g + v, ldy,
                                        tail_mask(std::min<int64_t>(8, gn - v)), Ahead{});
      }
    }
    m0 += mb;
  }
}

// y[0:M, panels p0..p1) = bias + x @ Wt for those panels' columns; x's rows ldx apart.
static void panels_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panels, int64_t N, int64_t width,
                       int64_t p0, int64_t p1, const float* bias, float* y, int64_t ldy) {
  const int64_t chunk = M == 1 ? std::max<int64_t>(K, 1) : kPanelChunk;
  for (int64_t p = p0; p < p1; p++) {
    const int64_t c = p * width, n = std::min(width, N - c);
    const float* w = panels + c * K;  // the panels before p hold K x width each
    if (K == 0) {
      for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < n; j++) y[m * ldy + c + j] = bias ? bias[c + j] : 0.f;
      continue;
    }
    for (int64_t k0 = 0; k0 < K; k0 += chunk)
      panel_columns(x, ldx, M, w + k0 * n, n, k0, std::min(chunk, K - k0), bias, c, n, y, ldy);
  }
}
