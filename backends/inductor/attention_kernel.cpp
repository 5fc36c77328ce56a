// Kiln CPU attention over a static KV cache: kiln::cached_attention.
//
// q [B, H, T, D] f32; k, v [B' >= B, Hkv, S, D] f32 (the cache buffers: rows [0, B) are read);
// positions [B, T] int64. Query (b, h, t) sees key slots s with
//   max(0, p - window + 1) <= s <= p,   p = positions[b, t]   (window 0: no lower bound),
// and query head h reads kv head h / (H / Hkv) (GQA kept grouped: no copy of k or v).
// With a token tree (bool [B, T, T], optional), of the slots positions[b, 0] + j that hold this
// call's own tokens, query t sees only those with tree[b, t, j] (its ancestors and itself).
// A query that sees no slot gets zeros (the IR's attention does the same).
// An int8 cache (k_scales, v_scales f32 [B', Hkv, S, 1] given, k and v int8 codes): key slot s is
// k[s] * k_scales[s]. Few queries convert each code row to f32 inside the dot products (the key's
// scale multiplies its score, the value's its softmax weight); longer chunks dequantize only the
// slots up to the chunk's last position for ATen's attention. No f32 copy of the cache is made.
//
// Few queries are attended per kv head, all at once: every (query token, query head) pair of the
// call that reads the head (the group's heads x T tokens) is scored against a block of 64 key
// slots while those keys sit in L1, and the values likewise, so each cached row is read from
// memory once per call rather than once per query token and query head. Every score is computed
// alike whichever queries share a pass and wherever its key falls in a block (one FMA chain per key,
// one reduction tree, key scale * scale): how the threads split a row's queries depends on the
// batch, and a row's output must not (a request decodes the same tokens alone and in a batch).
//
// A paged cache (block_table int32 [B, blocks_per_row] given): k and v (and the scales) are pools
// [num_blocks, Hkv, block_size, D], row b's slot s in block block_table[b, s / block_size]. Few
// queries copy each (row, kv head)'s slots up to the row's last position out of its blocks into a
// per-thread buffer and attend there (each block of a head is contiguous); longer chunks gather
// the rows' blocks up to the chunk's last position for ATen's attention.
//
// Why: decomposed, a grouped attention over a static cache expands k and v to every query
// head and scores all S slots of every step (Inductor copied 2.4 MB per layer per decode token
// for SmolLM2 at S = 512). Here a decode step reads only the slots up to each position, once.
// Few queries (T <= kFewQueries: decode, speculative verification) run this file's kernel;
// longer chunks (prefill) run ATen's scaled_dot_product_attention on the slots up to the
// chunk's last position, with a boolean mask (GEMM-bound work belongs to BLAS).
//
// One file, two translation units (built like gemv_kernel.cpp):
//   -DKILN_ATTENTION_KERNELS : the SIMD kernel (AVX2 + FMA), no torch headers;
//   (default)                : checks, threading, the prefill path and op registration.
#include <cstdint>

extern "C" {
// One kv head's slots as the grouped kernel reads them: f32 rows (k, v), or int8 codes with
// per-slot scales (k_scales non-null). own_first/own_count: the call's own slots (a token tree).
struct KilnKvHead {
  const void* k;
  const void* v;
  const float* k_scales;
  const float* v_scales;
  int64_t D;
  float scale;
  int64_t own_first, own_count;
};
// One (query token, query head) pair: sees slots [lo, hi] (hi < lo: none), a tree's row or null.
struct KilnQuery {
  const float* q;
  float* out;
  int64_t lo, hi;
  const bool* seen;
};
// Every query of `queries` against one kv head, each key and value row read from memory once for
// all of them (a block of slots at a time, held in L1 while every query uses it). scratch holds
// count * stride floats, stride >= the widest query's hi - lo + 1.
void kiln_attend_queries(const KilnKvHead* head, const KilnQuery* queries, int64_t count, float* scratch,
                         int64_t stride);
}

#ifdef KILN_ATTENTION_KERNELS
#include <immintrin.h>
#include <algorithm>
#include <cmath>

namespace {

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The eight lanes of a summed in sums_of_eight's order, ((0+1)+(2+3)) + ((4+5)+(6+7)): a key scored
// alone gets the score it gets among eight (or four), bit for bit.
inline float tree_sum(__m256 a) {
  const __m256 pairs = _mm256_hadd_ps(a, a), fours = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(fours), _mm256_extractf128_ps(fours, 1)));
}

