// Kiln CPU kernel for int8 weight-only linears with int8 activations (llama.cpp's Q8_0 x Q8_0):
// integer dot products instead of widening every weight to f32, so that a step over several
// tokens (speculative verification, batched decode) stays near the cost of one.
//
// Packed weight (int8_kernel.py's pack_int8_weight, made once at load): u8 [P, K/4, 64], P =
// ceil(N / 16) panels of 16 output channels; panel p, step s holds channels 16p..16p+15, each as 4
// K-consecutive bytes w[n, 4s..4s+3] + 128 (channels past N: zero weights). One 64-byte line is
// one 512-bit `vpdpbusd` operand (u8 weight x s8 x, 4 products summed per int32 lane = one
// channel) or two 256-bit halves. Per-output-channel f32 scales [N] are applied at the end.
//
// Activations: each row of x is rounded to int8 per block of 32 along K (scale = max|x| / 127, as
// llama.cpp's Q8_0 and ONNX Runtime's accuracy_level 4). A block's int32 dot is exact; it is
// converted and multiplied by the block's x scale into f32 lane sums. VNNI (AVX-512) starts each
// block's int32 sums at -128 * (the block's rounded x summed), which cancels the +128 of the
// weights. AVX2 has no u8 x s8 -> int32 instruction: `maddubs` wants one unsigned operand and
// saturates int16 pairs, so it takes |x| (u8) times the weight carrying x's sign (`sign_epi8`; the
// +128 removed by one xor per weight vector, shared by all rows of x): 2 * 127 * 127 < 32767.
//
// Blocking: R panels x C rows of x per register block; a panel group's weights stream from
// memory once (prefetched 1 KB ahead in each panel's stream) for the first C rows, later row
// groups re-read them from L1 (a panel is K * 16 bytes: 9 KB at K = 576). Threads split the panels.
// Needs K % 32 == 0. AVX2 + FMA is the baseline; AVX-512 VNNI is chosen at run time where the CPU
// has it (kiln::linear_q8_use_vnni(False) forces AVX2, for tests). Measured on SmolLM2's int8
// linears (2 threads): VNNI M=1 as fast as linear_i8's f32 FMAs, M=8 1.9x faster; the AVX2 path
// is 1.1-1.3x slower than linear_i8 up to M=8 (five ops per 32 products) and faster from M=16.
//
// Two translation units, as gemv_kernel.cpp: -DKILN_INT8_KERNELS compiles the SIMD code without
// torch headers; the default compiles the op against libtorch.
#include <cstdint>

extern "C" {
// Rows of x rounded for the kernel; row m of each array at m * K (q, magnitude) or m * K / 32.
struct KilnQ8Rows {
  const int8_t* q;           // x rounded to int8
  const uint8_t* magnitude;  // |q| (AVX2's unsigned operand)
  const float* scale;        // per block of 32: max|x| / 127
  const int32_t* offset;     // per block: -128 * sum(q) (VNNI: cancels the weights' +128)
  int64_t K;
};
// Rounds rows [m0, m1) of x [M, K] into the buffers of `rows` (cast away const: they are ours).
void kiln_q8_prepare_rows(const float* x, int64_t m0, int64_t m1, const KilnQ8Rows* rows);
// y[m, n] = sum_k x[m, k] w[n, k] * scales[n] + bias[n] for panels [p0, p1) and rows [0, M).
void kiln_q8_panels(const KilnQ8Rows* rows, int64_t M, const uint8_t* packed, const float* scales, const float* bias,
                    int64_t N, int64_t p0, int64_t p1, float* y);
// Rows [n0, n1) of the f32 weight [N, K] (prefill's GEMM operand).
void kiln_q8_dequantize(const uint8_t* packed, const float* scales, int64_t K, int64_t n0, int64_t n1, float* w);
bool kiln_q8_use_vnni(bool wanted);
bool kiln_q8_cpu_has_vnni();
}

#ifdef KILN_INT8_KERNELS
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>

