// Kiln CPU kernel for 4-bit weight-only linears (decode, verification, batched decode, prefill
// chunks: M = 1..kSmallM = 128 rows of x, 2x the dequantize + GEMM it replaced at 96-128 rows).
// One row of x (decode) streams the weight rows as described below; 2..128 rows read the weight
// packed at lowering into panels of 16 rows (int4_panels.h, kiln::linear_q4_panels: one code
// vector holds a dword of every row of a panel) and run every row of x over each panel: each
// weight byte is read from memory once per call whatever M is. linear_q4 without the panels
// (the MoE experts' gathered_linear_q, packages compiled before them) stages each panel in L1
// per call instead (int4_many_rows.h: ~40 cycles per block of 32 weights and 16 rows).
//
// Weight layout = the IR's linear_q (ir/ops/quantized.py), read as is, no repacking:
//   qweight u8 [N, K/2]: row n holds w[n, 2j] in the low nibble of byte j and w[n, 2j+1] in the
//                        high nibble, values 0..15;
//   scales  f32 [N, G] (symmetric weights may also pass them as f16, `decode_scales`, which the
//           decode kernel then reads instead, as llama.cpp's Q4_0 stores them: 4.5 bits read per
//           weight instead of 5; prefill's dequantize keeps the f32 scales, the IR's exact values),
//   zeros u8 [N, G] (or none: symmetric, z = 8), G = ceil(K / group_size);
//   w[n, k] = (q[n, k] - z[n, k / gs]) * scales[n, k / gs].
//
// Integer dot products: each row of x is rounded to int8 per block of 32 values (scale = max|x| /
// 127, as llama.cpp's Q8_0 and ONNX Runtime's MatMulNBits accuracy_level 4 do) and split into its
// even and odd elements, matching the low and high nibbles. 32 bytes of a weight row (64 weights)
// then take two `maddubs` (u8 weight x s8 x -> pairs summed in int16; at most 2 * 15 * 127, no
// saturation) and one `madd` to int32 (lanes 0-3: the first 32 weights, 4-7: the next 32).
// Every M from 1 to kSmallM gives each row of x the same result bit for bit (batch invariance: a
// request decodes the same tokens alone and in a batch): the same rounding of x, and per output
// the same f32 steps block by block, (dot * x_scale - zero term) * group scale added in order
// (int4_one_row.h). One row: four weight rows, one from each of four slabs of a thread's rows,
// share each x load, their block dots gathered into one vector; threads split N. Needs
// AVX2 + FMA + F16C; K % 64 == 0 and group_size 32 or a multiple of 64, so that no step straddles
// two groups (the lowering dequantizes + GEMMs otherwise, as the op does for M > kSmallM = 128).
//
// Two translation units, as gemv_kernel.cpp (see int4_kernel.py): -DKILN_INT4_KERNELS compiles
// the SIMD code without torch headers; the default compiles the op against libtorch.
#include <cstdint>