// q . k over D % 8 == 0 values: one chain of FMAs and tree_sum, as the many-key loops compute it.
template <typename Row, typename Load>
inline float dot_chain(const float* q, const Row* k, int64_t D, Load load) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) acc = _mm256_fmadd_ps(load(k + c), _mm256_loadu_ps(q + c), acc);
  return tree_sum(acc);
}

inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

// Any head dim: one key at a time.
void scores_any_dim(const float* q, const float* k, int64_t D, int64_t n, float scale, float* scores) {
  for (int64_t s = 0; s < n; s++) scores[s] = scale * dot(q, k + s * D, D);
}

// Lane j = the sum of the eight lanes of a[j]: eight dot products finished at once.
inline __m256 sums_of_eight(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// e^x in eight lanes (Cephes' polynomial, as in avx_mathfun: relative error ~1e-7; here x <= 0).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 fx = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// scores[i] = scale * q . k[i] for i < n (k rows D apart, D % 8 == 0), eight keys at a time.
void scores_of(const float* q, const float* k, int64_t D, int64_t n, float scale, float* scores) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 qv = _mm256_loadu_ps(q + c);
      for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(k + (i + j) * D + c), qv, acc[j]);
    }
    _mm256_storeu_ps(scores + i, _mm256_mul_ps(sums_of_eight(acc), _mm256_set1_ps(scale)));
  }
  for (; i < n; i++) scores[i] = dot_chain(q, k + i * D, D, load_f32) * scale;
}

// p[i] = e^(p[i] - max p) for i < n; returns their sum (0 when every p[i] is -inf).
float exponentiate(float* p, int64_t n) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);  // eight running maxima: no chain of scalar compares
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(p + i));
  __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
  top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
  float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
  for (; i < n; i++) top = p[i] > top ? p[i] : top;
  if (top == -INFINITY) return 0.f;
  top8 = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), top8));
    _mm256_storeu_ps(p + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum(sum);
  for (; i < n; i++) {
    p[i] = std::exp(p[i] - top);
    total += p[i];
  }
  return total;
}

// Eight int8 codes as eight floats (exact).
inline __m256 codes8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float dot_q8(const float* q, const int8_t* k, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), codes8(k + i), acc);
  float s = hsum(acc);
  for (; i < n; i++) s += q[i] * k[i];
  return s;
}

// scores[i] = scale * k_scales[i] * q . codes[i] for i < n, eight keys at a time (D % 8 == 0).
void scores_q8(const float* q, const int8_t* k, const float* k_scales, int64_t D, int64_t n, float scale,
               float* scores) {
  const __m256 scale8 = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n && D % 8 == 0; i += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 qv = _mm256_loadu_ps(q + c);
      for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(codes8(k + (i + j) * D + c), qv, acc[j]);
    }
    const __m256 key_scales = _mm256_mul_ps(_mm256_loadu_ps(k_scales + i), scale8);
    _mm256_storeu_ps(scores + i, _mm256_mul_ps(sums_of_eight(acc), key_scales));
  }
  for (; i < n; i++)
    scores[i] = (D % 8 == 0 ? dot_chain(q, k + i * D, D, codes8) : dot_q8(q, k + i * D, D)) * (k_scales[i] * scale);
}

// Softmax numerators of scores[0, n) (slots lo..hi) in place, a tree's hidden slots at exactly
// zero; returns their sum. The visible scores are packed together first, so a tree's node sums
// (and exponentiates) its ancestors' scores in the same SIMD lanes as the one-token call of the
// chain it lies on: an accepted draft's output is then that call's bit for bit.
float visible_softmax(float* scores, int64_t lo, int64_t hi, const bool* seen, int64_t own_first, int64_t own_count) {
  const int64_t n = hi - lo + 1;
  if (!seen) return exponentiate(scores, n);
  const int64_t first = lo > own_first ? lo : own_first;
  const int64_t last = hi < own_first + own_count - 1 ? hi : own_first + own_count - 1;
  int64_t kept = (first <= hi ? first : hi + 1) - lo;  // the slots before the call's own ones: all visible
  for (int64_t s = first; s <= hi; s++)
    if (s > last || seen[s - own_first]) scores[kept++] = scores[s - lo];
  const float total = exponentiate(scores, kept);
  for (int64_t s = hi; s >= first; s--)  // back to their slots, from the end (a packed index <= its slot's)
    scores[s - lo] = (s > last || seen[s - own_first]) ? scores[--kept] : 0.f;
  return total;
}