namespace kiln_q8 {

constexpr int kPanel = 16;            // output channels per panel
constexpr int kStepBytes = 64;        // one panel's bytes per 4 values of K
constexpr int kPrefetchBytes = 1024;  // ahead of each panel's stream
constexpr int kBlock = 32;            // values of x per scale
constexpr int kStepsPerBlock = kBlock / 4;

static bool cpu_has_vnni() {
  __builtin_cpu_init();  // static initializers may run before the CPU model is read
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
}
static bool use_vnni = cpu_has_vnni();

static inline int32_t four_bytes(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// ---- AVX2: |x| (u8) x (w with x's sign) by maddubs, pairs summed to int32 by madd ----

// sums[(r * C + c) * 16 + lane] = sum over K of panel r's channel `lane` times row c of x.
template <int R, int C>
static void dot_avx2(const KilnQ8Rows& x, int64_t m0, const uint8_t* w, int64_t panel_bytes, float* sums) {
  const int64_t K = x.K, blocks = K / kBlock;
  const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  __m256 total[R][2][C];
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++)
      for (int c = 0; c < C; c++) total[r][h][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    __m256i dot[R][2][C];
    for (int r = 0; r < R; r++)
      for (int h = 0; h < 2; h++)
        for (int c = 0; c < C; c++) dot[r][h][c] = _mm256_setzero_si256();
    for (int s = 0; s < kStepsPerBlock; s++) {
      const int64_t k = b * kBlock + s * 4, byte = k / 4 * kStepBytes;
      __m256i wv[R][2];
      for (int r = 0; r < R; r++) {
        const uint8_t* p = w + r * panel_bytes + byte;
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        for (int h = 0; h < 2; h++)  // back to signed: w + 128 xor 0x80 = w
          wv[r][h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h)), flip);
      }
      for (int c = 0; c < C; c++) {
        const __m256i xs = _mm256_set1_epi32(four_bytes(x.q + (m0 + c) * K + k));
        const __m256i xm = _mm256_set1_epi32(four_bytes(x.magnitude + (m0 + c) * K + k));
        for (int r = 0; r < R; r++)
          for (int h = 0; h < 2; h++) {
            const __m256i pairs = _mm256_maddubs_epi16(xm, _mm256_sign_epi8(wv[r][h], xs));
            dot[r][h][c] = _mm256_add_epi32(dot[r][h][c], _mm256_madd_epi16(pairs, ones));
          }
      }
    }
    for (int c = 0; c < C; c++) {
      const __m256 scale = _mm256_set1_ps(x.scale[(m0 + c) * blocks + b]);
      for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++)
          total[r][h][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h][c]), scale, total[r][h][c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++)
      for (int c = 0; c < C; c++) _mm256_storeu_ps(sums + (r * C + c) * kPanel + 8 * h, total[r][h][c]);
}

// ---- AVX-512 VNNI: one vpdpbusd per 64-byte step and row of x ----
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

template <int R, int C>
static void dot_vnni(const KilnQ8Rows& x, int64_t m0, const uint8_t* w, int64_t panel_bytes, float* sums) {
  const int64_t K = x.K, blocks = K / kBlock;
  __m512 total[R][C];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) total[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    __m512i dot[R][C];
    for (int c = 0; c < C; c++) {
      const __m512i start = _mm512_set1_epi32(x.offset[(m0 + c) * blocks + b]);
      for (int r = 0; r < R; r++) dot[r][c] = start;
    }
    for (int s = 0; s < kStepsPerBlock; s++) {
      const int64_t k = b * kBlock + s * 4, byte = k / 4 * kStepBytes;
      __m512i wv[R];
      for (int r = 0; r < R; r++) {
        const uint8_t* p = w + r * panel_bytes + byte;
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        wv[r] = _mm512_loadu_si512(p);
      }
      for (int c = 0; c < C; c++) {
        const __m512i xs = _mm512_set1_epi32(four_bytes(x.q + (m0 + c) * K + k));
        for (int r = 0; r < R; r++) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], wv[r], xs);
      }
    }
    for (int c = 0; c < C; c++) {
      const __m512 scale = _mm512_set1_ps(x.scale[(m0 + c) * blocks + b]);
      for (int r = 0; r < R; r++) total[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), scale, total[r][c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) _mm512_storeu_ps(sums + (r * C + c) * kPanel, total[r][c]);
}

#pragma GCC pop_options

// ---- Blocking: panels in groups of R, rows of x in groups of at most C ----

using DotFn = void (*)(const KilnQ8Rows&, int64_t, const uint8_t*, int64_t, float*);

