// Kiln CPU linear kernels for many rows of x (M = 9..128, and int8 from 4): included by
// gemv_kernel.cpp inside its SIMD translation unit (namespace kiln_gemv; needs its Load*, tail_mask,
// line_start and prefetch_row). Split out to keep each file readable; hashed with it for the build.
#pragma once

// ---- Many rows of x (M > 8): each weight read from memory once per call ----
//
// A step takes kRowStep rows of Wt (row j of each of the kSlabs slabs, as `panel` steps: the same
// order of sums, so M > 8 rows give each row the bits M = 1 gives it) and adds their products to
// every row of x. Within a step, each 16-column tile is read from memory once (each slab's stream
// prefetched kPrefetchBytes ahead), then every block of up to six rows of x is done from L1: 12 accumulators, two
// weight vectors and one broadcast, 12 FMAs per 8 loads. The partial sums live in y, which the
// columns are blocked to keep in L2 (kManyRowsYBytes). int8 tiles are widened to f32 once per
// tile (not once per block of x rows); column tails are staged zero-padded and stored masked.
constexpr int kRowStep = kSlabs;
constexpr int kMaxRowBlock = 6;
constexpr int64_t kManyRowsYBytes = 256 * 1024;

// y[0:MB, 0:16] += sum_{r < rn} x[0:MB, r] * w[r, 0:16]; x(m, r) at xk[r * xrs + m], rows of w rs apart.
template <int MB, bool Masked>
static inline void block16(const float* xk, int64_t xrs, const float* w, int64_t rs, int rn, float* y, int64_t ldy,
                           __m256i mask_lo, __m256i mask_hi) {
  __m256 a[MB][2];
  for (int m = 0; m < MB; m++) {
    a[m][0] = Masked ? _mm256_maskload_ps(y + m * ldy, mask_lo) : _mm256_loadu_ps(y + m * ldy);
    a[m][1] = Masked ? _mm256_maskload_ps(y + m * ldy + 8, mask_hi) : _mm256_loadu_ps(y + m * ldy + 8);
  }
  for (int r = 0; r < rn; r++) {
    const __m256 w0 = _mm256_loadu_ps(w + r * rs), w1 = _mm256_loadu_ps(w + r * rs + 8);
    const float* xr = xk + r * xrs;
    for (int m = 0; m < MB; m++) {
      const __m256 b = _mm256_broadcast_ss(xr + m);
      a[m][0] = _mm256_fmadd_ps(w0, b, a[m][0]);
      a[m][1] = _mm256_fmadd_ps(w1, b, a[m][1]);
    }
  }
  for (int m = 0; m < MB; m++) {
    if (Masked) {
      _mm256_maskstore_ps(y + m * ldy, mask_lo, a[m][0]);
      _mm256_maskstore_ps(y + m * ldy + 8, mask_hi, a[m][1]);
    } else {
      _mm256_storeu_ps(y + m * ldy, a[m][0]);
      _mm256_storeu_ps(y + m * ldy + 8, a[m][1]);
    }
  }
}

template <bool Masked>
static inline void block16_rows(int mb, const float* xk, int64_t xrs, const float* w, int64_t rs, int rn, float* y,
                                int64_t ldy, __m256i mask_lo, __m256i mask_hi) {
  switch (mb) {
    case 1: return block16<1, Masked>(xk, xrs, w, rs, rn, y, ldy, mask_lo, mask_hi);
    case 2: return block16<2, Masked>(xk, xrs, w, rs, rn, y, ldy, mask_lo, mask_hi);
    case 3: return block16<3, Masked>(xk, xrs, w, rs, rn, y, ldy, mask_lo, mask_hi);
    case 4: return block16<4, Masked>(xk, xrs, w, rs, rn, y, ldy, mask_lo, mask_hi);
    case 5: return block16<5, Masked>(xk, xrs, w, rs, rn, y, ldy, mask_lo, mask_hi);
    default: return block16<6, Masked>(xk, xrs, w, rs, rn, y, ldy, mask_lo, mask_hi);
  }
}

// Rows [0, rn) x columns [c, c + n) of the weight as f32 rows of 16 (zero-padded past n).
template <class L>
static inline void stage_tile(const typename L::T* w, int64_t N, int rn, int64_t c, int64_t n, float* out) {
  for (int r = 0; r < rn; r++) {
    const typename L::T* row = w + r * N + c;
    if (n == 16) {
      _mm256_storeu_ps(out + r * 16, L::load(row));
      _mm256_storeu_ps(out + r * 16 + 8, L::load(row + 8));
    } else {
      for (int64_t j = 0; j < 16; j++) out[r * 16 + j] = j < n ? (float)row[j] : 0.f;
    }
  }
}