constexpr int64_t kPageBytes = 4096;
constexpr int64_t kSlotBlock = 64;  // slots per block: 16 KiB of f32 keys at head dim 64, an L1's share

// Starts the next block of rows (keys or values) on its way before it is read: a kv head's slots
// are short streams (SmolLM2 at position 280: 70 KiB of keys, then as many values, per row and kv
// head) that the hardware prefetchers, stopping at each 4 KiB page, would follow only after a miss
// per page. On Intel Xeon a prefetch for each line of the block streamed it (docs/benchmarks.md);
// on AMD Zen 4 those 256 prefetches stalled the loop on the miss buffers (41% of the kernel's
// cycles), and one a page, which starts the hardware's streams on every page of the block, made a
// 16-row step's attention 1.10-1.19x faster (bench/results/attention_cost-rows16-page-prefetch-epyc.md).
inline int64_t prefetch_stride() {
  static const int64_t stride = __builtin_cpu_is("amd") ? kPageBytes : 64;
  return stride;
}

inline void prefetch_slots(const KilnKvHead& head, const void* rows, int64_t first, int64_t n) {
  if (n <= 0) return;
  const int64_t row_bytes = head.k_scales ? head.D : head.D * (int64_t)sizeof(float);
  const char* start = static_cast<const char*>(rows) + first * row_bytes;
  const int64_t stride = prefetch_stride();
  for (int64_t offset = 0; offset < n * row_bytes; offset += stride) _mm_prefetch(start + offset, _MM_HINT_T0);
}

// scores[0:n] of the query against slots first..first+n-1 of the head.
void score_slots(const KilnKvHead& head, const float* q, int64_t first, int64_t n, float* scores) {
  const int64_t D = head.D;
  if (head.k_scales)
    scores_q8(q, static_cast<const int8_t*>(head.k) + first * D, head.k_scales + first, D, n, head.scale, scores);
  else if (D % 8 != 0)
    scores_any_dim(q, static_cast<const float*>(head.k) + first * D, D, n, head.scale, scores);
  else
    scores_of(q, static_cast<const float*>(head.k) + first * D, D, n, head.scale, scores);
}

// Two queries' scores against the same n keys (D % 8 == 0), four keys at a time: each key row is
// loaded (and, int8, converted) once for both. key_scales null: f32 keys.
template <typename Row, typename Load>
void scores_of_two(const float* q0, const float* q1, const Row* k, const float* key_scales, int64_t D, int64_t n,
                   float scale, float* scores0, float* scores1, Load load) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m256 acc[8];  // acc[j]: q0 . key j, acc[4 + j]: q1 . key j
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 a = _mm256_loadu_ps(q0 + c), b = _mm256_loadu_ps(q1 + c);
      for (int j = 0; j < 4; j++) {
        const __m256 key = load(k + (i + j) * D + c);
        acc[j] = _mm256_fmadd_ps(key, a, acc[j]);
        acc[4 + j] = _mm256_fmadd_ps(key, b, acc[4 + j]);
      }
    }
    __m256 factor = _mm256_set1_ps(scale);  // key scale * scale, as the one-query loops multiply
    if (key_scales) {
      const __m128 four = _mm_mul_ps(_mm_loadu_ps(key_scales + i), _mm_set1_ps(scale));
      factor = _mm256_set_m128(four, four);
    }
    const __m256 both = _mm256_mul_ps(sums_of_eight(acc), factor);
    _mm_storeu_ps(scores0 + i, _mm256_castps256_ps128(both));
    _mm_storeu_ps(scores1 + i, _mm256_extractf128_ps(both, 1));
  }
  for (; i < n; i++) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 key = load(k + i * D + c);
      a = _mm256_fmadd_ps(key, _mm256_loadu_ps(q0 + c), a);
      b = _mm256_fmadd_ps(key, _mm256_loadu_ps(q1 + c), b);
    }
    const float key_scale = key_scales ? key_scales[i] * scale : scale;
    scores0[i] = tree_sum(a) * key_scale;
    scores1[i] = tree_sum(b) * key_scale;
  }
}

// Scores of two queries over the same slots first..first+n-1 of the head (D % 8 == 0).
void score_slots_two(const KilnKvHead& head, const float* q0, const float* q1, int64_t first, int64_t n,
                     float* scores0, float* scores1) {
  const int64_t D = head.D;
  if (head.k_scales)
    scores_of_two(q0, q1, static_cast<const int8_t*>(head.k) + first * D, head.k_scales + first, D, n, head.scale,
                  scores0, scores1, codes8);
  else
    scores_of_two(q0, q1, static_cast<const float*>(head.k) + first * D, nullptr, D, n, head.scale, scores0, scores1,
                  [](const float* p) { return _mm256_loadu_ps(p); });
}