template <int R, int C>
static DotFn dot_fn() {
  return use_vnni ? dot_vnni<R, C> : dot_avx2<R, C>;
}

// The kernel for R panels and c rows of x (1 <= c <= the ISA's largest C for that R).
template <int R>
static DotFn dot_for_rows(int c) {
  switch (c) {
    case 1: return dot_fn<R, 1>();
    case 2: return dot_fn<R, 2>();
    case 3: return dot_fn<R, 3>();
    case 4: return dot_fn<R, 4>();
    case 5: return dot_fn<R, 5>();
    default: return dot_fn<R, 6>();
  }
}

// Rows per register block: VNNI keeps R * C int32 and f32 accumulators in 32 zmm registers, AVX2
// 2 * R * C of each in 16 ymm.
static int max_rows(int R) { return use_vnni ? (R == 4 ? 1 : 6) : (R == 1 ? 2 : 1); }

// y rows [m0, m0 + C) and panels [p, p + R) from the lane sums: times the channel scales, plus bias.
static void store(const float* sums, int R, int C, int64_t m0, int64_t p, const float* scales, const float* bias,
                  int64_t N, float* y) {
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) {
      const float* s = sums + (r * C + c) * kPanel;
      float* out = y + (m0 + c) * N;
      const int64_t n0 = (p + r) * kPanel, n1 = std::min(N, n0 + kPanel);
      for (int64_t n = n0; n < n1; n++) out[n] = s[n - n0] * scales[n] + (bias ? bias[n] : 0.f);
    }
}

// Rows [0, M) in groups of nearly equal size (at most `most`), for R panels from p.
template <int R>
static void panel_group(const KilnQ8Rows& x, int64_t M, const uint8_t* packed, int64_t panel_bytes, int64_t p,
                        const float* scales, const float* bias, int64_t N, float* y) {
  const int most = max_rows(R);
  const int64_t groups = (M + most - 1) / most;
  alignas(64) float sums[R * 6 * kPanel];
  for (int64_t g = 0, m0 = 0; g < groups; g++) {
    const int c = (int)(M / groups + (g < M % groups ? 1 : 0));
    dot_for_rows<R>(c)(x, m0, packed + p * panel_bytes, panel_bytes, sums);
    store(sums, R, c, m0, p, scales, bias, N, y);
    m0 += c;
  }
}

}  // namespace kiln_q8

extern "C" {
void kiln_q8_prepare_rows(const float* x, int64_t m0, int64_t m1, const KilnQ8Rows* rows) {
  const int64_t K = rows->K, blocks = K / 32;
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t m = m0; m < m1; m++)
    for (int64_t b = 0; b < blocks; b++) {
      const float* src = x + m * K + b * 32;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
      }
      __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      a = _mm_max_ps(a, _mm_movehl_ps(a, a));
      const float block_max = _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
      const __m256 inverse = _mm256_set1_ps(block_max > 0.f ? 127.f / block_max : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // nearest, ties even
      const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(const_cast<int8_t*>(rows->q) + m * K + b * 32), bytes);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(const_cast<uint8_t*>(rows->magnitude) + m * K + b * 32),
                          _mm256_abs_epi8(bytes));
      const_cast<float*>(rows->scale)[m * blocks + b] = block_max / 127.f;
      const_cast<int32_t*>(rows->offset)[m * blocks + b] = -128 * _mm_cvtsi128_si32(s);
    }
}

void kiln_q8_panels(const KilnQ8Rows* rows, int64_t M, const uint8_t* packed, const float* scales, const float* bias,
                    int64_t N, int64_t p0, int64_t p1, float* y) {
  const int64_t panel_bytes = rows->K / 4 * kiln_q8::kStepBytes;
  int64_t p = p0;
  if (M == 1)  // four weight streams keep more reads in flight
    for (; p + 4 <= p1; p += 4) kiln_q8::panel_group<4>(*rows, M, packed, panel_bytes, p, scales, bias, N, y);
  for (; p + 2 <= p1; p += 2) kiln_q8::panel_group<2>(*rows, M, packed, panel_bytes, p, scales, bias, N, y);
  for (; p < p1; p++) kiln_q8::panel_group<1>(*rows, M, packed, panel_bytes, p, scales, bias, N, y);
}