extern "C" {
// y[n] for n in [n0, n1) of one row of x prepared by kiln_q4_prepare_rows (`record`): each output
// bit for bit what the several-row kernels give that row (int4_one_row.h). The _f16 form:
// symmetric weights whose scales are IEEE half (10% fewer bytes per token).
void kiln_q4_rows_f16(const uint8_t* record, const uint8_t* q, const uint16_t* scales, int64_t K, int64_t group_size,
                      int64_t n0, int64_t n1, const float* bias, float* y);
void kiln_q4_rows(const uint8_t* record, const uint8_t* q, const float* scales, const uint8_t* zeros, int64_t K,
                  int64_t group_size, int64_t n0, int64_t n1, const float* bias, float* y);
// Several rows of x: each row rounded once into a record of kiln_q4_record_bytes(K) bytes (the
// int8 halves and per-lane block terms, padded to whole 512-bit steps); record m of `records` at
// m * kiln_q4_record_bytes(K).
int64_t kiln_q4_record_bytes(int64_t K);
void kiln_q4_prepare_rows(const float* x, int64_t K, int64_t m0, int64_t m1, uint8_t* records);
// y[m * N + n] for n in [n0, n1) and all M prepared rows: each weight row read from memory once
// and staged in L1 for all rows of x. Scales f32, or f16 (half_scales, symmetric weights only).
void kiln_q4_many_rows(const uint8_t* records, int64_t M, const uint8_t* q, const float* scales,
                       const uint16_t* half_scales, const uint8_t* zeros, int64_t K, int64_t group_size, int64_t n0,
                       int64_t n1, const float* bias, float* y, int64_t N);
// Weights packed into panels of 16 rows at lowering (int4_panels.h, kPanelBytes each): y[m * N + n]
// for the rows of panels [p0, p1) and all M prepared rows, each panel read from memory once.
// Scales f16 in panels without zero points, f32 in those with.
void kiln_q4_panels(const uint8_t* records, int64_t M, const uint8_t* packed, int64_t panel_bytes, bool zero_points,
                    int64_t K, int64_t p0, int64_t p1, const float* bias, float* y, int64_t N);
// Bytes of one packed panel of 16 rows: codes, scales, zero points, padded to 64.
int64_t kiln_q4_panel_bytes(int64_t K, bool zero_points);
// Whether kiln_q4_many_rows uses AVX-512 VNNI (where the CPU has it; the default); returns the
// choice in force.
bool kiln_q4_use_vnni(bool wanted);
// Rows [n0, n1) of the f32 weight w [N, K] (prefill's GEMM operand), one pass over the codes.
void kiln_q4_dequantize(const uint8_t* q, const float* scales, const uint8_t* zeros, int64_t K, int64_t group_size,
                        int64_t n0, int64_t n1, float* w);
}

#ifdef KILN_INT4_KERNELS
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace kiln_q4 {

// The per-lane factor of one 64-weight step (lanes 0-3 cover weights [0, 32), lanes 4-7 [32, 64)):
// p[0] in lanes 0-3, p[1] in lanes 4-7: one 8-byte broadcast and a permute.
static inline __m256 pair_at(const float* p) {
  const __m256i idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  return _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p))), idx);
}

// Each weight row asks for the bytes this far ahead of the step it reads (measured: 1.1-1.3x).
constexpr int kPrefetchBytes = 1024;

// int32 lanes: lanes 0-3 the dot of weights [0, 32) of a 64-weight step with x, 4-7 of [32, 64).
static inline __m256i dot64(__m256i w, __m256i e, __m256i o) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, o));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// ---- several rows of x (int4_rows_isa.h) ----

#include "int4_rows_isa.h"

// ---- one row of x (int4_one_row.h) ----

#include "int4_one_row.h"

static bool cpu_has_vnni() {
  __builtin_cpu_init();  // static initializers may run before the CPU model is read
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}
static bool use_vnni = cpu_has_vnni();

}  // namespace kiln_q4

extern "C" {
bool kiln_q4_use_vnni(bool wanted) {
  kiln_q4::use_vnni = wanted && kiln_q4::cpu_has_vnni();
  return kiln_q4::use_vnni;
}

int64_t kiln_q4_record_bytes(int64_t K) { return kiln_q4::record_bytes(K); }

// Per block of 32: scale max|x| / 127, each value times 127 / max|x| rounded to nearest even (cvtps), the
// 32 bytes split into even and odd elements.
void kiln_q4_prepare_rows(const float* x, int64_t K, int64_t m0, int64_t m1, uint8_t* records) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t m = m0; m < m1; m++) {
    const kiln_q4::XRow row = kiln_q4::x_row(records, K, m);
    int8_t* even = const_cast<int8_t*>(row.even);
    int8_t* odd = const_cast<int8_t*>(row.odd);
    for (int64_t b = 0; b < K / 32; b++) {
      const float* src = x + m * K + b * 32;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
      }
      __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      a = _mm_max_ps(a, _mm_movehl_ps(a, a));
      const float block_max = _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
      const float scale = block_max / 127.f;
      const __m256 inverse = _mm256_set1_ps(block_max > 0.f ? 127.f / block_max : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
      const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      const __m256i in_order = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      // [e0..e7 o0..o7 | e8..e15 o8..o15] -> [e0..e15 | o0..o15]
      const __m256i halves = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(in_order, split), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(even + 16 * b), _mm256_castsi256_si128(halves));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(odd + 16 * b), _mm256_extracti128_si256(halves, 1));
      const_cast<float*>(row.scale)[b] = scale;
      const_cast<float*>(row.zero)[b] = 8.f * (_mm_cvtsi128_si32(s) * scale);
    }
  }
}