// out[0:Columns] += sum_i w[i] * v[i][0:Columns], the columns in registers (eight chains of FMAs
// at 64 columns keep both FMA units busy; four would wait on their latency).
template <int Columns, typename Row, typename Load>
inline void accumulate_columns(const float* w, const Row* v, int64_t D, int64_t n, float* out, Load load) {
  __m256 a[Columns / 8];
  for (int j = 0; j < Columns / 8; j++) a[j] = _mm256_loadu_ps(out + 8 * j);
  for (int64_t i = 0; i < n; i++) {
    const __m256 wv = _mm256_broadcast_ss(w + i);
    for (int j = 0; j < Columns / 8; j++) a[j] = _mm256_fmadd_ps(wv, load(v + i * D + 8 * j), a[j]);
  }
  for (int j = 0; j < Columns / 8; j++) _mm256_storeu_ps(out + 8 * j, a[j]);
}

// out[0:D] += sum_i w[i] * v[i] (int8: codes, the scales already folded into w).
template <typename Row, typename Load>
void accumulate_values(const float* w, const Row* v, int64_t D, int64_t n, float* out, Load load) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) accumulate_columns<64>(w, v + c, D, n, out + c, load);
  for (; c + 32 <= D; c += 32) accumulate_columns<32>(w, v + c, D, n, out + c, load);
  for (; c + 8 <= D; c += 8) {
    __m256 a = _mm256_loadu_ps(out + c);
    for (int64_t i = 0; i < n; i++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(w + i), load(v + i * D + c), a);
    _mm256_storeu_ps(out + c, a);
  }
  for (; c < D; c++)  // head dims that are not a multiple of 8
    for (int64_t i = 0; i < n; i++) out[c] += w[i] * static_cast<float>(v[i * D + c]);
}

void value_slots(const KilnKvHead& head, const float* w, int64_t first, int64_t n, float* out) {
  const int64_t D = head.D;
  if (head.k_scales)
    accumulate_values(w, static_cast<const int8_t*>(head.v) + first * D, D, n, out, codes8);
  else
    accumulate_values(w, static_cast<const float*>(head.v) + first * D, D, n, out,
                      [](const float* p) { return _mm256_loadu_ps(p); });
}

}  // namespace

// Three passes, the first and last block by block over the union of the queries' slots: scores
// (each block of keys read once, every query scored against it), the softmax per query (its
// scores only), the weighted values (each block of values read once). Each query's scores and
// weights cover exactly its visible slots, so a slot no query sees is never read.
extern "C" void kiln_attend_queries(const KilnKvHead* head, const KilnQuery* queries, int64_t count, float* scratch,
                                    int64_t stride) {
  int64_t first = INT64_MAX, last = -1;
  for (int64_t i = 0; i < count; i++) {
    for (int64_t d = 0; d < head->D; d++) queries[i].out[d] = 0.f;
    if (queries[i].hi < queries[i].lo) continue;
    first = queries[i].lo < first ? queries[i].lo : first;
    last = queries[i].hi > last ? queries[i].hi : last;
  }
  if (last >= first) prefetch_slots(*head, head->k, first, std::min(kSlotBlock, last - first + 1));
  for (int64_t start = first; start <= last; start += kSlotBlock) {
    const int64_t end = start + kSlotBlock - 1 < last ? start + kSlotBlock - 1 : last;
    if (end < last) prefetch_slots(*head, head->k, end + 1, std::min(kSlotBlock, last - end));
    else prefetch_slots(*head, head->v, first, std::min(kSlotBlock, last - first + 1));  // the values' first block
    for (int64_t i = 0; i < count; i++) {
      const KilnQuery& query = queries[i];
      const int64_t s0 = start > query.lo ? start : query.lo, s1 = end < query.hi ? end : query.hi;
      if (s0 > s1) continue;
      if (i + 1 < count && head->D % 8 == 0) {  // the next query sees the same slots here: score both at once
        const KilnQuery& next = queries[i + 1];
        if ((start > next.lo ? start : next.lo) == s0 && (end < next.hi ? end : next.hi) == s1) {
          score_slots_two(*head, query.q, next.q, s0, s1 - s0 + 1, scratch + i * stride + (s0 - query.lo),
                          scratch + (i + 1) * stride + (s0 - next.lo));
          i++;
          continue;
        }
      }
      score_slots(*head, query.q, s0, s1 - s0 + 1, scratch + i * stride + (s0 - query.lo));
    }
  }
  for (int64_t i = 0; i < count; i++) {
    const KilnQuery& query = queries[i];
    if (query.hi < query.lo) continue;
    float* weights = scratch + i * stride;
    const float total =
        visible_softmax(weights, query.lo, query.hi, query.seen, head->own_first, head->own_count);
    const float* v_scales = head->v_scales;
    if (!(total > 0.f)) {  // every slot hidden (scores left at -inf): zeros
      for (int64_t s = query.lo; s <= query.hi; s++) weights[s - query.lo] = 0.f;
      continue;
    }
    const float inverse = 1.f / total;
    const int64_t n = query.hi - query.lo + 1;
    if (v_scales)
      for (int64_t i = 0; i < n; i++) weights[i] *= v_scales[query.lo + i] * inverse;
    else
      for (int64_t i = 0; i < n; i++) weights[i] *= inverse;
  }
  for (int64_t start = first; start <= last; start += kSlotBlock) {
    const int64_t end = start + kSlotBlock - 1 < last ? start + kSlotBlock - 1 : last;
    if (end < last) prefetch_slots(*head, head->v, end + 1, std::min(kSlotBlock, last - end));
    for (int64_t i = 0; i < count; i++) {
      const KilnQuery& query = queries[i];
      const int64_t s0 = start > query.lo ? start : query.lo, s1 = end < query.hi ? end : query.hi;
      if (s0 <= s1) value_slots(*head, scratch + i * stride + (s0 - query.lo), s0, s1 - s0 + 1, query.out);
    }
  }
}