// One step: y[0:M, c0:c1] += x^T rows [0, rn) (xt, M floats per row) times Wt rows w[0:rn, c0:c1].
template <class L>
static void many_rows_step(const float* xt, int64_t xrs, const int* blocks, int nblocks, const typename L::T* w,
                           int64_t ws, int rn, int64_t c0, int64_t c1, float* y, int64_t ldy) {
  using T = typename L::T;
  alignas(32) float staged[kRowStep * 16];
  for (int64_t c = c0; c < c1; c += 16) {
    const int64_t n = std::min<int64_t>(16, c1 - c);
    if (line_start<T>(c, c0))
      for (int r = 0; r < rn; r++) prefetch_row(w + r * ws, c);
    const float* tile = staged;
    int64_t rs = 16;
    if constexpr (std::is_same_v<T, float>) {
      if (n == 16) tile = w + c, rs = ws;
      else stage_tile<L>(w, ws, rn, c, n, staged);
    } else {
      stage_tile<L>(w, ws, rn, c, n, staged);
    }
    const __m256i mask_lo = tail_mask(std::min<int64_t>(8, n)), mask_hi = tail_mask(std::max<int64_t>(0, n - 8));
    int64_t m0 = 0;
    for (int b = 0; b < nblocks; m0 += blocks[b], b++) {
      if (n == 16) block16_rows<false>(blocks[b], xt + m0, xrs, tile, rs, rn, y + m0 * ldy + c, ldy, mask_lo, mask_hi);
      else block16_rows<true>(blocks[b], xt + m0, xrs, tile, rs, rn, y + m0 * ldy + c, ldy, mask_lo, mask_hi);
    }
  }
}

// The same step with AVX-512 (chosen at run time where the CPU has it): 32-column tiles, blocks
// of up to twelve rows of x (24 accumulators of 32 registers), twice the FMA width of AVX2.
#pragma GCC push_options
#pragma GCC target("avx512f")
constexpr int kMaxRowBlock512 = 12;

