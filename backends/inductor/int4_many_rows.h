// Kiln's int4 kernel for several rows of x, each panel staged per call (linear_q4; linear_q4_panels
// reads panels packed at lowering, int4_panels.h): included by int4_rows_isa.h twice, inside
// namespace kiln_q4::avx2 (256-bit vectors) and, compiled for AVX-512 VNNI, kiln_q4::vnni
// (512-bit). XRow and the scalar helpers come from int4_rows_isa.h; each namespace first
// defines its vectors' primitives (Codes / Lanes: int / f32 vectors of kVectorBytes; kGroups =
// kVectorBytes / 16 groups of four rows per panel; loads, stores, transposes, block_dot, f32
// arithmetic). Hashed with int4_kernel.cpp for the build.
//
// A panel is kGroups x 4 weight rows (16 with AVX-512, 8 with AVX2), one int32 lane per row: for
// each block of 32 weights, four vectors hold dword j (eight codes) of that block of every row,
// so that a dword of x (four of its int8 values), broadcast to every lane, multiplies all the
// panel's rows at once. Staging a panel reads each row's codes from memory once (with prefetch)
// and transposes them: 4 x 4 dwords within each 128-bit lane (four rows), then 128-bit lanes
// (blocks to groups). Every block of C rows of x then runs over the staged panel (a few KB, in L1):
// per block of 32 weights and row of x, eight integer dot products leave the whole block's dot in
// each row's lane, and three f32 operations scale it: (dot * x scale - zero term) * group scale.

// The panel's rows of W: codes, group scales and zero points (or null) of row (g, r) at [4 * g + r].
template <class Scale>
struct PanelRows {
  const uint8_t* codes[4 * kGroups];
  const Scale* scales[4 * kGroups];
  const uint8_t* zeros[4 * kGroups];
};

// Rows first[g] + r of W (each at most `last`: repeats of it past the end).
template <class Scale>
static PanelRows<Scale> panel_rows_at(const uint8_t* q, const Scale* scales, const uint8_t* zeros, int64_t K,
                                      int64_t gs, const int64_t (&first)[kGroups], int64_t last) {
  const int64_t G = (K + gs - 1) / gs;
  PanelRows<Scale> rows;
  for (int g = 0; g < kGroups; g++)
    for (int r = 0; r < 4; r++) {
      const int64_t n = std::min(first[g] + r, last);
      rows.codes[4 * g + r] = q + n * K / 2;
      rows.scales[4 * g + r] = scales + n * G;
      rows.zeros[4 * g + r] = zeros ? zeros + n * G : nullptr;
    }
  return rows;
}

// The staged panel: per block of 32 weights, four code vectors (dword j of the block, a row per
// lane), its group scales, and for asymmetric weights the zero points / 8.
struct Panel {
  uint8_t* data;
  int64_t block_bytes;  // (5 or 6) * kVectorBytes
  Codes* codes(int64_t block) const { return reinterpret_cast<Codes*>(data + block * block_bytes); }
  float* scale(int64_t block) const { return reinterpret_cast<float*>(codes(block) + 4); }
  float* zero_eighths(int64_t block) const { return reinterpret_cast<float*>(codes(block) + 5); }
};

// Values (group scales, or zero points) of blocks first .. first + kLanes - 1 of a row as f32,
// zero past `blocks`: gs = 32 reads them as they are; larger groups repeat each gs / 32 times.
template <class Value>
static inline Lanes block_values(const Value* row, int64_t gs, int64_t first, int64_t blocks) {
  const int64_t count = std::min<int64_t>(kLanes, blocks - first);
  if (gs == 32) return load_values(row + first, count);
  alignas(64) float v[kLanes] = {};
  const int64_t per_group = gs / 32;
  for (int64_t i = 0; i < count; i++) v[i] = to_f32(row[(first + i) / per_group]);
  return load_lanes(v);
}

// Blocks first .. first + kLanes - 1 (those below `blocks`) of every row's values (scales, or
// zero points times `factor`) into the panel, one vector per block (a row per lane): each row's
// kLanes values are one vector, and the same transposes as the codes' make them columns.
template <class Value>
static inline void stage_values(const Value* const (&rows)[4 * kGroups], int64_t gs, int64_t first, int64_t blocks,
                                float factor, float* (Panel::*at)(int64_t) const, const Panel& panel) {
  Codes v[kGroups][4];
#pragma GCC unroll 4
  for (int g = 0; g < kGroups; g++) {
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) v[g][r] = as_codes(mul(block_values(rows[4 * g + r], gs, first, blocks), set_lanes(factor)));
    transpose_rows(v[g]);  // v[g][j]: block first + 4k + j in 128-bit lane k
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; j++) {
    Codes lanes[kGroups];
    for (int g = 0; g < kGroups; g++) lanes[g] = v[g][j];
    transpose_lanes(lanes);  // lanes[k]: block first + 4k + j, group g in 128-bit lane g
    for (int k = 0; k < kGroups; k++)
      if (first + 4 * k + j < blocks) store_lanes((panel.*at)(first + 4 * k + j), as_lanes(lanes[k]));
  }
}

