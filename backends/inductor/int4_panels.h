// Kiln's int4 kernel over weights packed at lowering into panels (int4_kernel.py's pack_panels):
// included by int4_rows_isa.h inside kiln_q4::avx2 and kiln_q4::vnni after int4_many_rows.h,
// whose primitives and per-block arithmetic it shares. The staged kernel (int4_many_rows.h)
// spends ~40 cycles per block of 32 weights and 16 weight rows transposing codes and scales into
// L1 on every call; here that layout is made once, so a call streams it as it lies.
//
// A panel holds 16 consecutive weight rows (rows past N are zeros), kPanelBytes apart:
//   codes  [blocks][4][16][4] u8: dword j of each block of 32 weights, row i at bytes 4i..4i+3;
//   scales [blocks][16] f16 (symmetric weights) or f32 (with zero points), a row per lane;
//   zeros  [blocks][16] u8 (with zero points only);
// padded to a whole number of 64 bytes. With AVX-512 a code vector is a block's dword j of all
// 16 rows; AVX2 reads each panel as two halves of 8 rows (kHalves), one after the other.

constexpr int kHalves = 16 / kLanes;

// A panel's blocks as the kernel reads them: the code vectors, scales and zero points of the
// rows half * kLanes .. + kLanes.
template <class Scale>
struct PackedPanel {
  const uint8_t* codes;  // block b, dword j at codes + 256 * b + 64 * j
  const Scale* scales;   // block b at scales + 16 * b
  const uint8_t* zeros;  // block b at zeros + 16 * b, or null
};

template <class Scale>
static inline PackedPanel<Scale> packed_panel(const uint8_t* panel, int64_t blocks, bool zero_points, int half) {
  const Scale* scales = reinterpret_cast<const Scale*>(panel + 256 * blocks) + half * kLanes;
  const uint8_t* zeros = zero_points ? panel + (256 + 16 * sizeof(Scale)) * blocks + half * kLanes : nullptr;
  return {panel + half * kVectorBytes, scales, zeros};
}

// Lines [b * per_block, (b + 1) * per_block) of a later panel into the cache, spread over this
// panel's blocks (a burst of them all at once would be dropped).
static inline void prefetch_lines(const uint8_t* ahead, int64_t b, int64_t per_block, int64_t lines) {
  for (int64_t line = b * per_block; line < std::min(lines, (b + 1) * per_block); line++)
    _mm_prefetch(reinterpret_cast<const char*>(ahead) + 64 * line, _MM_HINT_T0);
}

// out[c] (a row of the panel per lane) = the panel's dots with rows x[0..C): per block, the
// staged kernel's eight integer dot products and three f32 operations per row of x.
template <int C, bool kZeroPoints, class Scale>
static void packed_times_x(const PackedPanel<Scale>& panel, int64_t blocks, const XRow* x_rows, const uint8_t* ahead,
                           int64_t panel_lines, Lanes* out) {
  XRow x[C];
  Lanes acc[C];
#pragma GCC unroll 16
  for (int c = 0; c < C; c++) {
    x[c] = x_rows[c];
    acc[c] = zero_lanes();
  }
  const int64_t per_block = (panel_lines + blocks - 1) / blocks;
  for (int64_t b = 0; b < blocks; b++) {
    if (ahead) prefetch_lines(ahead, b, per_block, panel_lines);
    const uint8_t* codes = panel.codes + 256 * b;
    Codes lo[4], hi[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      const Codes c = load_codes(codes + 64 * j);
      lo[j] = low_nibbles(c);
      hi[j] = high_nibbles(c);
    }
    const Lanes ws = load_values(panel.scales + 16 * b, kLanes);
    const Lanes zq = kZeroPoints ? mul(load_values(panel.zeros + 16 * b, kLanes), set_lanes(0.125f)) : Lanes{};
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
static void packed_rows(const PackedPanel<Scale>& panel, int64_t blocks, const XRow* x, int c,
                        const uint8_t* ahead, int64_t panel_lines, Lanes* acc) {
  if constexpr (C > 1)
    if (c < C) return packed_rows<C - 1>(panel, blocks, x, c, ahead, panel_lines, acc);
  if (panel.zeros) packed_times_x<C, true>(panel, blocks, x, ahead, panel_lines, acc);
  else packed_times_x<C, false>(panel, blocks, x, ahead, panel_lines, acc);
}

// y[m * N + n] (+ bias[n]) for the `count` (<= kLanes) rows n = first.. in v's lanes.
static inline void store_rows(Lanes v, const float* bias, int64_t first, int64_t count, float* y) {
  alignas(64) float lanes[kLanes];
  store_lanes(lanes, v);
  for (int64_t i = 0; i < count; i++) y[first + i] = lanes[i] + (bias ? bias[first + i] : 0.f);
}

// The t-th panel of [p0, p1) in the order they are read: kSlabs slabs, the next panel of each in
// turn, so that the weights stream from kSlabs places at once (the prefetchers keep ahead of
// several streams better than of one); the panels past the slabs last.
constexpr int64_t kSlabs = 4;
static inline int64_t panel_at(int64_t t, int64_t p0, int64_t p1) {
  const int64_t slab = (p1 - p0) / kSlabs;
  return t < kSlabs * slab ? p0 + (t % kSlabs) * slab + t / kSlabs : p0 + t;
}

// Panels [p0, p1) of the packed weight times all M rows of x, each panel read from memory once
// (a later panel's lines prefetched while it computes) and run over by blocks of nearly equal
// size of x's rows (at most kMostRowsOfX).
template <class Scale>
static void packed_panels(const XRow* x, int64_t M, const uint8_t* packed, int64_t panel_bytes, int64_t K,
                          bool zero_points, int64_t p0, int64_t p1, const float* bias, float* y, int64_t N) {
  const int64_t blocks = K / 32, lines = panel_bytes / 64;
  const int64_t x_blocks = (M + kMostRowsOfX - 1) / kMostRowsOfX;
  constexpr int64_t kPanelsAhead = 2;
  Lanes acc[kMostRowsOfX];
  for (int64_t t = 0; t < p1 - p0; t++) {
    const int64_t p = panel_at(t, p0, p1);
    const uint8_t* panel = packed + p * panel_bytes;
    const uint8_t* ahead =
        t + kPanelsAhead < p1 - p0 ? packed + panel_at(t + kPanelsAhead, p0, p1) * panel_bytes : nullptr;
    for (int half = 0; half < kHalves; half++) {
      const int64_t first = 16 * p + half * kLanes, count = std::min<int64_t>(kLanes, N - first);
      if (count <= 0) break;
      const PackedPanel<Scale> rows = packed_panel<Scale>(panel, blocks, zero_points, half);
      for (int64_t xb = 0, m0 = 0; xb < x_blocks; xb++) {
        const int c = (int)(M / x_blocks + (xb < M % x_blocks ? 1 : 0));
        packed_rows(rows, blocks, x + m0, c, xb == 0 && half == 0 ? ahead : nullptr, lines, acc);
        for (int i = 0; i < c; i++) {
          float* row = y + (m0 + i) * N;
          if (count < kLanes) store_rows(acc[i], bias, first, count, row);
          else store_unaligned(row + first, bias ? add(acc[i], load_unaligned(bias + first)) : acc[i]);
        }
        m0 += c;
      }
    }
  }
}