void kiln_q4_many_rows(const uint8_t* records, int64_t M, const uint8_t* q, const float* scales,
                       const uint16_t* half_scales, const uint8_t* zeros, int64_t K, int64_t group_size, int64_t n0,
                       int64_t n1, const float* bias, float* y, int64_t N) {
  thread_local std::vector<kiln_q4::XRow> x;
  thread_local std::vector<float> tile;
  thread_local std::vector<uint8_t> staging;
  x.resize(M);
  for (int64_t m = 0; m < M; m++) x[m] = kiln_q4::x_row(records, K, m);
  tile.resize(M * 4 * kiln_q4::kTileRows);
  staging.resize(kiln_q4::panel_bytes(K) + 64);
  uint8_t* area = staging.data() + (64 - reinterpret_cast<uintptr_t>(staging.data()) % 64) % 64;
  float* t = tile.data();
  if (kiln_q4::use_vnni) {
    if (half_scales)
      return kiln_q4::vnni::many_rows(x.data(), M, q, half_scales, zeros, K, group_size, n0, n1, bias, y, N, area, t);
    return kiln_q4::vnni::many_rows(x.data(), M, q, scales, zeros, K, group_size, n0, n1, bias, y, N, area, t);
  }
  if (half_scales)
    return kiln_q4::avx2::many_rows(x.data(), M, q, half_scales, zeros, K, group_size, n0, n1, bias, y, N, area, t);
  kiln_q4::avx2::many_rows(x.data(), M, q, scales, zeros, K, group_size, n0, n1, bias, y, N, area, t);
}

int64_t kiln_q4_panel_bytes(int64_t K, bool zero_points) {
  const int64_t blocks = K / 32, bytes = blocks * (256 + (zero_points ? 16 * 4 + 16 : 16 * 2));
  return (bytes + 63) / 64 * 64;
}

void kiln_q4_panels(const uint8_t* records, int64_t M, const uint8_t* packed, int64_t panel_bytes, bool zero_points,
                    int64_t K, int64_t p0, int64_t p1, const float* bias, float* y, int64_t N) {
  thread_local std::vector<kiln_q4::XRow> x;
  x.resize(M);
  for (int64_t m = 0; m < M; m++) x[m] = kiln_q4::x_row(records, K, m);
  const kiln_q4::XRow* rows = x.data();
  if (kiln_q4::use_vnni) {
    if (zero_points)
      return kiln_q4::vnni::packed_panels<float>(rows, M, packed, panel_bytes, K, true, p0, p1, bias, y, N);
    return kiln_q4::vnni::packed_panels<uint16_t>(rows, M, packed, panel_bytes, K, false, p0, p1, bias, y, N);
  }
  if (zero_points)
    return kiln_q4::avx2::packed_panels<float>(rows, M, packed, panel_bytes, K, true, p0, p1, bias, y, N);
  kiln_q4::avx2::packed_panels<uint16_t>(rows, M, packed, panel_bytes, K, false, p0, p1, bias, y, N);
}

