// Kiln CPU linear kernels for decode (M = 1), small batches (M <= 8) and many rows (M <= kSmallM = 128:
// speculative verification, batched decode, prefill chunks), each reading the weight from memory once per call.
//
// Packed fp32 weight: logical shape [K, N] (= W.t(), W is nn.Linear's [N, K]) in one of three
// memory layouts (pack_linear_weight in gemv_kernel.py makes "kn" unless asked otherwise):
//   "panels": what the Inductor lowering uses: panels of 32 or 64 columns, each [K, width], read by
//         gemv_panels.h for every M (kiln::linear_f32_panels); the two below serve linear_f32.
//   "kn": W.t().contiguous() -> this file's kernels for M <= 128: a thread's rows are cut into
//         slabs read side by side with prefetch (long sequential streams); `panel` does M <= 8
//         with x broadcasts per weight vector, `panel_many` blocks of up to 6 (AVX2) or 12
//         (AVX-512, chosen at run time) rows of x per weight tile held in L1 (1.2-1.6x MKL's
//         GEMM at 64-128 rows, level at 256); longer prefill (M > 128)
//         is the plain row-major GEMM x[M,K] @ Wt[K,N] in MKL, so no second copy is kept.
//   "nk": W itself, seen through .t() -> MKL for every M (slower than "kn" on every SmolLM2
//         shape since the kernel streams in slabs; kept for callers that cannot copy W).
//
// Packed int8 layout: Wq_t int8 [K, N] with per-output-channel fp32 scales [N]
// (symmetric, weight-only): y = (x @ Wq_t) * scales + bias.
//
// Any K and N are accepted (tails are handled); only AVX2 + FMA are required
// (Intel Haswell+, AMD Zen+); AVX-512F is used for M > 8 where the CPU has it. Threads: torch's intra-op pool (at::parallel_for,
// torch.set_num_threads). Ops are registered as kiln::linear_f32 / kiln::linear_i8
// with TORCH_LIBRARY_FRAGMENT; fake (meta) impls are registered from Python.
//
// One file, two translation units compiled in parallel (see gemv_kernel.py):
//   -DKILN_GEMV_KERNELS : the SIMD kernels, no torch headers (fast to compile);
//   (default)           : threading, dispatch and op registration against libtorch.
#include <cstdint>

extern "C" {
// y[0:M, c0:c1] = init_row (or 0) + x[0:M, k0:k1] @ Wt[k0:k1, c0:c1]; M <= 8; ld* in elements.
void kiln_gemv_panel_f32(const float* x, int64_t ldx, int64_t M, const float* Wt, int64_t N, int64_t k0,
                         int64_t k1, int64_t c0, int64_t c1, float* y, int64_t ldy, const float* init_row);
void kiln_gemv_panel_i8(const float* x, int64_t ldx, int64_t M, const int8_t* Wt, int64_t N, int64_t k0,
                        int64_t k1, int64_t c0, int64_t c1, float* y, int64_t ldy, const float* init_row);
// Whether M > 8 runs the AVX-512 kernel (where the CPU has it; the default) or the AVX2 one.
// Returns the kernel now in use: true for AVX-512.
bool kiln_gemv_use_avx512(bool wanted);
// y[0:M, columns of panels p0..p1) = bias (or 0) + x @ Wt over panel-major weights (gemv_panels.h);
// x's rows ldx apart.
void kiln_gemv_panels_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panels, int64_t N, int64_t width,
                          int64_t p0, int64_t p1, const float* bias, float* y, int64_t ldy);
}

#ifdef KILN_GEMV_KERNELS
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace kiln_gemv {

static inline __m256i tail_mask(int64_t n) {  // n in [0, 8]
  alignas(32) static const int32_t m[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8 - n));
}