#else  // ---------------------------------------------------------------- torch binding TU

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace kiln_attention {

constexpr int64_t kFewQueries = 16;  // more queries per row than this: ATen's SDPA (GEMM-bound)

static void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  const char* op = "kiln::cached_attention";
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat, op, ": q must be float32");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must be [batch, heads, seq, head_dim]");
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k and v caches differ in shape");
  TORCH_CHECK(k.size(0) >= q.size(0), op, ": the cache has ", k.size(0), " rows, fewer than the batch ", q.size(0));
  TORCH_CHECK(q.size(1) % k.size(1) == 0, op, ": ", q.size(1), " query heads are not a multiple of ", k.size(1),
              " kv heads");
  TORCH_CHECK(q.size(3) == k.size(3), op, ": q and k head dims differ");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 2 && positions.size(0) == q.size(0) &&
                  positions.size(1) == q.size(2),
              op, ": positions must be int64 [batch, seq]");
}

// An f32 cache, or an int8 one: int8 codes with f32 scales [rows, kv heads, slots, 1] for k and v.
static void check_cache_kind(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& k_scales,
                             const std::optional<at::Tensor>& v_scales) {
  const char* op = "kiln::cached_attention";
  TORCH_CHECK(k_scales.has_value() == v_scales.has_value(), op, ": k_scales and v_scales come together");
  if (!k_scales) {
    TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, op,
                ": k, v must be float32 (or int8 with k_scales and v_scales)");
    return;
  }
  TORCH_CHECK(k.scalar_type() == at::kChar && v.scalar_type() == at::kChar, op, ": an int8 cache's k, v must be int8");
  for (const at::Tensor* scales : {&*k_scales, &*v_scales})
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->dim() == 4 && scales->size(0) == k.size(0) &&
                    scales->size(1) == k.size(1) && scales->size(2) == k.size(2) && scales->size(3) == 1,
                op, ": k_scales and v_scales must be float32 [rows, kv_heads, slots, 1] like the cache");
}

// The visible slots [lo, hi] of a query at position p.
static inline std::pair<int64_t, int64_t> visible(int64_t p, int64_t window, int64_t slots) {
  const int64_t hi = std::min(p, slots - 1);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
  return {lo, hi};
}

static void check_tree(const at::Tensor& tree, const at::Tensor& q) {
  const int64_t B = q.size(0), T = q.size(2);
  TORCH_CHECK(tree.scalar_type() == at::kBool && tree.dim() == 3 && tree.size(0) == B && tree.size(1) == T &&
                  tree.size(2) == T,
              "kiln::cached_attention: tree must be bool [batch, seq, seq]");
}