// 32 weights (16 bytes of codes) at a time: nibbles split and interleaved back into column order,
// widened to f32 and mapped to (q - z) * scale = q * scale - z * scale by one FMA.
void kiln_q4_dequantize(const uint8_t* q, const float* scales, const uint8_t* zeros, int64_t K, int64_t group_size,
                        int64_t n0, int64_t n1, float* w) {
  const int64_t G = (K + group_size - 1) / group_size;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = q + n * K / 2;
    float* out = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t g = n * G + k / group_size;
      const __m256 scale = _mm256_set1_ps(scales[g]);
      const __m256 offset = _mm256_set1_ps(-(zeros ? zeros[g] : 8) * scales[g]);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
      const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      const __m128i ordered[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
      for (int half = 0; half < 2; half++)
        for (int eight = 0; eight < 2; eight++) {
          const __m128i codes = eight ? _mm_srli_si128(ordered[half], 8) : ordered[half];
          const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
          _mm256_storeu_ps(out + k + 16 * half + 8 * eight, _mm256_fmadd_ps(values, scale, offset));
        }
    }
  }
}

void kiln_q4_rows_f16(const uint8_t* record, const uint8_t* q, const uint16_t* scales, int64_t K, int64_t group_size,
                      int64_t n0, int64_t n1, const float* bias, float* y) {
  const kiln_q4::XRow x = kiln_q4::x_row(record, K, 0);
  kiln_q4::one_row<false>(x, q, scales, static_cast<const uint8_t*>(nullptr), K, group_size, n0, n1, bias, y);
}

void kiln_q4_rows(const uint8_t* record, const uint8_t* q, const float* scales, const uint8_t* zeros, int64_t K,
                  int64_t group_size, int64_t n0, int64_t n1, const float* bias, float* y) {
  const kiln_q4::XRow x = kiln_q4::x_row(record, K, 0);
  if (zeros) return kiln_q4::one_row<true>(x, q, scales, zeros, K, group_size, n0, n1, bias, y);
  kiln_q4::one_row<false>(x, q, scales, zeros, K, group_size, n0, n1, bias, y);
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

constexpr int64_t kSmallM = 128;      // rows of x above this: dequantize once and run one GEMM (prefill)
constexpr int64_t kRowsPerTask = 64;  // rows of W per parallel task (64 x K/2 bytes), one row of x
constexpr int64_t kPanelRows = 16;    // several: a panel (576 rows split evenly over 2, 3, 4 threads)

// The f32 weight [N, K] (prefill): one GEMM beats re-reading the packed rows per row of x.
static at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros, int64_t K,
                             int64_t group_size) {
  const int64_t N = q.size(0);
  at::Tensor w = at::empty({N, K}, scales.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const uint8_t* zp = zeros.defined() ? zeros.data_ptr<uint8_t>() : nullptr;
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    kiln_q4_dequantize(qp, sp, zp, K, group_size, n0, n1, wp);
  });
  return w;
}

struct WeightPointers {
  const uint8_t* q;
  const float* scales;
  const uint16_t* half_scales;  // or null
  const uint8_t* zeros;         // or null: symmetric
  const float* bias;            // or null
};

// Threads split the rows of W, `per_task` rows at a time.
template <class Rows>
static void over_rows_of_w(int64_t N, int64_t per_task, Rows rows) {
  at::parallel_for(0, (N + per_task - 1) / per_task, 1, [&](int64_t t0, int64_t t1) {
    rows(t0 * per_task, std::min(N, t1 * per_task));
  });
}