// Step `step` (kVectorBytes of each row: blocks kGroups * step ..; kHalf: its first 32 bytes only,
// K's last 64 weights) of the panel's codes into the panel, transposed.
template <bool kHalf, class Scale>
static inline void stage_codes(const PanelRows<Scale>& rows, int64_t step, const Panel& panel) {
  const int64_t byte = step * kVectorBytes;
  Codes chunks[kGroups][4];
#pragma GCC unroll 4
  for (int g = 0; g < kGroups; g++) {
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
      const uint8_t* codes = rows.codes[4 * g + r] + byte;
      chunks[g][r] = kHalf ? load_half(codes) : load_codes(codes);
    }
    transpose_rows(chunks[g]);  // chunks[g][j]: dword j of each block, block k in 128-bit lane k
  }
  constexpr int kCount = kHalf ? kGroups / 2 : kGroups;
#pragma GCC unroll 4
  for (int j = 0; j < 4; j++) {
    Codes lanes[kGroups];
    for (int g = 0; g < kGroups; g++) lanes[g] = chunks[g][j];
    transpose_lanes(lanes);  // lanes[k]: dword j of block k, group g in 128-bit lane g
    for (int k = 0; k < kCount; k++) store_codes(panel.codes(kGroups * step + k) + j, lanes[k]);
  }
}

// The panel's rows into `panel`, each row's codes read once (already in cache: prefetch_share
// brought them in while the previous panels computed).
template <class Scale>
static void stage_panel(const PanelRows<Scale>& rows, const uint8_t* zeros, int64_t K, int64_t gs,
                        const Panel& panel) {
  const int64_t full_steps = K / 2 / kVectorBytes, blocks = K / 32;
  for (int64_t step = 0; step < full_steps; step++) stage_codes<false>(rows, step, panel);
  if (K / 2 % kVectorBytes) stage_codes<true>(rows, full_steps, panel);
  for (int64_t b = 0; b < blocks; b += kLanes) {
    stage_values(rows.scales, gs, b, blocks, 1.f, &Panel::scale, panel);
    if (zeros) stage_values(rows.zeros, gs, b, blocks, 1.f / 8, &Panel::zero_eighths, panel);
  }
}

constexpr int64_t kPanelsAhead = 2;  // the panel whose rows prefetch_share brings in: two after this one

// A share of a later panel's rows into the cache, spread over the blocks of this one's first block
// of x (a burst of them all at once would be dropped): at block b, lines b * kGroups .. of the
// rows' codes, row-major by line; at blocks below the row count, each row's scales.
template <class Scale>
static inline void prefetch_share(const PanelRows<Scale>& rows, int64_t b) {
  constexpr int kRows = 4 * kGroups;
#pragma GCC unroll 4
  for (int i = 0; i < kGroups; i++) {
    const int64_t t = b * kGroups + i;
    _mm_prefetch(reinterpret_cast<const char*>(rows.codes[t % kRows]) + 64 * (t / kRows), _MM_HINT_T0);
  }
  if (b < kRows) _mm_prefetch(reinterpret_cast<const char*>(rows.scales[b]), _MM_HINT_T0);
}