// Weight element loaders: 8 consecutive weights -> 8 floats.
struct LoadF32 {
  using T = float;
  static inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static inline __m256 load_tail(const float* p, int64_t n) {
    return _mm256_maskload_ps(p, tail_mask(n));
  }
};
struct LoadI8 {
  using T = int8_t;
  static inline __m256 load(const int8_t* p) {
    __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  }
  static inline __m256 load_tail(const int8_t* p, int64_t n) {
    alignas(16) int8_t buf[16] = {0};
    std::memcpy(buf, p, n);
    return load(buf);
  }
};

// Accumulator start values for one 8-column vector of row m: zero, bias (init_row, lds = 0)
// or the running partial sum in y.
struct Src {
  const float* p;  // nullptr: zeros
  int64_t ld;
  inline __m256 get(int m, int64_t c) const {
    return p ? _mm256_loadu_ps(p + m * ld + c) : _mm256_setzero_ps();
  }
  inline __m256 get_tail(int m, int64_t c, __m256i msk) const {
    return p ? _mm256_maskload_ps(p + m * ld + c, msk) : _mm256_setzero_ps();
  }
};

// Software prefetch: each weight stream asks for the line kPrefetchBytes ahead of the one it
// reads. With 8 concurrent streams per thread this lifts a decode's weight streaming from ~22 to
// ~29-33 GB/s here (2 threads): the hardware prefetcher alone ramps up too slowly.
constexpr int64_t kPrefetchBytes = 1024;

template <class T>
static inline void prefetch_row(const T* w, int64_t c) {
  _mm_prefetch(reinterpret_cast<const char*>(w + c) + kPrefetchBytes, _MM_HINT_T0);
}

// Concurrent weight streams per thread: [k0, k1) is cut into kSlabs equal slabs read side by side
// (panel below, and panel_many in gemv_many_rows.h). It also fixes the order every output element
// is summed in, the same for any number of rows of x: see `panel`.
constexpr int kSlabs = 16;

// True once per cache line of weights (16 fp32 / 64 int8 columns), for the 16-column steps.
template <class T>
static inline bool line_start(int64_t c, int64_t c0) {
  return (((c - c0) * (int64_t)sizeof(T)) & 63) == 0;
}

// One 16-column tile, rows [m0, m0+MB) of x, RN weight rows w + r * rs (r < RN).
// xk: x values for this step, x(m, row r) at xk[r * xrs + m].
template <class L, int MB, int RN, bool Prefetch>
static inline void tile16(const float* xk, int64_t xrs, const typename L::T* w, int64_t rs, int64_t c,
                          bool at_line, float* y, int64_t ldy, const Src& src) {
  __m256 a[MB][2];
  for (int m = 0; m < MB; m++) {
    a[m][0] = src.get(m, c);
    a[m][1] = src.get(m, c + 8);
  }
  for (int r = 0; r < RN; r++) {
    if (Prefetch && at_line) prefetch_row(w + r * rs, c);
    const __m256 w0 = L::load(w + r * rs + c), w1 = L::load(w + r * rs + c + 8);
    for (int m = 0; m < MB; m++) {
      const __m256 b = _mm256_broadcast_ss(xk + r * xrs + m);
      a[m][0] = _mm256_fmadd_ps(w0, b, a[m][0]);
      a[m][1] = _mm256_fmadd_ps(w1, b, a[m][1]);
    }
  }
  for (int m = 0; m < MB; m++) {
    _mm256_storeu_ps(y + m * ldy + c, a[m][0]);
    _mm256_storeu_ps(y + m * ldy + c + 8, a[m][1]);
  }
}

// Columns [c, c+n), n <= 8 (masked when n < 8).
template <class L, int MB, int RN>
static inline void tile_tail(const float* xk, int64_t xrs, const typename L::T* w, int64_t rs, int64_t c,
                             int64_t n, float* y, int64_t ldy, const Src& src) {
  const __m256i msk = tail_mask(n);
  __m256 a[MB];
  for (int m = 0; m < MB; m++) a[m] = src.get_tail(m, c, msk);
  for (int r = 0; r < RN; r++) {
    const __m256 w0 = n == 8 ? L::load(w + r * rs + c) : L::load_tail(w + r * rs + c, n);
    for (int m = 0; m < MB; m++) a[m] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xk + r * xrs + m), a[m]);
  }
  for (int m = 0; m < MB; m++) _mm256_maskstore_ps(y + m * ldy + c, msk, a[m]);
}