// One row of x (decode): x rounded into a record kept per thread (a decode step makes ~120 of these
// calls, and tensor allocations were a good part of each small call's cost), as many_rows rounds it.
static void one_row(const float* x, const WeightPointers& w, int64_t N, int64_t K, int64_t group_size, float* y) {
  thread_local std::vector<uint8_t> scratch;
  scratch.resize(kiln_q4_record_bytes(K));
  uint8_t* record = scratch.data();
  kiln_q4_prepare_rows(x, K, 0, 1, record);
  over_rows_of_w(N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    if (w.half_scales) kiln_q4_rows_f16(record, w.q, w.half_scales, K, group_size, n0, n1, w.bias, y);
    else kiln_q4_rows(record, w.q, w.scales, w.zeros, K, group_size, n0, n1, w.bias, y);
  });
}

// The M rows of x rounded into records (over the threads: the rounding is a few % of the call),
// in a scratch buffer kept per thread.
static const uint8_t* prepared_rows(const float* x, int64_t M, int64_t K) {
  thread_local std::vector<uint8_t> scratch;
  scratch.resize(M * kiln_q4_record_bytes(K) + 64);
  uint8_t* records = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
  at::parallel_for(0, M, 2, [&](int64_t m0, int64_t m1) { kiln_q4_prepare_rows(x, K, m0, m1, records); });
  return records;
}

// 2..kSmallM rows: each rounded once, then each weight row read from memory once for all of them.
static void many_rows(const float* x, int64_t M, const WeightPointers& w, int64_t N, int64_t K, int64_t group_size,
                      float* y) {
  const uint8_t* records = prepared_rows(x, M, K);
  over_rows_of_w(N, kPanelRows, [&](int64_t n0, int64_t n1) {
    kiln_q4_many_rows(records, M, w.q, w.scales, w.half_scales, w.zeros, K, group_size, n0, n1, w.bias, y, N);
  });
}

at::Tensor linear_q4(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales_in,
                     const std::optional<at::Tensor>& zeros_in, const std::optional<at::Tensor>& bias_in,
                     int64_t group_size, const std::optional<at::Tensor>& decode_scales_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "kiln::linear_q4: x must be CPU float32");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous(),
              "kiln::linear_q4: qweight must be a contiguous uint8 [N, K/2]");
  const int64_t N = q.size(0), K = q.size(1) * 2, G = (K + group_size - 1) / group_size;
  TORCH_CHECK(K % 64 == 0 && (group_size == 32 || group_size % 64 == 0),
              "kiln::linear_q4: K must be a multiple of 64 and group_size 32 or a multiple of 64, got K=", K,
              " group_size=", group_size);
  TORCH_CHECK(x_in.size(-1) == K, "kiln::linear_q4: x has K=", x_in.size(-1), ", the weight K=", K);
  at::Tensor scales = scales_in.contiguous();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N * G, "kiln::linear_q4: scales must be f32 [N, G]");
  // decode_scales: the same scales as f16, read by the decode kernel instead (symmetric weights)
  at::Tensor half = decode_scales_in ? decode_scales_in->contiguous() : at::Tensor();
  TORCH_CHECK(!half.defined() || (half.scalar_type() == at::kHalf && half.numel() == N * G && !zeros_in),
              "kiln::linear_q4: decode_scales must be f16 [N, G], for symmetric weights (no zeros)");
  at::Tensor zeros = zeros_in ? zeros_in->contiguous() : at::Tensor();
  TORCH_CHECK(!zeros.defined() || (zeros.scalar_type() == at::kByte && zeros.numel() == N * G),
              "kiln::linear_q4: zeros must be uint8 [N, G]");
  at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == N),
              "kiln::linear_q4: bias must be f32 [N]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.numel() / K;
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  if (M > kSmallM) {
    at::Tensor w = dequantize(q, scales, zeros, K, group_size);
    at::Tensor x2 = x.view({M, K});
    return (bias.defined() ? at::addmm(bias, x2, w.t()) : at::mm(x2, w.t())).view(shape);
  }
  at::Tensor y = at::empty(shape, x.options());
  const WeightPointers w{q.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                         half.defined() ? reinterpret_cast<const uint16_t*>(half.data_ptr<at::Half>()) : nullptr,
                         zeros.defined() ? zeros.data_ptr<uint8_t>() : nullptr,
                         bias.defined() ? bias.data_ptr<float>() : nullptr};
  if (M == 1) one_row(x.data_ptr<float>(), w, N, K, group_size, y.data_ptr<float>());
  else many_rows(x.data_ptr<float>(), M, w, N, K, group_size, y.data_ptr<float>());
  return y;
}

