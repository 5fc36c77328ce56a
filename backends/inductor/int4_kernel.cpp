// Kiln CPU kernel for 4-bit weight-only linears (decode: M = 1..kSmallM rows of x).
//
// Weight layout = the IR's linear_q (ir/ops/quantized.py), read as is, no repacking:
//   qweight u8 [N, K/2]: row n holds w[n, 2j] in the low nibble of byte j and w[n, 2j+1] in the
//                        high nibble, values 0..15;
//   scales  f32 [N, G], zeros u8 [N, G] (or none: symmetric, z = 8), G = ceil(K / group_size);
//   w[n, k] = (q[n, k] - z[n, k / gs]) * scales[n, k / gs].
//
// Integer dot products: each row of x is rounded to int8 per block of 32 values (scale = max|x| /
// 127, as llama.cpp's Q8_0 and ONNX Runtime's MatMulNBits accuracy_level 4 do) and split into its
// even and odd elements, matching the low and high nibbles. 32 bytes of a weight row (64 weights)
// then take two `maddubs` (u8 weight x s8 x -> pairs summed in int16; at most 2 * 15 * 127, no
// saturation), one `madd` to int32 (lanes 0-3: the first 32 weights, 4-7: the next 32), one
// convert and one FMA by (x block scale * weight group scale). The zero points come in once per
// group through the sums of the rounded x. Float-FMA on unpacked nibbles ran at ~6.5 G weights/s
// per core here, this at several times that. Four weight rows share each x load; threads split
// N (at::parallel_for). Needs AVX2 + FMA; K % 64 == 0 and group_size % 32 == 0 (the op falls back
// to dequantize + GEMM otherwise, and for M > kSmallM).
//
// Two translation units, as gemv_kernel.cpp (see int4_kernel.py): -DKILN_INT4_KERNELS compiles
// the SIMD code without torch headers; the default compiles the op against libtorch.
#include <cstdint>

extern "C" {
// x rounded for the kernel: xe/xo int8 [K/2] (even/odd elements), block_scale f32 [K/32].
void kiln_q4_prepare_x(const float* x, int64_t K, int8_t* xe, int8_t* xo, float* block_scale);
// y[n] for n in [n0, n1) of one prepared row of x: sum over groups of the dequantized dot.
void kiln_q4_rows(const int8_t* xe, const int8_t* xo, const float* block_scale, const uint8_t* q,
                  const float* scales, const uint8_t* zeros, int64_t K, int64_t group_size, int64_t n0,
                  int64_t n1, const float* bias, float* y);
}

#ifdef KILN_INT4_KERNELS
#include <immintrin.h>
#include <algorithm>
#include <cmath>

namespace kiln_q4 {

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The per-lane factor of one 64-weight step: lanes 0-3 cover weights [0, 32), lanes 4-7 [32, 64).
static inline __m256 pair(float a, float b) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(a)), _mm_set1_ps(b), 1);
}

// acc[r] += the 64 weights at `byte` of row n0 + r times x, scaled per lane by x's block scales
// times the rows' group scales (ws[r]).
template <int R>
static inline void step(const int8_t* xe, const int8_t* xo, __m256 xs, const uint8_t* q, int64_t row_bytes,
                        int64_t n0, int64_t byte, const __m256* ws, __m256* acc) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xe + byte));
  const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xo + byte));
  for (int r = 0; r < R; r++) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (n0 + r) * row_bytes + byte));
    const __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, o));
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
    acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(xs, ws[r]), acc[r]);
  }
}

// y[n0 + r] for R rows. Groups of 32 pair up within a 64-weight step; larger groups (multiples of
// 64) span whole steps. group_sum: the rounded x summed per group.
template <int R>
static void rows_times_x(const int8_t* xe, const int8_t* xo, const float* block_scale, const float* group_sum,
                         const uint8_t* q, const float* scales, const uint8_t* zeros, int64_t K, int64_t gs,
                         int64_t n0, const float* bias, float* y) {
  const int64_t G = (K + gs - 1) / gs, row_bytes = K / 2;
  __m256 acc[R], ws[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  if (gs == 32) {
    for (int64_t byte = 0, g = 0; byte < row_bytes; byte += 32, g += 2) {
      for (int r = 0; r < R; r++) ws[r] = pair(scales[(n0 + r) * G + g], scales[(n0 + r) * G + g + 1]);
      step<R>(xe, xo, pair(block_scale[g], block_scale[g + 1]), q, row_bytes, n0, byte, ws, acc);
    }
  } else {
    for (int64_t g = 0; g < G; g++) {
      for (int r = 0; r < R; r++) ws[r] = _mm256_set1_ps(scales[(n0 + r) * G + g]);
      const int64_t end = std::min(row_bytes, (g + 1) * gs / 2);
      for (int64_t byte = g * gs / 2; byte < end; byte += 32)
        step<R>(xe, xo, pair(block_scale[byte / 16], block_scale[byte / 16 + 1]), q, row_bytes, n0, byte, ws, acc);
    }
  }
  for (int r = 0; r < R; r++) {
    const int64_t n = n0 + r;
    float zero_term = 0.f;  // sum_g s[n, g] * z[n, g] * (sum of the rounded x over group g)
    for (int64_t g = 0; g < G; g++)
      zero_term += scales[n * G + g] * (zeros ? (float)zeros[n * G + g] : 8.f) * group_sum[g];
    y[n] = hsum(acc[r]) - zero_term + (bias ? bias[n] : 0.f);
  }
}

}  // namespace kiln_q4