// M = 1: y[c0:c1] = src + sum_{r < RN} x[r] * w[r, c0:c1], broadcasts hoisted (RN + 4 registers).
template <class L, int RN>
static void step_m1(const float* xk, int64_t xrs, const typename L::T* w, int64_t rs, int64_t c0, int64_t c1,
                    float* y, const Src& src) {
  using T = typename L::T;
  __m256 xv[RN];
  for (int r = 0; r < RN; r++) xv[r] = _mm256_broadcast_ss(xk + r * xrs);
  int64_t c = c0;
  for (; c + 16 <= c1; c += 16) {
    const bool at_line = line_start<T>(c, c0);
    __m256 a0 = src.get(0, c), a1 = src.get(0, c + 8);
    for (int r = 0; r < RN; r++) {
      if (at_line) prefetch_row(w + r * rs, c);
      a0 = _mm256_fmadd_ps(L::load(w + r * rs + c), xv[r], a0);
      a1 = _mm256_fmadd_ps(L::load(w + r * rs + c + 8), xv[r], a1);
    }
    _mm256_storeu_ps(y + c, a0);
    _mm256_storeu_ps(y + c + 8, a1);
  }
  for (; c < c1; c += 8)
    tile_tail<L, 1, RN>(xk, xrs, w, rs, c, std::min<int64_t>(8, c1 - c), y, 0, src);
}

// M in [2, 8]: rows of x in one chunk (M <= 6: 2*M accumulators) or two (4 + rest); the
// second chunk re-reads the 16-column weight tile from L1, never from memory.
template <class L, int M, int RN>
static void step_mm(const float* xk, int64_t xrs, const typename L::T* w, int64_t rs, int64_t c0, int64_t c1,
                    float* y, int64_t ldy, const Src& src) {
  using T = typename L::T;
  constexpr int M0 = M <= 6 ? M : 4, M1 = M - M0;
  const Src src1{src.p ? src.p + M0 * src.ld : nullptr, src.ld};
  int64_t c = c0;
  for (; c + 16 <= c1; c += 16) {
    const bool at_line = line_start<T>(c, c0);
    tile16<L, M0, RN, true>(xk, xrs, w, rs, c, at_line, y, ldy, src);
    if constexpr (M1 > 0) tile16<L, M1, RN, false>(xk + M0, xrs, w, rs, c, false, y + M0 * ldy, ldy, src1);
  }
  for (; c < c1; c += 8) {
    const int64_t n = std::min<int64_t>(8, c1 - c);
    tile_tail<L, M0, RN>(xk, xrs, w, rs, c, n, y, ldy, src);
    if constexpr (M1 > 0) tile_tail<L, M1, RN>(xk + M0, xrs, w, rs, c, n, y + M0 * ldy, ldy, src1);
  }
}

