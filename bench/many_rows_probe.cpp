// Probe of the many-row fp32 linears (gemv_kernel.cpp, gemv_many_rows.h) against variants of
// their memory layout and register tile, outside torch: SmolLM2-135M's 121 linears of a step
// (30 x qkv 576x960, o 576x576, gate_up 576x3072, down 1536x576, lm_head 576x49152; 538 MB fp32,
// each its own allocation), 2 threads splitting K (N for the lm_head) as small_m_linear does.
// Built and run by bench/many_rows_probe.py; usage: many_rows_probe M ROUNDS VARIANT... (M = 0: the
// FMA peak of 2 threads instead)
//   variants: kernel     the project's kernel (kiln_gemv_panel_f32; AVX-512: panel_blocks)
//             blocks     panel_blocks at any M (the kernel takes it from M = many_rows_from on)
//             slab-steps the kernel before panel_blocks: each step 16 rows of Wt (one per slab) x
//                        32 columns x up to 8 rows of x, y in and out of L2 every step
//             one-stream each thread's weight tiles copied in the order the kernel reads them
//                        (one sequential stream per thread instead of 16 slab streams)
//             tile48x8   48 columns x 8 rows of x per register tile (24 accumulators)
//             tile64x6   64 columns x 6 rows of x (24 accumulators)
//             panels     the panel kernel (gemv_panels.h, kiln_gemv_panels_f32) over its own
//                        panel-major copy, threads taking whole panels (the Inductor lowering's)
// Every variant but panels adds in the kernel's order; its outputs are checked against the
// kernel's bit for bit (panels adds in k order: checked to 1e-3 of it). Prints one line per variant: ms of the 121 linears with the weights streamed from
// memory ("cold"), with layer 0's weights again and again (14 MB, L3-resident, "l3"), and one
// core over one 288 x 576 slab (L2-resident, "l2"): medians over ROUNDS interleaved rounds.
#define KILN_GEMV_KERNELS
#include "../backends/inductor/gemv_kernel.cpp"

#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

using namespace kiln_gemv;

namespace probe {
#pragma GCC push_options
#pragma GCC target("avx512f")
// y[0:MB, 0:16*NV] += 16 weight rows (rs apart) times x, x(m, r) at xk[r * xrs + m].
template <int MB, int NV, bool Prefetch>
static inline void tile(const float* xk, int64_t xrs, const float* w, int64_t rs, float* y, int64_t ldy) {
  __m512 a[MB][NV];
  for (int m = 0; m < MB; m++)
    for (int v = 0; v < NV; v++) a[m][v] = _mm512_loadu_ps(y + m * ldy + 16 * v);
  const float* xr = xk;
#pragma GCC unroll 1
  for (int r = 0; r < kRowStep; r++, w += rs, xr += xrs) {
    __m512 wv[NV];
    for (int v = 0; v < NV; v++) wv[v] = _mm512_loadu_ps(w + 16 * v);
    if (Prefetch)
      for (int v = 0; v < NV; v++) _mm_prefetch(reinterpret_cast<const char*>(w + 16 * v) + kPrefetchBytes, _MM_HINT_T0);
    for (int m = 0; m < MB; m++) {
      const __m512 b = _mm512_set1_ps(xr[m]);
      for (int v = 0; v < NV; v++) a[m][v] = _mm512_fmadd_ps(wv[v], b, a[m][v]);
    }
  }
  for (int m = 0; m < MB; m++)
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(y + m * ldy + 16 * v, a[m][v]);
}

template <int NV, int MB>
static void tile_rows(const float* xk, int64_t xrs, const float* w, int64_t rs, float* y, int64_t ldy, int64_t M) {
  const int nb = (int)((M + MB - 1) / MB);
  for (int b = 0, m0 = 0; b < nb; b++) {
    const int mb = (int)(M / nb + (b < M % nb ? 1 : 0));
    switch (mb) {
#define ROWS(K)                                                                        \
  case K:                                                                              \
    if (b == 0) tile<K, NV, true>(xk + m0, xrs, w, rs, y + m0 * ldy, ldy);             \
    else tile<K, NV, false>(xk + m0, xrs, w, rs, y + m0 * ldy, ldy);                   \
    break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7)
#undef ROWS
      default: tile<MB, NV, true>(xk + m0, xrs, w, rs, y + m0 * ldy, ldy);
    }
    m0 += mb;
  }
}
#pragma GCC pop_options

static float* transposed_x(const float* x, int64_t ldx, int64_t M, int64_t k0, int64_t k1) {
  float* xt = new float[(k1 - k0) * M];
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = k0; k < k1; k++) xt[(k - k0) * M + m] = x[m * ldx + k];
  return xt;
}