void kiln_q8_dequantize(const uint8_t* packed, const float* scales, int64_t K, int64_t n0, int64_t n1, float* w) {
  const int64_t steps = K / 4;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* panel = packed + n / kiln_q8::kPanel * steps * kiln_q8::kStepBytes + n % kiln_q8::kPanel * 4;
    for (int64_t s = 0; s < steps; s++)
      for (int i = 0; i < 4; i++) w[n * K + 4 * s + i] = ((int)panel[s * kiln_q8::kStepBytes + i] - 128) * scales[n];
  }
}

bool kiln_q8_cpu_has_vnni() { return kiln_q8::cpu_has_vnni(); }

bool kiln_q8_use_vnni(bool wanted) {
  kiln_q8::use_vnni = wanted && kiln_q8::cpu_has_vnni();
  return kiln_q8::use_vnni;
}
}

#else  // ---------------------------------------------------------------- torch binding TU

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <algorithm>
#include <vector>

namespace kiln_q8 {

constexpr int64_t kPanel = 16;
constexpr int64_t kLargeM = 64;        // rows of x above this: dequantize once and run one GEMM (prefill)
constexpr int64_t kPanelsPerTask = 4;  // parallel grain (64 output channels)

static at::Tensor dequantize(const at::Tensor& packed, const at::Tensor& scales, int64_t N, int64_t K) {
  at::Tensor w = at::empty({N, K}, scales.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { kiln_q8_dequantize(pp, sp, K, n0, n1, wp); });
  return w;
}

at::Tensor linear_q8(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales_in,
                     const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "kiln::linear_q8: x must be CPU float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 64 && packed.is_contiguous(),
              "kiln::linear_q8: packed weight must be a contiguous uint8 [ceil(N/16), K/4, 64] "
              "(int8_kernel.pack_int8_weight)");
  const int64_t K = packed.size(1) * 4, N = scales_in.numel();
  TORCH_CHECK(K % 32 == 0, "kiln::linear_q8: K must be a multiple of 32 (x is rounded per block of 32), got K=", K);
  TORCH_CHECK(scales_in.scalar_type() == at::kFloat && packed.size(0) == (N + kPanel - 1) / kPanel,
              "kiln::linear_q8: scales must be float32 [N] with N matching the packed weight's ", packed.size(0),
              " panels of 16 channels");
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "kiln::linear_q8: x has K=", x_in.size(-1),
              ", the weight K=", K);
  const at::Tensor scales = scales_in.contiguous();
  at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == N),
              "kiln::linear_q8: bias must be float32 [N]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.numel() / K;
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  if (M > kLargeM) {
    at::Tensor w = dequantize(packed, scales, N, K);
    at::Tensor x2 = x.view({M, K});
    return (bias.defined() ? at::addmm(bias, x2, w.t()) : at::mm(x2, w.t())).view(shape);
  }
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0 || N == 0) return y;
  // x rounded once per call into per-thread scratch (a decode step makes ~120 of these calls)
  const int64_t blocks = K / 32;
  thread_local std::vector<int32_t> scratch;
  scratch.resize(M * (K / 2 + 2 * blocks));  // q and |q|: K bytes each = K/4 int32 each
  int8_t* q = reinterpret_cast<int8_t*>(scratch.data());
  uint8_t* magnitude = reinterpret_cast<uint8_t*>(q + M * K);
  float* block_scale = reinterpret_cast<float*>(scratch.data() + M * K / 2);
  int32_t* offset = scratch.data() + M * K / 2 + M * blocks;
  const KilnQ8Rows rows{q, magnitude, block_scale, offset, K};
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { kiln_q8_prepare_rows(xp, m0, m1, &rows); });
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, packed.size(0), kPanelsPerTask,
                   [&](int64_t p0, int64_t p1) { kiln_q8_panels(&rows, M, pp, sp, bp, N, p0, p1, yp); });
  return y;
}

}  // namespace kiln_q8

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("linear_q8_use_vnni(bool wanted) -> bool", [](bool wanted) { return kiln_q8_use_vnni(wanted); });
  m.def("linear_q8_cpu_has_vnni() -> bool", []() { return kiln_q8_cpu_has_vnni(); });
  m.def("linear_q8(Tensor x, Tensor packed, Tensor scales, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_q8", &kiln_q8::linear_q8); }

#endif  // KILN_INT8_KERNELS