// y[0:M, c0:c1] = init_row (or 0) + sum_{k in [k0,k1)} x[0:M, k] * Wt[k, c0:c1].
// The rows [k0, k1) are cut into R equal slabs, read side by side: step j takes row j of every
// slab, so R streams each run front to back through one contiguous slab (long runs that the
// prefetchers keep ahead of) instead of R short rows restarting every group. The few rows left
// over (fewer than R) follow one at a time.
// Batch-invariant: each output element is one accumulator starting at init_row (or 0) that takes
// one FMA per k in that order (step by step, slab by slab, then the left-over rows), whatever M;
// panel_many (M > 8) adds in the same order, so a row of x gets the same bits alone or beside
// others (a request decodes the same tokens alone or batched, with an int8 KV cache too).
template <class L, int M>
static void panel(const float* x, int64_t ldx, const typename L::T* Wt, int64_t N, int64_t k0, int64_t k1,
                  int64_t c0, int64_t c1, float* y, int64_t ldy, const float* init_row) {
  constexpr int R = kSlabs;  // 16, as panel_many needs (8 and 16 stream as fast at M = 1)
  // A step of 16 slabs runs as two steps of 8 over the columns, adding in the same order (slabs
  // 0-7 then 8-15 into each element) at the cost of a second pass over y: M = 1 keeps a step's x
  // values in registers, which hold 8 beside the accumulators and loads (AVX2 has 16), and 2-6
  // rows of x stream 8 slabs at a time faster than 16 (AMD EPYC, bench/many_rows_probe.py, medians
  // of 3 runs: 21.8 against 24.7 ms at 2 rows, 24.4 against 30.3 at 3, 24.9 against 31.3 at 4).
  constexpr int kHoisted = 8;
  Src src{init_row, 0};
  if (k0 == k1) {
    for (int m = 0; m < M; m++)
      for (int64_t c = c0; c < c1; c++) y[m * ldy + c] = init_row ? init_row[c] : 0.f;
    return;
  }
  const float* xs = x + k0;  // M = 1: x itself, stride 1 per k
  std::unique_ptr<float[]> xt;
  if constexpr (M > 1) {  // x transposed to [k][8]: every broadcast is base + constant offset
    xt.reset(new float[(k1 - k0) * 8]);
    for (int64_t k = k0; k < k1; k++)
      for (int m = 0; m < M; m++) xt[(k - k0) * 8 + m] = x[m * ldx + k];
    xs = xt.get();
  }
  constexpr int XS = M == 1 ? 1 : 8;
  auto step = [&](auto rr, int64_t k, int64_t slab_rows) {
    constexpr int RN = decltype(rr)::value;
    const float* xk = xs + (k - k0) * XS;
    const typename L::T* w = Wt + k * N;
    if constexpr (M == 1 && RN > kHoisted) {  // halves, in order: each hoists its broadcasts
      for (int h = 0; h < RN; h += kHoisted) {
        step_m1<L, kHoisted>(xk + h * slab_rows, slab_rows, w + h * slab_rows * N, slab_rows * N, c0, c1, y, src);
        src = Src{y, ldy};
      }
    } else if constexpr (M == 1) {
      step_m1<L, RN>(xk, slab_rows * XS, w, slab_rows * N, c0, c1, y, src);
    } else if constexpr (RN > kHoisted) {  // halves too: 8 streams at a time stream faster
      for (int h = 0; h < RN; h += kHoisted) {
        step_mm<L, M, kHoisted>(xk + h * slab_rows * XS, slab_rows * XS, w + h * slab_rows * N, slab_rows * N, c0,
                                c1, y, ldy, src);
        src = Src{y, ldy};
      }
    } else {
      step_mm<L, M, RN>(xk, slab_rows * XS, w, slab_rows * N, c0, c1, y, ldy, src);
    }
    src = Src{y, ldy};
  };
  const int64_t slab = (k1 - k0) / R;
  for (int64_t j = 0; j < slab; j++) step(std::integral_constant<int, R>{}, k0 + j, slab);
  for (int64_t k = k0 + R * slab; k < k1; k++) step(std::integral_constant<int, 1>{}, k, 0);
}

#include "gemv_many_rows.h"
#include "gemv_panels.h"