// panel_many's walk with a wider register tile over the full tiles; the rest as the kernel does.
template <int NV, int MB>
static void panel_tiles(const float* x, int64_t ldx, int64_t M, const float* Wt, int64_t N, int64_t k0, int64_t k1,
                        int64_t c0, int64_t c1, float* y, int64_t ldy) {
  constexpr int TW = 16 * NV;
  for (int64_t m = 0; m < M; m++) std::fill(y + m * ldy + c0, y + m * ldy + c1, 0.f);
  std::unique_ptr<float[]> xt(transposed_x(x, ldx, M, k0, k1));
  const int nblocks = (int)((M + kMaxRowBlock512 - 1) / kMaxRowBlock512);
  int blocks[16];
  for (int b = 0; b < nblocks; b++) blocks[b] = (int)(M / nblocks + (b < M % nblocks ? 1 : 0));
  const int64_t width = std::max<int64_t>(96, kManyRowsYBytes / (M * 4) / 96 * 96);
  const int64_t slab = (k1 - k0) / kRowStep, left = (k1 - k0) - slab * kRowStep;
  for (int64_t cs = c0; cs < c1; cs += width) {
    const int64_t ce = std::min(c1, cs + width), full = cs + (ce - cs) / TW * TW;
    for (int64_t j = 0; j < slab; j++) {
      const float* xk = xt.get() + j * M;
      for (int64_t c = cs; c < full; c += TW) tile_rows<NV, MB>(xk, slab * M, Wt + (k0 + j) * N + c, slab * N, y + c, ldy, M);
      if (full < ce) many_rows_step512(xk, slab * M, blocks, nblocks, Wt + (k0 + j) * N, slab * N, kRowStep, full, ce, y, ldy);
    }
    if (left) {
      const int64_t k = k0 + slab * kRowStep;
      many_rows_step512(xt.get() + (k - k0) * M, M, blocks, nblocks, Wt + k * N, N, (int)left, cs, ce, y, ldy);
    }
  }
}

// The kernel's weight tiles (32 columns x the step's rows) copied in the order it reads them.
static std::vector<float> one_stream(const float* Wt, int64_t N, int64_t k0, int64_t k1, int64_t c0, int64_t c1,
                                     int64_t M) {
  std::vector<float> out;
  const int64_t width = std::max<int64_t>(64, kManyRowsYBytes / (M * 4) / 32 * 32);
  const int64_t slab = (k1 - k0) / kRowStep, left = (k1 - k0) - slab * kRowStep;
  auto step = [&](int64_t k, int64_t stride, int rn, int64_t cs, int64_t ce) {
    for (int64_t c = cs; c < ce; c += 32)
      for (int r = 0; r < rn; r++)
        for (int64_t j = 0; j < 32; j++) out.push_back(c + j < ce ? Wt[(k + r * stride) * N + c + j] : 0.f);
  };
  for (int64_t cs = c0; cs < c1; cs += width) {
    const int64_t ce = std::min(c1, cs + width);
    for (int64_t j = 0; j < slab; j++) step(k0 + j, slab, kRowStep, cs, ce);
    if (left) step(k0 + slab * kRowStep, 1, (int)left, cs, ce);
  }
  return out;
}

// The kernel's walk over one_stream's copy: tiles one after another, prefetched 4 KB ahead.
static void panel_one_stream(const float* x, int64_t ldx, int64_t M, const float* P, int64_t k0, int64_t k1,
                             int64_t c0, int64_t c1, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; m++) std::fill(y + m * ldy + c0, y + m * ldy + c1, 0.f);
  std::unique_ptr<float[]> xt(transposed_x(x, ldx, M, k0, k1));
  const int nblocks = (int)((M + kMaxRowBlock512 - 1) / kMaxRowBlock512);
  int blocks[16];
  for (int b = 0; b < nblocks; b++) blocks[b] = (int)(M / nblocks + (b < M % nblocks ? 1 : 0));
  const int64_t width = std::max<int64_t>(64, kManyRowsYBytes / (M * 4) / 32 * 32);
  const int64_t slab = (k1 - k0) / kRowStep, left = (k1 - k0) - slab * kRowStep;
  auto step = [&](int64_t k, int64_t stride, int rn, int64_t cs, int64_t ce) {
    for (int64_t c = cs; c < ce; c += 32, P += rn * 32) {
      for (int64_t d = 0; d < rn * 128; d += 64) _mm_prefetch(reinterpret_cast<const char*>(P) + 4096 + d, _MM_HINT_T0);
      const int64_t n = std::min<int64_t>(32, ce - c);
      const __mmask16 lo = (__mmask16)((1u << std::min<int64_t>(16, n)) - 1);
      const __mmask16 hi = (__mmask16)((1u << std::max<int64_t>(0, n - 16)) - 1);
      int64_t m0 = 0;
      for (int b = 0; b < nblocks; m0 += blocks[b], b++) {
        const float* xk = xt.get() + (k - k0) * M + m0;
        if (n == 32) block32_rows<false>(blocks[b], xk, stride * M, P, 32, rn, y + m0 * ldy + c, ldy, lo, hi);
        else block32_rows<true>(blocks[b], xk, stride * M, P, 32, rn, y + m0 * ldy + c, ldy, lo, hi);
      }
    }
  };
  for (int64_t cs = c0; cs < c1; cs += width) {
    const int64_t ce = std::min(c1, cs + width);
    for (int64_t j = 0; j < slab; j++) step(k0 + j, slab, kRowStep, cs, ce);
    if (left) step(k0 + slab * kRowStep, 1, (int)left, cs, ce);
  }
}
}  // namespace probe