// The tasks [0, B * per_row) (row b's are b * per_row...) cut into one contiguous run per thread
// of about equal work, the slots its queries read (and a fixed cost per task): the rows of a
// batched decode sit at different positions, and an even count of tasks per thread left one
// thread with most of a step's keys and values. Returns the runs' bounds. Which thread runs a task
// changes no result: every task writes its own queries' outputs.
static std::vector<int64_t> balanced_runs(const int64_t* pos, int64_t B, int64_t T, int64_t per_row, int64_t window,
                                          int64_t slots, int64_t threads) {
  constexpr int64_t kTaskSlots = 16;  // a task's own cost, in slots read
  std::vector<int64_t> ends(B * per_row);  // work up to and including each task
  int64_t total = 0;
  for (int64_t b = 0; b < B; b++) {
    int64_t lo = slots, hi = -1;
    for (int64_t t = 0; t < T; t++) {
      const auto [l, h] = visible(pos[b * T + t], window, slots);
      lo = std::min(lo, l), hi = std::max(hi, h);
    }
    const int64_t work = kTaskSlots + std::max<int64_t>(0, hi - lo + 1);
    for (int64_t i = 0; i < per_row; i++) ends[b * per_row + i] = (total += work);
  }
  const int64_t count = std::clamp<int64_t>(threads, 1, B * per_row);
  std::vector<int64_t> runs{0};
  for (int64_t run = 1; run < count; run++) {
    const int64_t share = total * run / count;  // a task goes to the run holding most of its work
    int64_t task = runs.back();
    while (task < B * per_row && ends[task] - (ends[task] - (task ? ends[task - 1] : 0)) / 2 <= share) task++;
    runs.push_back(task);
  }
  runs.push_back(B * per_row);
  return runs;
}