template <class L>
static void panel_m(const float* x, int64_t ldx, int64_t M, const typename L::T* Wt, int64_t N,
                    int64_t k0, int64_t k1, int64_t c0, int64_t c1, float* y, int64_t ldy,
                    const float* init_row) {
  if (M >= many_rows_from<typename L::T>()) return panel_many<L>(x, ldx, M, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
  switch (M) {
    case 1: return panel<L, 1>(x, ldx, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
    case 2: return panel<L, 2>(x, ldx, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
    case 3: return panel<L, 3>(x, ldx, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
    case 4: return panel<L, 4>(x, ldx, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
    case 5: return panel<L, 5>(x, ldx, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
    case 6: return panel<L, 6>(x, ldx, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
    case 7: return panel<L, 7>(x, ldx, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
    case 8: return panel<L, 8>(x, ldx, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
    default:
      return panel_many<L>(x, ldx, M, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
  }
}

}  // namespace kiln_gemv

extern "C" {
void kiln_gemv_panel_f32(const float* x, int64_t ldx, int64_t M, const float* Wt, int64_t N, int64_t k0,
                         int64_t k1, int64_t c0, int64_t c1, float* y, int64_t ldy, const float* init_row) {
  kiln_gemv::panel_m<kiln_gemv::LoadF32>(x, ldx, M, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
}
void kiln_gemv_panel_i8(const float* x, int64_t ldx, int64_t M, const int8_t* Wt, int64_t N, int64_t k0,
                        int64_t k1, int64_t c0, int64_t c1, float* y, int64_t ldy, const float* init_row) {
  kiln_gemv::panel_m<kiln_gemv::LoadI8>(x, ldx, M, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
}
void kiln_gemv_panels_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panels, int64_t N,
                          int64_t width, int64_t p0, int64_t p1, const float* bias, float* y, int64_t ldy) {
  kiln_gemv::panels_f32(x, ldx, M, K, panels, N, width, p0, p1, bias, y, ldy);
}
bool kiln_gemv_use_avx512(bool wanted) {
  kiln_gemv::use_avx512 = wanted && __builtin_cpu_supports("avx512f");
  return kiln_gemv::use_avx512;
}
}

#else  // ---------------------------------------------------------------- torch binding TU

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/addmm.h>
#include <c10/util/Exception.h>
#include <algorithm>
#include <vector>

namespace kiln_gemv {

constexpr int64_t kSmallM = 128;          // M above this (prefill) goes to MKL (fp32) / dequant + MKL (int8)
constexpr int64_t kMinBytesPerThread = 96 * 1024;  // below this, one thread is faster

template <class T> struct Panel;
template <> struct Panel<float> {
  static void run(const float* x, int64_t ldx, int64_t M, const float* Wt, int64_t N, int64_t k0, int64_t k1,
                  int64_t c0, int64_t c1, float* y, int64_t ldy, const float* init_row) {
    kiln_gemv_panel_f32(x, ldx, M, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
  }
};
template <> struct Panel<int8_t> {
  static void run(const float* x, int64_t ldx, int64_t M, const int8_t* Wt, int64_t N, int64_t k0, int64_t k1,
                  int64_t c0, int64_t c1, float* y, int64_t ldy, const float* init_row) {
    kiln_gemv_panel_i8(x, ldx, M, Wt, N, k0, k1, c0, c1, y, ldy, init_row);
  }
};

// y[M,N] = x[M,K] @ Wt[K,N] (* scale) (+ bias). Threads split K (each streams one contiguous
// slab of Wt; partial sums reduced at the end) or, for very wide N, split N.
template <class T>
static void small_m_linear(const float* x, int64_t M, int64_t K, const T* Wt, int64_t N,
                           const float* scale, const float* bias, float* y) {
  const int64_t bytes = K * N * (int64_t)sizeof(T);
  int64_t nt = std::min<int64_t>({(int64_t)at::get_num_threads(), bytes / kMinBytesPerThread, K});
  if (nt < 1 || at::in_parallel_region()) nt = 1;
  // Scale is applied after accumulation, so the bias cannot ride along in the accumulator.
  const float* init_row = scale ? nullptr : bias;
  auto finish = [&](int64_t c0, int64_t c1) {
    if (!scale) return;
    for (int64_t m = 0; m < M; m++) {
      float* ym = y + m * N;
      for (int64_t c = c0; c < c1; c++) ym[c] = ym[c] * scale[c] + (bias ? bias[c] : 0.f);
    }
  };
  if (nt == 1) {
    Panel<T>::run(x, K, M, Wt, N, 0, K, 0, N, y, N, init_row);
    finish(0, N);
    return;
  }
  if (N / nt >= 4096) {  // wide output (lm_head): split columns, runs of >= 16 KB per row
    const int64_t cols = (N / nt + 15) / 16 * 16;
    at::parallel_for(0, nt, 1, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; t++) {
        int64_t c0 = std::min(N, t * cols), c1 = std::min(N, (t + 1) * cols);
        if (c0 < c1) {
          Panel<T>::run(x, K, M, Wt, N, 0, K, c0, c1, y, N, init_row);
          finish(c0, c1);
        }
      }
    });
    return;
  }
  // Partial sums of threads 1.. (fully overwritten), kept per calling thread: a decode step makes
  // ~120 of these calls and allocations were a good part of a small call's cost.
  thread_local std::vector<float> part_buffer;
  part_buffer.resize((size_t)(nt - 1) * M * N);
  float* part = part_buffer.data();  // a lambda naming the thread_local would get each worker's own
  at::parallel_for(0, nt, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; t++) {
      int64_t k0 = K * t / nt, k1 = K * (t + 1) / nt;
      float* yt = t == 0 ? y : part + (size_t)(t - 1) * M * N;
      Panel<T>::run(x, K, M, Wt, N, k0, k1, 0, N, yt, N, t == 0 ? init_row : nullptr);
    }
  });
  const int64_t total = M * N;
  auto reduce = [&](int64_t i0, int64_t i1) {
    for (int64_t t = 1; t < nt; t++) {
      const float* p = part + (size_t)(t - 1) * total;
      for (int64_t i = i0; i < i1; i++) y[i] += p[i];
    }
  };
  if (total >= 16384) at::parallel_for(0, total, 8192, reduce);
  else reduce(0, total);
  if (scale) {
    if (M * N >= 16384) at::parallel_for(0, N, 4096, finish);
    else finish(0, N);
  }
}

static std::vector<int64_t> out_shape(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = N;
  return s;
}

static void check_common(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                         const char* op) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dim");
  TORCH_CHECK(w.dim() == 2, op, ": packed weight must be 2-D [K, N] (use pack_linear_weight)");
  TORCH_CHECK(x.size(-1) == w.size(0), op, ": x has K=", x.size(-1), " but packed weight has K=",
              w.size(0), " (packed weights are [K, N] = W.t())");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == w.size(1),
                op, ": bias must be float32 [N]");
  }
}

// The fp32 packed weight is [K, N] in one of two memory layouts (pack_linear_weight picks):
//  "kn": contiguous [K, N] -> this file's GEMV kernel for M <= kSmallM, MKL GEMM above;
//  "nk": W [N, K] contiguous, seen through .t() (strides (1, K)) -> MKL for every M (its
//        row-dot GEMV streams long rows of W well when K >= N).
at::Tensor linear_f32(const at::Tensor& x_in, const at::Tensor& wt, const std::optional<at::Tensor>& bias_in) {
  check_common(x_in, wt, bias_in, "kiln::linear_f32");
  TORCH_CHECK(wt.scalar_type() == at::kFloat, "kiln::linear_f32: packed weight must be float32");
  const int64_t K = wt.size(0), N = wt.size(1);
  const bool kn = wt.is_contiguous();
  const bool nk = wt.stride(0) == 1 && wt.stride(1) == std::max<int64_t>(K, 1);
  TORCH_CHECK(kn || nk, "kiln::linear_f32: packed weight must be contiguous [K, N] or W.t() of a "
              "contiguous [N, K] W (use pack_linear_weight); got strides ", wt.strides());
  const at::Tensor x = x_in.contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  if (!kn || M > kSmallM) {
    at::Tensor x2 = x.view({-1, K});
    at::Tensor y = bias_in ? at::addmm(*bias_in, x2, wt) : at::mm(x2, wt);
    return y.view(out_shape(x_in, N));
  }
  at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  at::Tensor y = at::empty(out_shape(x_in, N), x.options());
  if (M > 0 && N > 0)
    small_m_linear<float>(x.data_ptr<float>(), M, K, wt.data_ptr<float>(), N, nullptr,
                          bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

// The fp32 weight in panels (gemv_panels.h): [K, N] cut into panels of `width` columns, each
// stored [K, width] (the last one narrower), panel after panel. Every M runs the panel kernel
// (M > kSmallM too: it multiplies as fast as MKL's GEMM there), threads taking whole panels.
at::Tensor linear_f32_panels(const at::Tensor& x_in, const at::Tensor& panels, int64_t width,
                             const std::optional<at::Tensor>& bias_in) {
  check_common(x_in, panels, bias_in, "kiln::linear_f32_panels");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.is_contiguous(),
              "kiln::linear_f32_panels: panels must be a contiguous float32 [K, N] (use pack_linear_weight(w, 'panels'))");
  TORCH_CHECK(width == 32 || width == 64, "kiln::linear_f32_panels: panel width must be 32 or 64, got ", width);
  const int64_t K = panels.size(0), N = panels.size(1);
  const at::Tensor x = x_in.contiguous();
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); d++) M *= x.size(d);
  at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  at::Tensor y = at::empty(out_shape(x_in, N), x.options());
  if (M == 0 || N == 0) return y;
  const int64_t np = (N + width - 1) / width, bytes = K * N * (int64_t)sizeof(float);
  int64_t nt = std::min<int64_t>({(int64_t)at::get_num_threads(), std::max<int64_t>(bytes / kMinBytesPerThread, 1), np});
  if (nt < 1 || at::in_parallel_region()) nt = 1;
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, nt, 1, [&](int64_t a, int64_t e) {
    for (int64_t t = a; t < e; t++)
      kiln_gemv_panels_f32(x.data_ptr<float>(), K, M, K, panels.data_ptr<float>(), N, width, np * t / nt,
                           np * (t + 1) / nt, b, y.data_ptr<float>(), N);
  });
  return y;
}

at::Tensor linear_i8(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& scales_in,
                     const std::optional<at::Tensor>& bias_in) {
  check_common(x_in, wq, bias_in, "kiln::linear_i8");
  TORCH_CHECK(wq.scalar_type() == at::kChar, "kiln::linear_i8: packed weight must be int8");
  TORCH_CHECK(wq.is_contiguous(), "kiln::linear_i8: packed weight must be a contiguous int8 [K, N] "
              "(use pack_linear_weight_int8)");
  const int64_t K = wq.size(0), N = wq.size(1);
  TORCH_CHECK(scales_in.scalar_type() == at::kFloat && scales_in.numel() == N,
              "kiln::linear_i8: scales must be float32 [N]");
  const at::Tensor x = x_in.contiguous();
  at::Tensor scales = scales_in.contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  if (M > kSmallM) {  // prefill: dequantize once, run the GEMM in MKL
    at::Tensor w = wq.to(at::kFloat).mul_(scales.view({1, N}));
    at::Tensor x2 = x.view({-1, K});
    at::Tensor y = bias_in ? at::addmm(*bias_in, x2, w) : at::mm(x2, w);
    return y.view(out_shape(x_in, N));
  }
  at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  at::Tensor y = at::empty(out_shape(x_in, N), x.options());
  if (M > 0 && N > 0)
    small_m_linear<int8_t>(x.data_ptr<float>(), M, K, wq.data_ptr<int8_t>(), N, scales.data_ptr<float>(),
                           bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

}  // namespace kiln_gemv

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("gemv_use_avx512(bool wanted) -> bool", [](bool wanted) { return kiln_gemv_use_avx512(wanted); });
  m.def("linear_f32(Tensor x, Tensor packed_weight, Tensor? bias=None) -> Tensor");
  m.def("linear_i8(Tensor x, Tensor packed_weight, Tensor scales, Tensor? bias=None) -> Tensor");
  m.def("linear_f32_panels(Tensor x, Tensor panels, int width, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_f32", &kiln_gemv::linear_f32);
  m.impl("linear_i8", &kiln_gemv::linear_i8);
  m.impl("linear_f32_panels", &kiln_gemv::linear_f32_panels);
}

#endif  // KILN_GEMV_KERNELS