struct Linear {
  int64_t K, N;
  float* w;
  int64_t k0[2], k1[2], c0[2], c1[2];  // each thread's rows and columns
  std::vector<float> copy[2];          // one_stream's copy, per thread
  std::vector<float> panels;           // the panel kernel's copy
  bool split_n() const { return c1[0] != N; }
};

// gemv_kernel.py's panel_width and pack_linear_weight(w, "panels").
static int64_t panel_width(int64_t n) { return n % 128 == 0 || n >= 2048 ? 64 : 32; }
static std::vector<float> panel_copy(const float* Wt, int64_t K, int64_t N) {
  std::vector<float> out;
  const int64_t width = panel_width(N);
  for (int64_t c = 0; c < N; c += width)
    for (int64_t k = 0; k < K; k++)
      for (int64_t j = c; j < std::min(N, c + width); j++) out.push_back(Wt[k * N + j]);
  return out;
}

static void run_one(const std::string& v, const Linear& L, int t, const float* x, int64_t M, float* y) {
  const int64_t K = L.K, N = L.N;
  if (v == "kernel") kiln_gemv_panel_f32(x, K, M, L.w, N, L.k0[t], L.k1[t], L.c0[t], L.c1[t], y, N, nullptr);
  else if (v == "one-stream") probe::panel_one_stream(x, K, M, L.copy[t].data(), L.k0[t], L.k1[t], L.c0[t], L.c1[t], y, N);
  else if (v == "tile48x8") probe::panel_tiles<3, 8>(x, K, M, L.w, N, L.k0[t], L.k1[t], L.c0[t], L.c1[t], y, N);
  else if (v == "blocks") {
    for (int64_t m = 0; m < M; m++) std::fill(y + m * N + L.c0[t], y + m * N + L.c1[t], 0.f);
    if (L.k0[t] < L.k1[t]) panel_blocks(x, K, M, L.w, N, L.k0[t], L.k1[t], L.c0[t], L.c1[t], y, N);
  } else if (v == "slab-steps") probe::panel_tiles<2, 8>(x, K, M, L.w, N, L.k0[t], L.k1[t], L.c0[t], L.c1[t], y, N);
  else if (v == "panels") {
    const int64_t width = panel_width(N), np = (N + width - 1) / width;
    kiln_gemv_panels_f32(x, K, M, K, L.panels.data(), N, width, np * t / 2, np * (t + 1) / 2, nullptr, y, N);
  } else if (v == "tile64x6") probe::panel_tiles<4, 6>(x, K, M, L.w, N, L.k0[t], L.k1[t], L.c0[t], L.c1[t], y, N);
  else { fprintf(stderr, "unknown variant %s\n", v.c_str()); exit(2); }
}