template <int MB, bool Masked>
static inline void block32(const float* xk, int64_t xrs, const float* w, int64_t rs, int rn, float* y, int64_t ldy,
                           __mmask16 mask_lo, __mmask16 mask_hi) {
  __m512 a[MB][2];
  for (int m = 0; m < MB; m++) {
    a[m][0] = Masked ? _mm512_maskz_loadu_ps(mask_lo, y + m * ldy) : _mm512_loadu_ps(y + m * ldy);
    a[m][1] = Masked ? _mm512_maskz_loadu_ps(mask_hi, y + m * ldy + 16) : _mm512_loadu_ps(y + m * ldy + 16);
  }
  for (int r = 0; r < rn; r++) {
    const __m512 w0 = _mm512_loadu_ps(w + r * rs), w1 = _mm512_loadu_ps(w + r * rs + 16);
    const float* xr = xk + r * xrs;
    for (int m = 0; m < MB; m++) {
      const __m512 b = _mm512_set1_ps(xr[m]);
      a[m][0] = _mm512_fmadd_ps(w0, b, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(w1, b, a[m][1]);
    }
  }
  for (int m = 0; m < MB; m++) {
    if (Masked) {
      _mm512_mask_storeu_ps(y + m * ldy, mask_lo, a[m][0]);
      _mm512_mask_storeu_ps(y + m * ldy + 16, mask_hi, a[m][1]);
    } else {
      _mm512_storeu_ps(y + m * ldy, a[m][0]);
      _mm512_storeu_ps(y + m * ldy + 16, a[m][1]);
    }
  }
}

template <bool Masked>
static void block32_rows(int mb, const float* xk, int64_t xrs, const float* w, int64_t rs, int rn, float* y,
                         int64_t ldy, __mmask16 lo, __mmask16 hi) {
  switch (mb) {
    case 1: return block32<1, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    case 2: return block32<2, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    case 3: return block32<3, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    case 4: return block32<4, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    case 5: return block32<5, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    case 6: return block32<6, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    case 7: return block32<7, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    case 8: return block32<8, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    case 9: return block32<9, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    case 10: return block32<10, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    case 11: return block32<11, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
    default: return block32<12, Masked>(xk, xrs, w, rs, rn, y, ldy, lo, hi);
  }
}

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <class T>
static void many_rows_step512(const float* xt, int64_t xrs, const int* blocks, int nblocks, const T* w, int64_t ws,
                              int rn, int64_t c0, int64_t c1, float* y, int64_t ldy) {
  alignas(64) float staged[kRowStep * 32];
  for (int64_t c = c0; c < c1; c += 32) {
    const int64_t n = std::min<int64_t>(32, c1 - c);
    for (int64_t half = c; half < c + 32; half += 16)
      if (line_start<T>(half, c0))
        for (int r = 0; r < rn; r++) prefetch_row(w + r * ws, half);
    const float* tile = staged;
    int64_t rs = 32;
    if (std::is_same_v<T, float> && n == 32) {
      tile = reinterpret_cast<const float*>(w + c), rs = ws;
    } else {
      for (int r = 0; r < rn; r++) {
        const T* row = w + r * ws + c;
        if (n == 32) {
          _mm512_store_ps(staged + r * 32, load16(row));
          _mm512_store_ps(staged + r * 32 + 16, load16(row + 16));
        } else {
          for (int64_t j = 0; j < 32; j++) staged[r * 32 + j] = j < n ? (float)row[j] : 0.f;
        }
      }
    }
    const __mmask16 lo = (__mmask16)((1u << std::min<int64_t>(16, n)) - 1);
    const __mmask16 hi = (__mmask16)((1u << std::max<int64_t>(0, n - 16)) - 1);
    int64_t m0 = 0;
    for (int b = 0; b < nblocks; m0 += blocks[b], b++) {
      if (n == 32) block32_rows<false>(blocks[b], xt + m0, xrs, tile, rs, rn, y + m0 * ldy + c, ldy, lo, hi);
      else block32_rows<true>(blocks[b], xt + m0, xrs, tile, rs, rn, y + m0 * ldy + c, ldy, lo, hi);
    }
  }
}

// ---- AVX-512, f32 weights: blocks computed from L2 while the next one streams in ----
//
// The rows of Wt are taken in the kernel's order (kernel_order: step by step, slab by slab, then
// the rows left over) and cut, with the columns, into blocks of about kBlockBytes. Within a block
// each 64-column tile runs the rows of x in blocks of up to six, 24 accumulators held in
// registers over all the block's rows (y read and written once per block, so each element still
// takes one FMA per k in the kernel's order). Meanwhile the next block's lines are asked for into
// L2 row by row in address order: runs of up to 4 KB, which memory streams far better than the
// 16 slab streams of 64-byte pieces many_rows_step512 reads (bench/many_rows_probe.py on AMD EPYC,
// 16 rows of x: 30.7 ms for SmolLM2's linears against 47.9).
constexpr int kTileVectors = 4;  // 64 columns
constexpr int kTileRows = 6;     // rows of x per register tile: 24 accumulators
constexpr int64_t kBlockBytes = 256 * 1024;  // 128 KB and a first block asked for up front: no faster
constexpr int64_t kBlockCols = 1024;

// The next block's lines, a few asked for at each of this block's row steps.
struct BlockPrefetch {
  const float* base = nullptr;    // Wt + the block's first column
  const int64_t* rows = nullptr;  // its rows' offsets in Wt (floats), in address order
  int64_t nrows = 0, lines = 0, per_step = 0, r = 0, l = 0;
  inline void step() {
    for (int64_t t = 0; t < per_step && r < nrows; t++) {
      _mm_prefetch(reinterpret_cast<const char*>(base + rows[r]) + l * 64, _MM_HINT_T1);
      if (++l == lines) l = 0, r++;
    }
  }
};

// A register tile's accumulators to y (row m at y + m * ldy), the last vector masked where Masked.
template <int MB, int NV, bool Masked>
static inline void store_tile512(__m512 (&a)[MB][NV], float* y, int64_t ldy, __mmask16 last) {
  for (int m = 0; m < MB; m++)
    for (int v = 0; v < NV; v++) {
      if (Masked && v == NV - 1) _mm512_mask_storeu_ps(y + m * ldy + 16 * v, last, a[m][v]);
      else _mm512_storeu_ps(y + m * ldy + 16 * v, a[m][v]);
    }
}

// y[0:MB, 0:16 NV] += sum_i x(m, i) * w[rows[i], 0:16 NV]; x(m, i) at xo[i * M + m]; the last
// vector's columns masked by `last` where Masked.
template <int MB, int NV, bool Masked>
static inline void block_tile(const float* xo, int64_t M, const float* w, const int64_t* rows, int64_t nk,
                              float* y, int64_t ldy, __mmask16 last, BlockPrefetch& next) {
  __m512 a[MB][NV];
  for (int m = 0; m < MB; m++)
    for (int v = 0; v < NV; v++)
      a[m][v] = Masked && v == NV - 1 ? _mm512_maskz_loadu_ps(last, y + m * ldy + 16 * v)
                                      : _mm512_loadu_ps(y + m * ldy + 16 * v);
  for (int64_t i = 0; i < nk; i++) {
    next.step();
    const float* wr = w + rows[i];
    __m512 wv[NV];
    for (int v = 0; v < NV; v++)
      wv[v] = Masked && v == NV - 1 ? _mm512_maskz_loadu_ps(last, wr + 16 * v) : _mm512_loadu_ps(wr + 16 * v);
    const float* xi = xo + i * M;
    for (int m = 0; m < MB; m++) {
      const __m512 b = _mm512_set1_ps(xi[m]);
      for (int v = 0; v < NV; v++) a[m][v] = _mm512_fmadd_ps(wv[v], b, a[m][v]);
    }
  }
  store_tile512<MB, NV, Masked>(a, y, ldy, last);
}

// One tile's columns for every row of x, in register tiles of up to kTileRows rows.
template <int NV, bool Masked>
static void block_tile_rows(const float* xo, int64_t M, const float* w, const int64_t* rows, int64_t nk, float* y,
                            int64_t ldy, __mmask16 last, BlockPrefetch& next) {
  const int nb = (int)((M + kTileRows - 1) / kTileRows);
  for (int b = 0, m0 = 0; b < nb; b++) {
    const int mb = (int)(M / nb + (b < M % nb ? 1 : 0));
    const float* xb = xo + m0;
    float* yb = y + m0 * ldy;
    switch (mb) {
      case 1: block_tile<1, NV, Masked>(xb, M, w, rows, nk, yb, ldy, last, next); break;
      case 2: block_tile<2, NV, Masked>(xb, M, w, rows, nk, yb, ldy, last, next); break;
      case 3: block_tile<3, NV, Masked>(xb, M, w, rows, nk, yb, ldy, last, next); break;
      case 4: block_tile<4, NV, Masked>(xb, M, w, rows, nk, yb, ldy, last, next); break;
      case 5: block_tile<5, NV, Masked>(xb, M, w, rows, nk, yb, ldy, last, next); break;
      default: block_tile<kTileRows, NV, Masked>(xb, M, w, rows, nk, yb, ldy, last, next);
    }
    m0 += mb;
  }
}

// y[0:M, c0:c1] (holding init_row or 0) += x[0:M, k0:k1] @ Wt[k0:k1, c0:c1], f32 weights.
static void panel_blocks(const float* x, int64_t ldx, int64_t M, const float* Wt, int64_t N, int64_t k0, int64_t k1,
                         int64_t c0, int64_t c1, float* y, int64_t ldy) {
  constexpr int TW = 16 * kTileVectors;
  const int64_t slab = (k1 - k0) / kRowStep, nk = k1 - k0;
  std::vector<int64_t> rows;  // Wt's rows in the kernel's order, as offsets
  rows.reserve(nk);
  for (int64_t j = 0; j < slab; j++)
    for (int r = 0; r < kRowStep; r++) rows.push_back((k0 + j + r * slab) * N);
  for (int64_t k = k0 + slab * kRowStep; k < k1; k++) rows.push_back(k * N);
  std::unique_ptr<float[]> xo(new float[nk * M]);  // x in that order: M floats per row of Wt
  for (int64_t i = 0; i < nk; i++)
    for (int64_t m = 0; m < M; m++) xo[i * M + m] = x[m * ldx + rows[i] / N];
  const int64_t width = std::min<int64_t>((c1 - c0 + TW - 1) / TW * TW, kBlockCols);
  const int64_t depth = std::min<int64_t>(nk, std::max<int64_t>(kRowStep, kBlockBytes / (width * 4) / kRowStep * kRowStep));
  struct Block { int64_t cs, ce, i0, i1; };
  std::vector<Block> blocks;
  for (int64_t cs = c0; cs < c1; cs += width)
    for (int64_t i0 = 0; i0 < nk; i0 += depth) blocks.push_back({cs, std::min(c1, cs + width), i0, std::min(nk, i0 + depth)});
  std::vector<int64_t> by_address;
  const int64_t row_tiles = (M + kTileRows - 1) / kTileRows;
  for (size_t b = 0; b < blocks.size(); b++) {
    const Block& B = blocks[b];
    BlockPrefetch next;
    if (b + 1 < blocks.size()) {
      const Block& F = blocks[b + 1];
      by_address.assign(rows.begin() + F.i0, rows.begin() + F.i1);
      std::sort(by_address.begin(), by_address.end());
      const int64_t steps = (B.ce - B.cs + TW - 1) / TW * row_tiles * (B.i1 - B.i0);
      next = BlockPrefetch{Wt + F.cs, by_address.data(), F.i1 - F.i0, (F.ce - F.cs + 15) / 16};
      next.per_step = (next.nrows * next.lines + steps - 1) / steps;
    }
    const float* xb = xo.get() + B.i0 * M;
    const int64_t* rb = rows.data() + B.i0;
    int64_t c = B.cs;
    for (; c + TW <= B.ce; c += TW) block_tile_rows<kTileVectors, false>(xb, M, Wt + c, rb, B.i1 - B.i0, y + c, ldy, 0, next);
    for (; c < B.ce; c += 16) {
      const __mmask16 last = (__mmask16)((1u << std::min<int64_t>(16, B.ce - c)) - 1);
      block_tile_rows<1, true>(xb, M, Wt + c, rb, B.i1 - B.i0, y + c, ldy, last, next);
    }
  }
}
#pragma GCC pop_options

static bool use_avx512 = __builtin_cpu_supports("avx512f");

// Rows of x from which panel_many beats the slab kernels in gemv_kernel.cpp (whole SmolLM2 steps,
// 2 threads): f32 streams better through `panel` up to 8 rows (from 2 rows, panel_many made
// steps of 2-8 tokens 14-18% slower, though the linears alone measured 5-10% faster), and with
// AVX-512 up to 6 (panel_blocks from 7 rows: 30.5 ms against 35.2 at 8 rows, 25.1 against 22.8
// at 6, bench/many_rows_probe.py on AMD EPYC); int8 gains from widening each tile once from 4 rows.
template <class T>
static inline int64_t many_rows_from() {
  return std::is_same_v<T, float> ? (use_avx512 ? 7 : 9) : 4;
}

// y[0:M, c0:c1] = init_row (or 0) + x[0:M, k0:k1] @ Wt[k0:k1, c0:c1] for any M.
template <class L>
static void panel_many(const float* x, int64_t ldx, int64_t M, const typename L::T* Wt, int64_t N, int64_t k0,
                       int64_t k1, int64_t c0, int64_t c1, float* y, int64_t ldy, const float* init_row) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t c = c0; c < c1; c++) y[m * ldy + c] = init_row ? init_row[c] : 0.f;
  if (k0 == k1) return;
  if constexpr (std::is_same_v<typename L::T, float>)
    if (use_avx512) return panel_blocks(x, ldx, M, Wt, N, k0, k1, c0, c1, y, ldy);
  std::unique_ptr<float[]> xt(new float[(k1 - k0) * M]);  // x^T: a step's broadcasts are base + m
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = k0; k < k1; k++) xt[(k - k0) * M + m] = x[m * ldx + k];
  const bool wide = use_avx512;
  const int max_block = wide ? kMaxRowBlock512 : kMaxRowBlock;
  const int nblocks = (int)((M + max_block - 1) / max_block);  // blocks of x rows, sizes within one
  std::unique_ptr<int[]> blocks(new int[nblocks]);
  for (int b = 0; b < nblocks; b++) blocks[b] = (int)(M / nblocks + (b < M % nblocks ? 1 : 0));
  const int64_t width = std::max<int64_t>(64, kManyRowsYBytes / (M * (int64_t)sizeof(float)) / 32 * 32);
  // A step takes row j of each of kRowStep equal slabs of [k0, k1) (long streams, as panel's),
  // then the rows left over in one last step.
  const int64_t slab = (k1 - k0) / kRowStep, left = (k1 - k0) - slab * kRowStep;
  auto step = [&](int64_t k, int64_t row_stride, int rn, int64_t cs, int64_t ce) {
    const float* xk = xt.get() + (k - k0) * M;
    if (wide) many_rows_step512(xk, row_stride * M, blocks.get(), nblocks, Wt + k * N, row_stride * N, rn, cs, ce, y, ldy);
    else many_rows_step<L>(xk, row_stride * M, blocks.get(), nblocks, Wt + k * N, row_stride * N, rn, cs, ce, y, ldy);
  };
  for (int64_t cs = c0; cs < c1; cs += width) {
    const int64_t ce = std::min(c1, cs + width);
    for (int64_t j = 0; j < slab; j++) step(k0 + j, slab, kRowStep, cs, ce);
    if (left) step(k0 + slab * kRowStep, 1, (int)left, cs, ce);
  }
}