static at::Tensor few_queries(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& positions, double scale, int64_t window,
                              const std::optional<at::Tensor>& tree, const std::optional<at::Tensor>& k_scales,
                              const std::optional<at::Tensor>& v_scales) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), groups = H / Hkv;
  at::Tensor out = at::empty({B, H, T, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const bool int8 = k_scales.has_value();
  const float* kp = int8 ? nullptr : k.data_ptr<float>();
  const float* vp = int8 ? nullptr : v.data_ptr<float>();
  const int8_t* kc = int8 ? k.data_ptr<int8_t>() : nullptr;
  const int8_t* vc = int8 ? v.data_ptr<int8_t>() : nullptr;
  const float* ks = int8 ? k_scales->data_ptr<float>() : nullptr;
  const float* vs = int8 ? v_scales->data_ptr<float>() : nullptr;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const bool* seen = tree ? tree->data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  // Tasks (b, kv head, a share of its group x T queries): each reads the head's keys and values
  // once for its queries. The queries are split only as far as keeps every thread busy.
  const int64_t pairs = groups * T, heads = B * Hkv;
  const int64_t shares = std::clamp<int64_t>((2 * at::get_num_threads() + heads - 1) / heads, 1, pairs);
  const std::vector<int64_t> runs = balanced_runs(pos, B, T, Hkv * shares, window, S, at::get_num_threads());
  at::parallel_for(0, (int64_t)runs.size() - 1, 1, [&](int64_t first_run, int64_t last_run) {
    thread_local std::vector<float> scratch;  // per thread, kept: no allocation per call
    thread_local std::vector<KilnQuery> queries;
    for (int64_t task = runs[first_run]; task < runs[last_run]; task++) {
      const int64_t b = task / (Hkv * shares), kv_head = task / shares % Hkv, share = task % shares;
      const int64_t head_first = (b * Hkv + kv_head) * S;  // the kv head's first slot
      KilnKvHead head{int8 ? static_cast<const void*>(kc + head_first * D) : kp + head_first * D,
                      int8 ? static_cast<const void*>(vc + head_first * D) : vp + head_first * D,
                      int8 ? ks + head_first : nullptr,
                      int8 ? vs + head_first : nullptr,
                      D,
                      (float)scale,
                      pos[b * T],
                      T};
      queries.clear();
      int64_t stride = 1;
      for (int64_t pair = share * pairs / shares; pair < (share + 1) * pairs / shares; pair++) {
        const int64_t h = kv_head * groups + pair / T, t = pair % T;
        const auto [lo, hi] = visible(pos[b * T + t], window, S);
        stride = std::max(stride, hi - lo + 1);
        queries.push_back({qp + ((b * H + h) * T + t) * D, op + ((b * H + h) * T + t) * D, lo, hi,
                           seen ? seen + (b * T + t) * T : nullptr});
      }
      scratch.resize(queries.size() * stride);
      kiln_attend_queries(&head, queries.data(), (int64_t)queries.size(), scratch.data(), stride);
    }
  });
  return out;
}

// A paged cache: the kv head's slots [0, used) of row b, copied out of its blocks into `out`
// (row_bytes per slot; a head's slots within a block are contiguous in the pool).
static void copy_row_slots(const at::Tensor& pool, const int32_t* blocks, int64_t head, int64_t used, int64_t row_bytes,
                           std::vector<char>& out) {
  const int64_t Hkv = pool.size(1), bs = pool.size(2);
  out.resize(used * row_bytes);
  const char* base = static_cast<const char*>(pool.data_ptr());
  for (int64_t j = 0; j * bs < used; j++) {
    const int64_t count = std::min(bs, used - j * bs);
    std::memcpy(out.data() + j * bs * row_bytes, base + ((blocks[j] * Hkv + head) * bs) * row_bytes,
                count * row_bytes);
  }
}

// Few queries over a paged cache: per (row, kv head), its slots copied out once, then every
// query of that head's group attends to the copy.
static at::Tensor few_queries_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& positions, double scale, int64_t window,
                                    const std::optional<at::Tensor>& tree, const std::optional<at::Tensor>& k_scales,
                                    const std::optional<at::Tensor>& v_scales, const at::Tensor& table) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), groups = H / Hkv, per_row = table.size(1), slots = per_row * k.size(2);
  at::Tensor out = at::empty({B, H, T, D}, q.options());
  const bool int8 = k_scales.has_value();
  const int64_t code_bytes = int8 ? D : D * 4;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* blocks = table.data_ptr<int32_t>();
  const bool* seen = tree ? tree->data_ptr<bool>() : nullptr;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t first, int64_t last) {
    thread_local std::vector<char> keys, values, key_scales, value_scales;
    thread_local std::vector<float> scratch;
    thread_local std::vector<KilnQuery> queries;
    for (int64_t task = first; task < last; task++) {
      const int64_t b = task / Hkv, kv_head = task % Hkv;
      int64_t used = 0;
      for (int64_t t = 0; t < T; t++) used = std::max(used, std::min(pos[b * T + t], slots - 1) + 1);
      const int32_t* row_blocks = blocks + b * per_row;
      copy_row_slots(k, row_blocks, kv_head, used, code_bytes, keys);
      copy_row_slots(v, row_blocks, kv_head, used, code_bytes, values);
      if (int8) {
        copy_row_slots(*k_scales, row_blocks, kv_head, used, 4, key_scales);
        copy_row_slots(*v_scales, row_blocks, kv_head, used, 4, value_scales);
      }
      KilnKvHead head{keys.data(), values.data(),
                      int8 ? reinterpret_cast<const float*>(key_scales.data()) : nullptr,
                      int8 ? reinterpret_cast<const float*>(value_scales.data()) : nullptr,
                      D,
                      (float)scale,
                      pos[b * T],
                      T};
      queries.clear();
      for (int64_t h = kv_head * groups; h < (kv_head + 1) * groups; h++) {
        for (int64_t t = 0; t < T; t++) {
          const auto [lo, hi] = visible(pos[b * T + t], window, used);
          queries.push_back({q.data_ptr<float>() + ((b * H + h) * T + t) * D,
                             out.data_ptr<float>() + ((b * H + h) * T + t) * D, lo, hi,
                             seen ? seen + (b * T + t) * T : nullptr});
        }
      }
      scratch.resize(queries.size() * std::max<int64_t>(used, 1));
      kiln_attend_queries(&head, queries.data(), (int64_t)queries.size(), scratch.data(), std::max<int64_t>(used, 1));
    }
  });
  return out;
}

// A paged cache's rows [B, Hkv, used, last] gathered from the pool: the slots below `used` only.
static at::Tensor gather_rows(const at::Tensor& pool, const at::Tensor& table, int64_t used) {
  const int64_t B = table.size(0), bs = pool.size(2), count = (used + bs - 1) / bs;
  at::Tensor picked = pool.index_select(0, table.narrow(1, 0, count).reshape({-1}).to(at::kLong));
  return picked.view({B, count, pool.size(1), bs, pool.size(3)})
      .permute({0, 2, 1, 3, 4})
      .reshape({B, pool.size(1), count * bs, pool.size(3)})
      .narrow(2, 0, used);
}