// The linears in order, each over 2 threads; threads' partial sums added as small_m_linear does.
static void run_all(const std::string& v, const std::vector<Linear*>& seq, const float* x, int64_t M, float* y,
                    float* part) {
  for (const Linear* L : seq) {
#pragma omp parallel num_threads(2)
    {
      const int t = omp_get_thread_num();
      run_one(v, *L, t, x, M, t == 0 || L->split_n() || v == "panels" ? y : part);
    }
    if (!L->split_n() && v != "panels")
      for (int64_t i = 0; i < M * L->N; i++) y[i] += part[i];
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f")
// The FMA peak: 16 independent chains of AVX-512 FMAs per thread, 2 threads.
static double peak_gflops() {
  const long iters = 20000000;
  float sink = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2) reduction(+ : sink)
  {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_set1_ps(i * 1e-3f);
    const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
    for (long it = 0; it < iters; it++)
      for (int i = 0; i < 16; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
    for (int i = 1; i < 16; i++) a[0] = _mm512_add_ps(a[0], a[i]);
    sink += _mm512_reduce_add_ps(a[0]);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sink == 12345.f ? 0 : 2.0 * iters * 16 * 16 * 2 / s / 1e9;
}
#pragma GCC pop_options

static double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char** argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s M ROUNDS VARIANT...\n", argv[0]); return 2; }
  const int64_t M = atoi(argv[1]);
  if (M == 0) {  // the FMA peak instead: best of ROUNDS
    double best = 0;
    for (int r = 0; r < atoi(argv[2]); r++) best = std::max(best, peak_gflops());
    printf("peak FMA, 2 threads: %.0f GFLOP/s\n", best);
    return 0;
  }
  const int rounds = atoi(argv[2]);
  std::vector<std::string> variants(argv + 3, argv + argc);
  const bool need_copy = std::find(variants.begin(), variants.end(), "one-stream") != variants.end();
  const bool need_panels = std::find(variants.begin(), variants.end(), "panels") != variants.end();
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int l = 0; l < 30; l++) shapes.insert(shapes.end(), {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}});
  shapes.push_back({576, 49152});
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 0.02f);
  std::vector<Linear> linears;
  double flops = 0, bytes = 0;
  for (auto [K, N] : shapes) {
    Linear L{K, N, static_cast<float*>(aligned_alloc(64, (K * N * 4 + 63) / 64 * 64))};
    for (int64_t i = 0; i < K * N; i++) L.w[i] = normal(rng);
    for (int t = 0; t < 2; t++) {
      const bool by_n = N / 2 >= 4096;  // small_m_linear's rule
      const int64_t cols = (N / 2 + 15) / 16 * 16;
      L.k0[t] = by_n ? 0 : K * t / 2, L.k1[t] = by_n ? K : K * (t + 1) / 2;
      L.c0[t] = by_n ? std::min(N, t * cols) : 0, L.c1[t] = by_n ? std::min(N, (t + 1) * cols) : N;
      if (need_copy) L.copy[t] = probe::one_stream(L.w, N, L.k0[t], L.k1[t], L.c0[t], L.c1[t], M);
    }
    if (need_panels) L.panels = panel_copy(L.w, K, N);
    flops += 2.0 * K * N * M, bytes += 4.0 * K * N;
    linears.push_back(std::move(L));
  }
  std::vector<float> x(M * 1536), y(M * 49152), part(M * 49152), want(M * 49152);
  for (float& v : x) v = normal(rng) * 50;
  std::vector<Linear*> all, l3;
  for (Linear& L : linears) all.push_back(&L);
  double l3_flops = 0;
  for (int i = 0; i < 120; i++) l3.push_back(&linears[i % 4]), l3_flops += 2.0 * linears[i % 4].K * linears[i % 4].N * M;
  for (int i : {0, 2, 3, 120}) {  // every variant adds in the kernel's order
    run_all("kernel", {&linears[i]}, x.data(), M, want.data(), part.data());
    for (const std::string& v : variants) {
      run_all(v, {&linears[i]}, x.data(), M, y.data(), part.data());
      const bool close = v == "panels" && std::equal(y.begin(), y.begin() + M * linears[i].N, want.begin(),
                                                     [](float a, float b) { return std::fabs(a - b) < 1e-3f; });
      if (!close && !std::equal(y.begin(), y.begin() + M * linears[i].N, want.begin())) {
        printf("MISMATCH %s on %ldx%ld\n", v.c_str(), linears[i].K, linears[i].N);
        return 1;
      }
    }
  }
  // One core, one thread's slab of the qkv weight (288 x 960 floats would spill L2 less than
  // gate_up; 288 x 576 = 0.66 MB), again and again.
  Linear& q = linears[1];
  const Linear slab{288, 576, q.w, {0, 0}, {288, 288}, {0, 0}, {576, 576}};
  std::vector<std::vector<double>> cold(variants.size()), hot(variants.size()), l2(variants.size());
  for (int r = 0; r < rounds; r++)
    for (size_t v = 0; v < variants.size(); v++) {
      auto t0 = std::chrono::steady_clock::now();
      run_all(variants[v], all, x.data(), M, y.data(), part.data());
      cold[v].push_back(ms_since(t0));
      t0 = std::chrono::steady_clock::now();
      run_all(variants[v], l3, x.data(), M, y.data(), part.data());
      hot[v].push_back(ms_since(t0));
      if (variants[v] == "one-stream" || variants[v] == "panels") { l2[v].push_back(0); continue; }
      t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 100; i++) run_one(variants[v], slab, 0, x.data(), M, y.data());
      l2[v].push_back(ms_since(t0) / 100);
    }
  auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  const double l2_flops = 2.0 * 288 * 576 * M;
  for (size_t v = 0; v < variants.size(); v++) {
    const double c = median(cold[v]), h = median(hot[v]), s = median(l2[v]);
    printf("%ld|%s|%.2f|%.0f|%.1f|%.2f|%.0f|%s\n", M, variants[v].c_str(), c, flops / c / 1e6, bytes / c / 1e6,
           h, l3_flops / h / 1e6, s > 0 ? std::to_string((int)(l2_flops / s / 1e6)).c_str() : "-");
  }
  return 0;
}