// Whether one row of x reads the panels too (kiln::q4_panels_at_one_row, to measure): slower
// there (1.4x linear_q4's one-row kernel over SmolLM2's int4-g32 linears, 2 threads, Xeon), whose
// four slabs stream side by side with a scale read per 64 weights.
static bool panels_at_one_row = false;

// linear_q4 with the weight also packed into panels (int4_kernel.py's pack_panels): 2..kSmallM
// rows of x read the panels; one row (decode) and prefill read the IR's layout as linear_q4 does.
at::Tensor linear_q4_panels(const at::Tensor& x_in, const at::Tensor& panels, const at::Tensor& q,
                            const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                            const std::optional<at::Tensor>& bias_in, int64_t group_size,
                            const std::optional<at::Tensor>& decode_scales) {
  const int64_t K = x_in.size(-1), M = x_in.numel() / std::max<int64_t>(K, 1), N = q.size(0);
  if ((M == 1 && !panels_at_one_row) || M > kSmallM || M == 0) {
    // symmetric panels hold f16 scales: one row reads the same ones, so that it equals its row among many
    const bool half_needed = M == 1 && !zeros && !decode_scales;
    return linear_q4(x_in, q, scales, zeros, bias_in, group_size,
                     half_needed ? std::optional<at::Tensor>(scales.to(at::kHalf)) : decode_scales);
  }
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat,
              "kiln::linear_q4_panels: x must be CPU float32");
  TORCH_CHECK(K == q.size(1) * 2 && K % 64 == 0, "kiln::linear_q4_panels: x has K=", K, ", the weight K=", q.size(1) * 2,
              " (a multiple of 64)");
  const bool zero_points = zeros.has_value();
  const int64_t panel_bytes = kiln_q4_panel_bytes(K, zero_points);
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() && panels.dim() == 2 &&
                  panels.size(0) == (N + 15) / 16 && panels.size(1) == panel_bytes,
              "kiln::linear_q4_panels: panels must be a contiguous uint8 [", (N + 15) / 16, ", ", panel_bytes,
              "], got ", panels.sizes());
  at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == N),
              "kiln::linear_q4_panels: bias must be f32 [N]");
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const uint8_t* records = prepared_rows(x.data_ptr<float>(), M, K);
  const uint8_t* packed = panels.data_ptr<uint8_t>();
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  at::parallel_for(0, panels.size(0), 1, [&](int64_t p0, int64_t p1) {
    kiln_q4_panels(records, M, packed, panel_bytes, zero_points, K, p0, p1, b, out, N);
  });
  return y;
}

}  // namespace kiln_q4

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("q4_panels_at_one_row(bool wanted) -> bool", [](bool wanted) {
    kiln_q4::panels_at_one_row = wanted;
    return wanted;
  });
  m.def("q4_panel_bytes(int K, bool zero_points) -> int", [](int64_t K, bool zero_points) {
    return kiln_q4_panel_bytes(K, zero_points);
  });
  m.def("linear_q4_panels(Tensor x, Tensor panels, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, "
        "int group_size, Tensor? decode_scales=None) -> Tensor");
  m.def("q4_use_vnni(bool wanted) -> bool", [](bool wanted) { return kiln_q4_use_vnni(wanted); });
  m.def("linear_q4(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size, "
        "Tensor? decode_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_q4", &kiln_q4::linear_q4);
  m.impl("linear_q4_panels", &kiln_q4::linear_q4_panels);
}

#endif  // KILN_INT4_KERNELS