// Longer chunks: SDPA over the slots [0, last position] with a boolean visibility mask.
// An int8 cache: the codes of those slots dequantized (the rest of the cache is not read).
static at::Tensor many_queries(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& positions, double scale, int64_t window,
                               const std::optional<at::Tensor>& tree, const std::optional<at::Tensor>& k_scales,
                               const std::optional<at::Tensor>& v_scales) {
  const int64_t B = q.size(0), S = k.size(2);
  const int64_t used = std::min<int64_t>(positions.max().item<int64_t>() + 1, S);
  at::Tensor keys = k.narrow(0, 0, B).narrow(2, 0, used), values = v.narrow(0, 0, B).narrow(2, 0, used);
  if (k_scales) {
    keys = keys.to(at::kFloat) * k_scales->narrow(0, 0, B).narrow(2, 0, used);
    values = values.to(at::kFloat) * v_scales->narrow(0, 0, B).narrow(2, 0, used);
  }
  at::Tensor slot = at::arange(used, positions.options()).view({1, 1, 1, used});
  at::Tensor query_pos = positions.view({B, 1, positions.size(1), 1});
  at::Tensor mask = slot <= query_pos;
  if (window > 0) mask = mask & (slot > query_pos - window);
  if (tree) {  // the call's own slots: visible where the tree says
    const int64_t T = positions.size(1);
    at::Tensor own = slot.view({1, 1, used}) - positions.narrow(1, 0, 1).view({B, 1, 1});
    at::Tensor inside = (own >= 0) & (own < T);
    at::Tensor seen = at::gather(*tree, 2, own.clamp(0, T - 1).expand({B, T, used}));
    mask = mask & (inside.logical_not() | seen).view({B, 1, T, used});
  }
  at::Tensor out = at::scaled_dot_product_attention(q, keys, values, mask, 0.0, false, scale,
                                                    /*enable_gqa=*/q.size(1) != k.size(1));
  // A query that sees no slot gets zeros, not NaN (as the IR's attention).
  return at::nan_to_num(out, 0.0);
}

at::Tensor cached_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const at::Tensor& positions_in, double scale, int64_t window,
                            const std::optional<at::Tensor>& tree_in, const std::optional<at::Tensor>& k_scales_in,
                            const std::optional<at::Tensor>& v_scales_in,
                            const std::optional<at::Tensor>& block_table_in) {
  if (block_table_in) {
    TORCH_CHECK(block_table_in->scalar_type() == at::kInt && block_table_in->dim() == 2 &&
                    block_table_in->size(0) == q_in.size(0),
                "kiln::cached_attention: block_table must be int32 [batch, blocks_per_row]");
    TORCH_CHECK(k_in.dim() == 4, "kiln::cached_attention: a paged k must be [num_blocks, kv_heads, block_size, d]");
  } else {
    check(q_in, k_in, v_in, positions_in);
  }
  check_cache_kind(k_in, v_in, k_scales_in, v_scales_in);
  std::optional<at::Tensor> k_scales, v_scales;
  if (k_scales_in) {
    k_scales = k_scales_in->contiguous();
    v_scales = v_scales_in->contiguous();
  }
  std::optional<at::Tensor> tree;
  if (tree_in) {
    check_tree(*tree_in, q_in);
    tree = tree_in->contiguous();
  }
  at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  at::Tensor positions = positions_in.contiguous();
  if (q.numel() == 0) return at::empty(q.sizes(), q.options());
  if (block_table_in) {
    const at::Tensor table = block_table_in->contiguous();
    if (q.size(2) <= kFewQueries)
      return few_queries_paged(q, k, v, positions, scale, window, tree, k_scales, v_scales, table);
    const int64_t used = std::min<int64_t>(positions.max().item<int64_t>() + 1, table.size(1) * k.size(2));
    k = gather_rows(k, table, used);
    v = gather_rows(v, table, used);
    if (k_scales) {
      k_scales = gather_rows(*k_scales, table, used);
      v_scales = gather_rows(*v_scales, table, used);
    }
  }
  if (q.size(2) <= kFewQueries) return few_queries(q, k, v, positions, scale, window, tree, k_scales, v_scales);
  return many_queries(q, k, v, positions, scale, window, tree, k_scales, v_scales);
}

}  // namespace kiln_attention

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("cached_attention(Tensor q, Tensor k, Tensor v, Tensor positions, float scale, int window, "
        "Tensor? tree=None, Tensor? k_scales=None, Tensor? v_scales=None, Tensor? block_table=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("cached_attention", &kiln_attention::cached_attention); }

#endif  // KILN_ATTENTION_KERNELS