extern "C" {
void kiln_q4_prepare_x(const float* x, int64_t K, int8_t* xe, int8_t* xo, float* block_scale) {
  for (int64_t b = 0; b < K / 32; b++) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    block_scale[b] = scale;
    for (int i = 0; i < 32; i += 2) {
      xe[(b * 32 + i) / 2] = (int8_t)std::nearbyint(x[b * 32 + i] * inverse);
      xo[(b * 32 + i) / 2] = (int8_t)std::nearbyint(x[b * 32 + i + 1] * inverse);
    }
  }
}

void kiln_q4_rows(const int8_t* xe, const int8_t* xo, const float* block_scale, const uint8_t* q,
                  const float* scales, const uint8_t* zeros, int64_t K, int64_t group_size, int64_t n0,
                  int64_t n1, const float* bias, float* y) {
  const int64_t G = (K + group_size - 1) / group_size;
  float group_sum[G];  // the rounded x summed per group, in x's units
  for (int64_t g = 0; g < G; g++) {
    group_sum[g] = 0.f;
    for (int64_t b = g * group_size / 32; b < std::min(K, (g + 1) * group_size) / 32; b++) {
      int s = 0;
      for (int i = 0; i < 16; i++) s += xe[b * 16 + i] + xo[b * 16 + i];
      group_sum[g] += s * block_scale[b];
    }
  }
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4)
    kiln_q4::rows_times_x<4>(xe, xo, block_scale, group_sum, q, scales, zeros, K, group_size, n, bias, y);
  for (; n < n1; n++)
    kiln_q4::rows_times_x<1>(xe, xo, block_scale, group_sum, q, scales, zeros, K, group_size, n, bias, y);
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

constexpr int64_t kSmallM = 8;        // rows of x above this: dequantize once and run one GEMM (prefill)
constexpr int64_t kRowsPerTask = 64;  // rows of W per parallel task (64 x K/2 bytes)

// The f32 weight [N, K] (prefill): one GEMM beats re-reading the packed rows per row of x.
static at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros, int64_t K,
                             int64_t group_size) {
  const int64_t N = q.size(0);
  at::Tensor values = at::stack({q.bitwise_and(15), q.bitwise_right_shift(4)}, -1).view({N, K}).to(at::kFloat);
  auto per_column = [&](const at::Tensor& t) {
    return t.to(at::kFloat).repeat_interleave(group_size, 1).slice(1, 0, K);
  };
  at::Tensor centered = zeros.defined() ? values.sub_(per_column(zeros)) : values.sub_(8.0);
  return centered.mul_(per_column(scales));
}

at::Tensor linear_q4(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales_in,
                     const std::optional<at::Tensor>& zeros_in, const std::optional<at::Tensor>& bias_in,
                     int64_t group_size) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "kiln::linear_q4: x must be CPU float32");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous(),
              "kiln::linear_q4: qweight must be a contiguous uint8 [N, K/2]");
  const int64_t N = q.size(0), K = q.size(1) * 2, G = (K + group_size - 1) / group_size;
  TORCH_CHECK(K % 64 == 0 && group_size % 32 == 0, "kiln::linear_q4: K must be a multiple of 64 and group_size of 32, got K=",
              K, " group_size=", group_size);
  TORCH_CHECK(x_in.size(-1) == K, "kiln::linear_q4: x has K=", x_in.size(-1), ", the weight K=", K);
  at::Tensor scales = scales_in.contiguous();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N * G, "kiln::linear_q4: scales must be f32 [N, G]");
  at::Tensor zeros = zeros_in ? zeros_in->contiguous() : at::Tensor();
  TORCH_CHECK(!zeros.defined() || (zeros.scalar_type() == at::kByte && zeros.numel() == N * G),
              "kiln::linear_q4: zeros must be uint8 [N, G]");
  at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == N),
              "kiln::linear_q4: bias must be f32 [N]");
  at::Tensor x = x_in.contiguous().view({-1, K});
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  if (M > kSmallM) {
    at::Tensor w = dequantize(q, scales, zeros, K, group_size);
    return (bias.defined() ? at::addmm(bias, x, w.t()) : at::mm(x, w.t())).view(shape);
  }
  // x rounded to int8 per block of 32 (even/odd split), once per row per call.
  at::Tensor xe = at::empty({M, K / 2}, x.options().dtype(at::kChar)), xo = at::empty({M, K / 2}, xe.options());
  at::Tensor block_scale = at::empty({M, K / 32}, x.options());
  for (int64_t m = 0; m < M; m++)
    kiln_q4_prepare_x(x.data_ptr<float>() + m * K, K, xe.data_ptr<int8_t>() + m * K / 2,
                      xo.data_ptr<int8_t>() + m * K / 2, block_scale.data_ptr<float>() + m * K / 32);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* zp = zeros.defined() ? zeros.data_ptr<uint8_t>() : nullptr;
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, (N + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m = 0; m < M; m++)
      kiln_q4_rows(xe.data_ptr<int8_t>() + m * K / 2, xo.data_ptr<int8_t>() + m * K / 2,
                   block_scale.data_ptr<float>() + m * K / 32, q.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                   zp, K, group_size, t0 * kRowsPerTask, std::min(N, t1 * kRowsPerTask), bp,
                   y.data_ptr<float>() + m * N);
  });
  return y.view(shape);
}

}  // namespace kiln_q4

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("linear_q4(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_q4", &kiln_q4::linear_q4); }

#endif  // KILN_INT4_KERNELS