// out[c] (a row of the panel per lane) = the panel's dots with rows x[0..C).
template <int C, bool kZeroPoints, class Scale>
static void panel_times_x(const Panel& panel, int64_t blocks, const XRow* x_rows, const PanelRows<Scale>* ahead,
                          Lanes* out) {
  XRow x[C];  // local copies: the compiler keeps the pointers and the accumulators in registers
  Lanes acc[C];
#pragma GCC unroll 16
  for (int c = 0; c < C; c++) {
    x[c] = x_rows[c];
    acc[c] = zero_lanes();
  }
  for (int64_t b = 0; b < blocks; b++) {
    if (ahead) prefetch_share(*ahead, b);
    const Codes* codes = panel.codes(b);
    Codes lo[4], hi[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      lo[j] = low_nibbles(codes[j]);
      hi[j] = high_nibbles(codes[j]);
    }
    const Lanes ws = load_lanes(panel.scale(b));
    const Lanes zq = kZeroPoints ? load_lanes(panel.zero_eighths(b)) : Lanes{};
#pragma GCC unroll 16
    for (int c = 0; c < C; c++) {
      const Codes d = block_dot(lo, hi, x[c].even + 16 * b, x[c].odd + 16 * b);
      const Lanes zt = broadcast(x[c].zero + b), xs = broadcast(x[c].scale + b);
      acc[c] = fmadd(fmsub(to_float(d), xs, kZeroPoints ? mul(zt, zq) : zt), ws, acc[c]);
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < C; c++) out[c] = acc[c];
}

// The panel times the c rows of x at `x` (1 <= c <= C), into acc[0..c).
template <int C = kMostRowsOfX, class Scale>
static void panel_rows(const Panel& panel, int64_t blocks, const XRow* x, int c, bool zero_points,
                       const PanelRows<Scale>* ahead, Lanes* acc) {
  if constexpr (C > 1)
    if (c < C) return panel_rows<C - 1>(panel, blocks, x, c, zero_points, ahead, acc);
  if (zero_points) panel_times_x<C, true>(panel, blocks, x, ahead, acc);
  else panel_times_x<C, false>(panel, blocks, x, ahead, acc);
}

// out[m * m_stride + g * g_stride + r] = the dot of row m of x with the panel's row (g, r), for
// all M rows of x, taken in blocks of nearly equal size (at most kMostRowsOfX rows).
template <class Scale>
static void panel_for_all_x(const XRow* x, int64_t M, const Panel& panel, int64_t blocks, bool zero_points,
                            const PanelRows<Scale>* ahead, float* out, int64_t m_stride, int64_t g_stride) {
  const int64_t x_blocks = (M + kMostRowsOfX - 1) / kMostRowsOfX;
  Lanes acc[kMostRowsOfX];
  for (int64_t xb = 0, m0 = 0; xb < x_blocks; xb++) {
    const int c = (int)(M / x_blocks + (xb < M % x_blocks ? 1 : 0));
    panel_rows(panel, blocks, x + m0, c, zero_points, xb == 0 ? ahead : nullptr, acc);
    for (int i = 0; i < c; i++) store_groups(out + (m0 + i) * m_stride, g_stride, acc[i]);
    m0 += c;
  }
}

// y[m * N + first[g] + j] = tile[(m * kGroups + g) * kTileRows + j] + bias for j < count (a
// multiple of 4).
static void flush_tile(const float* tile, int64_t M, const int64_t (&first)[kGroups], int64_t count,
                       const float* bias, float* y, int64_t N) {
  for (int64_t m = 0; m < M; m++)
    for (int g = 0; g < kGroups; g++)
      for (int64_t j = 0; j < count; j += 4) {
        const __m128 v = _mm_loadu_ps(tile + (m * kGroups + g) * kTileRows + j);
        _mm_storeu_ps(y + m * N + first[g] + j, bias ? _mm_add_ps(v, _mm_loadu_ps(bias + first[g] + j)) : v);
      }
}

// Rows [n0, n1) of W for all M rows of x. The rows split into kGroups slabs (whole groups of four);
// a panel takes the next four rows of each slab, so that the codes stream from kGroups x 4 places
// at once (the prefetchers keep ahead of many streams better than of one). Results gather in a
// tile of kTileRows rows per slab before going to y: y's rows are often a multiple of 4 KB apart
// (N = 1024, 3072, 49152), and a store per (row of x, weight row) would keep M x kGroups lines of
// one cache set in flight. The rows past the slabs (fewer than kGroups x 4) make a last panel.
template <class Scale>
static void many_rows(const XRow* x, int64_t M, const uint8_t* q, const Scale* scales, const uint8_t* zeros,
                      int64_t K, int64_t gs, int64_t n0, int64_t n1, const float* bias, float* y, int64_t N,
                      uint8_t* area, float* tile) {
  const Panel panel{area, (zeros ? 6 : 5) * kVectorBytes};
  const int64_t blocks = K / 32, slab = (n1 - n0) / (4 * kGroups) * 4;
  for (int64_t j0 = 0; j0 < slab; j0 += kTileRows) {
    const int64_t count = std::min(kTileRows, slab - j0);
    int64_t first[kGroups];
    for (int g = 0; g < kGroups; g++) first[g] = n0 + g * slab + j0;
    for (int64_t j = 0; j < count; j += 4) {
      int64_t at[kGroups], later[kGroups];
      for (int g = 0; g < kGroups; g++) {
        at[g] = first[g] + j;
        later[g] = std::min(at[g] + 4 * kPanelsAhead, n0 + (g + 1) * slab - 4);
      }
      stage_panel(panel_rows_at(q, scales, zeros, K, gs, at, n1 - 1), zeros, K, gs, panel);
      const PanelRows<Scale> ahead = panel_rows_at(q, scales, zeros, K, gs, later, n1 - 1);
      panel_for_all_x(x, M, panel, blocks, zeros != nullptr, &ahead, tile + j, kGroups * kTileRows, kTileRows);
    }
    flush_tile(tile, M, first, count, bias, y, N);
  }
  const int64_t rest = n0 + kGroups * slab;
  if (rest < n1) {  // tile[m * 4 * kGroups + row - rest]
    int64_t at[kGroups];
    for (int g = 0; g < kGroups; g++) at[g] = rest + 4 * g;
    stage_panel(panel_rows_at(q, scales, zeros, K, gs, at, n1 - 1), zeros, K, gs, panel);
    panel_for_all_x<Scale>(x, M, panel, blocks, zeros != nullptr, nullptr, tile, 4 * kGroups, 4);
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = rest; n < n1; n++) y[m * N + n] = tile[m * 4 * kGroups + n - rest] + (bias ? bias[n] : 0.f);
  }
}
