// A decode step's attention over the cache's K/V runs (decode_attention.h says what it
// computes). Each KV head's K blocks and V rows are read once for its whole query group and all
// the rows sharing a prefix; a lone row's heads split along the prefix where the threads do not
// divide the heads.
#include "decode_attention.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FEDKV_AVX512 1
#endif

#include "vec_math.h"

namespace fedkv_decode {
namespace {

using bf16 = c10::BFloat16;
#ifdef FEDKV_AVX512
using fedkv_vec::exp16;
#endif

template <typename T>
RunOf<T> run_of(const torch::Tensor& t, int64_t h_dim, int64_t n_dim) {
  TORCH_CHECK(t.scalar_type() == c10::CppTypeToScalarType<T>::value && t.stride(-1) == 1,
              "K/V runs must be ", c10::CppTypeToScalarType<T>::value,
              " with unit stride in the last dim, got ", t.scalar_type());
  return {t.data_ptr<T>(), t.stride(h_dim), t.stride(n_dim), t.size(n_dim)};
}

#ifdef FEDKV_AVX512
inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row16(const bf16* p) {  // exact: bf16 is fp32's upper half
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

template <typename T>
inline float dot(const float* a, const T* b, int64_t dim) {
  int64_t i = 0;
  float s = 0.f;
#ifdef FEDKV_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= dim; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load_row16(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < dim; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

constexpr int64_t MAX_GROUP = 4;  // queries sharing one pass over their K/V rows
constexpr int SHARED_QUERIES = 4;  // queries per pass over a pair of transposed key blocks
constexpr int64_t SHARED_MIN_QUERIES = 8;  // fewer share too little to pay for the transposes
constexpr int VALUE_QUERIES = 6;  // queries' sums (x dim/16 vectors) in registers per pass

// K/V rows are fetched this many rows ahead of the one read: a step's runs are cold (the
// layer's weights streamed through the caches since they were written) and the hardware
// prefetcher stops at every 4 KiB page, so without it each block of rows waits on memory.
constexpr int64_t ROWS_AHEAD = 32;

#ifdef FEDKV_AVX512
// r[i] = sum of v[i]'s 16 lanes, for 16 vectors at once (a transpose-and-add tree: ~30
// instructions where 16 _mm512_reduce_add_ps take ~150).
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                         _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: that lane's sums of v[4j .. 4j+3]
    __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}

// One K/V row (16 * DV values) fetched into L1, ROWS_AHEAD rows before it is read.
template <int DV, typename T>
inline void prefetch_row(const T* r) {
  const char* p = reinterpret_cast<const char*>(r);
  for (int64_t line = 0; line < DV * 16 * static_cast<int64_t>(sizeof(T)); line += 64)
    _mm_prefetch(p + line, _MM_HINT_T0);
}

// Scores of `g` queries over rows 16 at a time, each block of rows read once for all of them
// (it stays in L1 while the queries take their turns). Rows past `ahead` (the rows readable
// from `rows`; -1: no end) are not prefetched: past a run's end in a churned arena lie other
// sessions' rows, and fetching them cost a short run more bytes than its own.
template <int DV, typename T>
int64_t scores_vec(const float* const* q, int64_t g, const T* rows, int64_t stride, int64_t n,
                   float scale, float* const* out, int64_t ahead) {
  __m512 acc[16];
  const __m512 sv = _mm512_set1_ps(scale);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    for (int i = 0; i < 16; ++i)
      if (ahead < 0 || t + ROWS_AHEAD + i < ahead) prefetch_row<DV>(rows + (t + ROWS_AHEAD + i) * stride);
    for (int64_t k = 0; k < g; ++k) {
      __m512 qv[DV];
      for (int d = 0; d < DV; ++d) qv[d] = _mm512_loadu_ps(q[k] + 16 * d);
      for (int i = 0; i < 16; ++i) {
        const T* r = rows + (t + i) * stride;
        __m512 a = _mm512_mul_ps(qv[0], load_row16(r));
        for (int d = 1; d < DV; ++d) a = _mm512_fmadd_ps(qv[d], load_row16(r + 16 * d), a);
        acc[i] = a;
      }
      _mm512_storeu_ps(out[k] + t, _mm512_mul_ps(reduce16(acc), sv));
    }
  }
  return t;
}
#endif

// out[k][t] = scale * (q[k] . row t) for `g` queries over `n` rows `stride` apart: 16 rows at
// a time when dim is a multiple of 16 up to 128.
template <typename T>
void scores(const float* const* q, int64_t g, const T* rows, int64_t stride, int64_t n,
            float scale, float* const* out, int64_t dim, int64_t ahead = -1) {
  int64_t t = 0;
#ifdef FEDKV_AVX512
  switch (dim) {
    case 32: t = scores_vec<2>(q, g, rows, stride, n, scale, out, ahead); break;
    case 64: t = scores_vec<4>(q, g, rows, stride, n, scale, out, ahead); break;
    case 128: t = scores_vec<8>(q, g, rows, stride, n, scale, out, ahead); break;
    default: break;
  }
#endif
  for (; t < n; ++t)
    for (int64_t k = 0; k < g; ++k) out[k][t] = dot(q[k], rows + t * stride, dim) * scale;
}

inline float max_of(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef FEDKV_AVX512
  __m512 v = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(v);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[i] = exp(x[i] - mx), a masked (-inf) score exactly 0; returns the sum.
inline float exp_shift_sum(float* x, int64_t n, float mx) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float s = 0.f;
  int64_t i = 0;
#ifdef FEDKV_AVX512
  const __m512 m = _mm512_set1_ps(mx), masked = _mm512_set1_ps(ninf);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    __mmask16 live = _mm512_cmp_ps_mask(v, masked, _CMP_NEQ_OQ);
    __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(v, m)));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    float e = x[i] == ninf ? 0.f : std::exp(x[i] - mx);
    x[i] = e;
    s += e;
  }
  return s;
}

// o[k][0:dim] += sum_t w[k][t] * row(t) for `g` (<= MAXQ) weight vectors over `n` rows
// `stride` apart: each row read once for all of them, the sums kept in registers when dim is
// a multiple of 16 up to 128. SKIP_ZERO: a zero weight's row is not read into its sum (a
// masked tail position may hold anything); a shared prefix's weights are all softmax values.
template <int DV, int MAXQ, bool SKIP_ZERO, typename T>
void weighted_rows_vec(const float* const* w, int64_t g, const T* rows, int64_t stride,
                       int64_t n, float* const* o, int64_t ahead) {
#ifdef FEDKV_AVX512
  __m512 acc[MAXQ][DV];
  for (int64_t k = 0; k < g; ++k)
    for (int d = 0; d < DV; ++d) acc[k][d] = _mm512_loadu_ps(o[k] + 16 * d);
  for (int64_t t = 0; t < n; ++t) {
    const T* r = rows + t * stride;
    if (ahead < 0 || t + ROWS_AHEAD < ahead) prefetch_row<DV>(r + ROWS_AHEAD * stride);
    __m512 rv[DV];
    for (int d = 0; d < DV; ++d) rv[d] = load_row16(r + 16 * d);
    for (int k = 0; k < MAXQ; ++k) {
      if (k >= g) break;
      if (SKIP_ZERO && w[k][t] == 0.f) continue;
      const __m512 wt = _mm512_set1_ps(w[k][t]);
      for (int d = 0; d < DV; ++d) acc[k][d] = _mm512_fmadd_ps(wt, rv[d], acc[k][d]);
    }
  }
  for (int64_t k = 0; k < g; ++k)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(o[k] + 16 * d, acc[k][d]);
#endif
}

// weighted_rows_vec for any dim (up to MAXQ weight vectors): vector for 16 to 128, else scalar.
template <int MAXQ = MAX_GROUP, bool SKIP_ZERO = true, typename T>
void weighted_rows(const float* const* w, int64_t g, const T* rows, int64_t stride, int64_t n,
                   float* const* o, int64_t dim, int64_t ahead = -1) {
#ifdef FEDKV_AVX512
  switch (dim) {
    case 16: return weighted_rows_vec<1, MAXQ, SKIP_ZERO>(w, g, rows, stride, n, o, ahead);
    case 32: return weighted_rows_vec<2, MAXQ, SKIP_ZERO>(w, g, rows, stride, n, o, ahead);
    case 64: return weighted_rows_vec<4, MAXQ, SKIP_ZERO>(w, g, rows, stride, n, o, ahead);
    case 128: return weighted_rows_vec<8, MAXQ, SKIP_ZERO>(w, g, rows, stride, n, o, ahead);  // spills, still vector
    default: break;
  }
#endif
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < g; ++k)
      if (!SKIP_ZERO || w[k][t] != 0.f)
        for (int64_t i = 0; i < dim; ++i) o[k][i] += w[k][t] * static_cast<float>(rows[t * stride + i]);
}

#ifdef FEDKV_AVX512
// dst[d * 16 + i] = src[i * stride + d] for 16 rows of 16 * DV dims (a block of keys turned
// dims-major, so that a query's scores over it are multiply-adds of whole vectors).
template <int DV, typename T>
inline void transpose_rows(const T* src, int64_t stride, float* dst) {
  for (int c = 0; c < DV; ++c) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = load_row16(src + i * stride + 16 * c);
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      for (int j = 0; j < 2; ++j) {
        __m512d a = _mm512_castps_pd(t[i + j]), b = _mm512_castps_pd(t[i + j + 2]);
        r[i + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[i + j + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
      }
    }
    // r[4m + k] now holds, per 128-bit lane L, dim 4L + off[k] of rows 4m..4m+3 (the pd
    // unpacks leave dims 1 and 2 swapped); gather each dim's lanes into one vector
    constexpr int off[4] = {0, 2, 1, 3};
    for (int k = 0; k < 4; ++k) {
      __m512 a = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
      __m512 e = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD), f = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
      _mm512_storeu_ps(dst + (16 * c + off[k]) * 16, _mm512_shuffle_f32x4(a, b, 0x88));
      _mm512_storeu_ps(dst + (16 * c + 8 + off[k]) * 16, _mm512_shuffle_f32x4(a, b, 0xDD));
      _mm512_storeu_ps(dst + (16 * c + 4 + off[k]) * 16, _mm512_shuffle_f32x4(e, f, 0x88));
      _mm512_storeu_ps(dst + (16 * c + 12 + off[k]) * 16, _mm512_shuffle_f32x4(e, f, 0xDD));
    }
  }
}

// Scores of `g` queries (many: every row's of one KV head) over 32 keys turned dims-major in
// `kt` (two blocks of 16), SHARED_QUERIES at a time: 2 x 4 independent sums in registers.
template <int DV>
inline void scores_dims_major(const float* const* q, int64_t g, const float* kt, float scale,
                              float* const* out, int64_t t, int blocks) {
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t k0 = 0; k0 < g; k0 += SHARED_QUERIES) {
    const int nq = static_cast<int>(std::min<int64_t>(SHARED_QUERIES, g - k0));
    __m512 acc[2][SHARED_QUERIES];
    for (int b = 0; b < 2; ++b)
      for (int j = 0; j < SHARED_QUERIES; ++j) acc[b][j] = _mm512_setzero_ps();
    for (int d = 0; d < DV * 16; ++d) {
      const __m512 k0v = _mm512_loadu_ps(kt + d * 16), k1v = _mm512_loadu_ps(kt + (DV * 16 + d) * 16);
      for (int j = 0; j < SHARED_QUERIES; ++j) {
        if (j >= nq) break;
        const __m512 qd = _mm512_set1_ps(q[k0 + j][d]);
        acc[0][j] = _mm512_fmadd_ps(qd, k0v, acc[0][j]);
        acc[1][j] = _mm512_fmadd_ps(qd, k1v, acc[1][j]);
      }
    }
    for (int j = 0; j < nq; ++j)
      for (int b = 0; b < blocks; ++b)
        _mm512_storeu_ps(out[k0 + j] + t + 16 * b, _mm512_mul_ps(acc[b][j], sv));
  }
}

// out[k][t] = scale * (q[k] . row t) for `g` queries over `n` rows, for many queries at
// once (a shared prefix's): each pair of 16-key blocks is turned dims-major once, then every
// query's scores over it are whole-vector multiply-adds (no horizontal sums). Returns the
// keys done (whole blocks); the caller scores the rest.
template <int DV, typename T>
int64_t scores_shared(const float* const* q, int64_t g, const T* rows, int64_t stride,
                      int64_t n, float scale, float* const* out) {
  alignas(64) float kt[2 * DV * 16 * 16];
  int64_t t = 0;
  while (t + 16 <= n) {
    const int blocks = t + 32 <= n ? 2 : 1;
    for (int i = 0; i < 16 * blocks; ++i)
      if (t + ROWS_AHEAD + i < n) prefetch_row<DV>(rows + (t + ROWS_AHEAD + i) * stride);
    transpose_rows<DV>(rows + t * stride, stride, kt);
    if (blocks == 2) transpose_rows<DV>(rows + (t + 16) * stride, stride, kt + DV * 16 * 16);
    else std::memset(kt + DV * 16 * 16, 0, sizeof(float) * DV * 16 * 16);
    scores_dims_major<DV>(q, g, kt, scale, out, t, blocks);
    t += 16 * blocks;
  }
  return t;
}
#endif

// The first ROWS_AHEAD rows of head h of the next run, fetched while a run is read: the in-run
// prefetches stop at a run's end, and in a churned arena the next run lies elsewhere.
template <typename P>
inline void prefetch_run_start(const RunOf<P>& run, int64_t h, int64_t D) {
#ifdef FEDKV_AVX512
  const char* p = reinterpret_cast<const char*>(run.base + h * run.head_stride);
  constexpr int64_t size = sizeof(P);
  const int64_t rows = std::min(run.n, ROWS_AHEAD), bytes = D * size;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + t * run.row_stride * size + b, _MM_HINT_T0);
#endif
}

// What every KV head of a decode step reads: the rows' queries, the prefix runs they share
// (arena rows of element type P).
template <typename P>
struct Rows {
  torch::Tensor q, out, tail_valid;
  const std::vector<int64_t>& slot;
  const std::vector<RunOf<P>>& pk;
  const std::vector<RunOf<P>>& pv;
  int64_t n_prefix;
};

constexpr int64_t V_CHUNK = 64;  // prefix V rows (16 KiB at dim 64, fp32) kept in L1 for every query

// One KV head's queries (B rows x G, query i = row i / G, group i % G): scores of `sc` rows
// over the shared prefix, each 16-key block read once for all of them (a row-by-row pass read
// the prefix once per row: at 16 rows over a 1,000-token prefix that was most of a step).
template <typename P>
void prefix_scores(const Rows<P>& r, int64_t h, const std::vector<const float*>& qs,
                   const std::vector<float*>& sc, float scale, int64_t D) {
  const int64_t g = static_cast<int64_t>(qs.size());
  std::vector<float*> at(sc.size());
  int64_t j = 0;
  for (size_t ri = 0; ri < r.pk.size(); ++ri) {
    const RunOf<P>& run = r.pk[ri];
    const P* rows = run.base + h * run.head_stride;
    if (ri + 1 < r.pk.size()) prefetch_run_start(r.pk[ri + 1], h, D);
    int64_t done = 0;
#ifdef FEDKV_AVX512
    if (g >= SHARED_MIN_QUERIES) {
      for (int64_t i = 0; i < g; ++i) at[i] = sc[i] + j;
      if (D == 64) done = scores_shared<4>(qs.data(), g, rows, run.row_stride, run.n, scale, at.data());
      if (D == 32) done = scores_shared<2>(qs.data(), g, rows, run.row_stride, run.n, scale, at.data());
    }
#endif
    for (int64_t i = 0; i < g; ++i) at[i] = sc[i] + j + done;
    scores(qs.data(), g, rows + done * run.row_stride, run.row_stride, run.n - done, scale,
           at.data(), D, run.n - done);
    j += run.n;
  }
}

// o[i] += the weights of `live` queries over the prefix V: chunk by chunk, each chunk read once
// for all of them, VALUE_QUERIES queries' sums in registers at a time (each query's additions
// in key order, as one pass over the prefix would make them).
template <typename P>
void prefix_values(const Rows<P>& r, int64_t h, const std::vector<int64_t>& live,
                   const std::vector<float*>& sc, const std::vector<float*>& os, int64_t D) {
  int64_t i = 0;
  for (size_t ri = 0; ri < r.pv.size(); ++ri) {
    const RunOf<P>& run = r.pv[ri];
    const P* base = run.base + h * run.head_stride;
    if (ri + 1 < r.pv.size()) prefetch_run_start(r.pv[ri + 1], h, D);
    for (int64_t c = 0; c < run.n; c += V_CHUNK) {
      const int64_t n = std::min(V_CHUNK, run.n - c);
      const P* rows = base + c * run.row_stride;
      for (size_t l0 = 0; l0 < live.size(); l0 += VALUE_QUERIES) {
        const int64_t ng = std::min<int64_t>(VALUE_QUERIES, live.size() - l0);
        const float* ws[VALUE_QUERIES];
        float* o[VALUE_QUERIES];
        for (int64_t k = 0; k < ng; ++k) ws[k] = sc[live[l0 + k]] + i + c, o[k] = os[live[l0 + k]];
        weighted_rows<VALUE_QUERIES, false>(ws, ng, rows, run.row_stride, n, o, D, run.n - c);
      }
    }
    i += run.n;
  }
}

// A thread's buffers for attend_head, kept across its tasks (a score buffer per task was a
// fresh mmap of its pages each time).
struct Scratch {
  std::vector<float> score;
  std::vector<const float*> qs;
  std::vector<float*> sc, os;
  std::vector<int64_t> n_row, live;
};

// This thread's Scratch, kept between calls: a decode step calls the attention once per layer
// on torch's pool threads, and fresh vectors each time were allocations in every call.
Scratch& thread_scratch() {
  thread_local Scratch w;
  return w;
}

// Scratch's per-query pointers for KV head h's rows b0..b0+nb: query i (row b0 + i / G, group
// i % G) reads q at qs[i], scores into sc[i] (`width` floats) and sums into os[i].
template <typename P>
void point_queries(const Rows<P>& r, int64_t h, int64_t b0, int64_t nb, int64_t width, Scratch& w) {
  const int64_t G = r.q.size(1), B = r.q.size(2), D = r.q.size(3), Q = nb * G;
  const float* qp = r.q.template data_ptr<float>();
  float* op = r.out.template data_ptr<float>();
  w.score.resize(Q * width);
  w.qs.resize(Q), w.sc.resize(Q), w.os.resize(Q), w.n_row.resize(nb), w.live.clear();
  for (int64_t i = 0; i < Q; ++i) {
    const int64_t b = b0 + i / G, g = i % G;
    w.qs[i] = qp + ((h * G + g) * B + b) * D;
    w.os[i] = op + ((h * G + g) * B + b) * D;
    w.sc[i] = w.score.data() + i * width;
  }
}

// Each row's tail scores (after its prefix scores, at column n_prefix), only up to its last
// valid position (w.n_row), then every query's softmax over prefix and tail: the queries left
// with something to attend go to w.live, a query with nothing stays zero.
template <typename T, typename P>
void tail_scores_softmax(const Rows<P>& r, RunOf<T> tk, int64_t tk_slot, int64_t h, int64_t b0,
                         int64_t nb, float scale, Scratch& w) {
  const int64_t G = r.q.size(1), D = r.q.size(3), j = r.n_prefix;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < nb; ++b) {
    const T* kt = tk.base + h * tk.head_stride + r.slot[b0 + b] * tk_slot;
    const bool* ok = r.tail_valid.template data_ptr<bool>() + r.slot[b0 + b] * r.tail_valid.stride(0);
    int64_t n = tk.n;
    while (n > 0 && !ok[n - 1]) --n;
    w.n_row[b] = n;
    float* at[MAX_GROUP];
    for (int64_t g0 = 0; g0 < G; g0 += MAX_GROUP) {
      const int64_t ng = std::min(MAX_GROUP, G - g0);
      for (int64_t k = 0; k < ng; ++k) at[k] = w.sc[b * G + g0 + k] + j;
      scores(w.qs.data() + b * G + g0, ng, kt, tk.row_stride, n, scale, at, D);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* s = w.sc[b * G + g];
      for (int64_t t = 0; t < n; ++t)
        if (!ok[t]) s[j + t] = ninf;
      const float mx = max_of(s, j + n);
      if (mx == ninf) continue;
      const float inv = 1.0f / exp_shift_sum(s, j + n, mx);
      for (int64_t t = 0; t < j + n; ++t) s[t] *= inv;
      w.live.push_back(b * G + g);
    }
  }
}

// Each row's own tail values into its live queries' sums, the row's queries together.
template <typename T, typename P>
void tail_values(const Rows<P>& r, RunOf<T> tv, int64_t tv_slot, int64_t h, int64_t b0, Scratch& w) {
  const int64_t G = r.q.size(1), D = r.q.size(3), j = r.n_prefix;
  for (size_t l0 = 0; l0 < w.live.size();) {
    const int64_t b = w.live[l0] / G;
    const T* vt = tv.base + h * tv.head_stride + r.slot[b0 + b] * tv_slot;
    const float* ws[MAX_GROUP];
    float* o[MAX_GROUP];
    int64_t ng = 0;
    for (; l0 < w.live.size() && w.live[l0] / G == b && ng < MAX_GROUP; ++l0, ++ng)
      ws[ng] = w.sc[w.live[l0]] + j, o[ng] = w.os[w.live[l0]];
    weighted_rows(ws, ng, vt, tv.row_stride, w.n_row[b], o, D);
  }
}

// One KV head's rows b0..b1 of a decode step (see attend_rows).
template <typename T, typename P>
void attend_head(const Rows<P>& r, RunOf<T> tk, RunOf<T> tv, int64_t tk_slot, int64_t tv_slot,
                 int64_t h, int64_t b0, int64_t b1, Scratch& w) {
  const int64_t D = r.q.size(3);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  point_queries(r, h, b0, b1 - b0, r.n_prefix + tk.n, w);
  prefix_scores(r, h, w.qs, w.sc, scale, D);
  tail_scores_softmax(r, tk, tk_slot, h, b0, b1 - b0, scale, w);
  prefix_values(r, h, w.live, w.sc, w.os, D);
  tail_values(r, tv, tv_slot, h, b0, w);
}

// How many parts decode_attention splits each KV head's rows into: whole heads alone leave a
// thread idle for a head's time wherever the threads do not divide the heads (SmolLM2's 3 over
// 2); t / gcd(heads, t) parts per head make the tasks a multiple of the threads, each part
// reading its head's prefix once for its own rows.
int64_t row_parts(int64_t Hk, int64_t B) {
  const int64_t t = std::max(1, at::get_num_threads());
  return std::max<int64_t>(1, std::min(B, t / std::gcd(Hk, t)));
}

constexpr int64_t MIN_CHUNK_ROWS = 128;  // a prefix chunk shorter than this is not split off

// How many chunks of its prefix each KV head of a lone row with no tail is split into
// (flash-decoding, LoneRowAttention: SmolLM2's 3 heads over 2 threads left one idle a third of
// the time): as row_parts, 1 where the threads divide the heads or the prefix is short.
int64_t prefix_chunks(int64_t Hk, int64_t B, int64_t tail_len, int64_t n_prefix,
                      int64_t threads = at::get_num_threads()) {
  const int64_t t = std::max<int64_t>(1, threads), parts = t / std::gcd(Hk, t);
  if (B != 1 || tail_len != 0 || n_prefix < parts * MIN_CHUNK_ROWS) return 1;
  return parts;
}

// The runs' rows at prefix positions [p0, p1), as runs.
template <typename P>
std::vector<RunOf<P>> runs_between(const std::vector<RunOf<P>>& runs, int64_t p0, int64_t p1) {
  std::vector<RunOf<P>> out;
  int64_t at = 0;
  for (const RunOf<P>& run : runs) {
    const int64_t a = std::max(p0, at), b = std::min(p1, at + run.n);
    if (a < b) out.push_back({run.base + (a - at) * run.row_stride, run.head_stride, run.row_stride, b - a});
    at += run.n;
  }
  return out;
}

// One KV head's queries (a lone row's G) over chunk c of the prefix: the scores' maximum m[g],
// their exps' sum l[g] and the exp-weighted sum of the chunk's values o[g * D ...] (not yet
// divided by the sum: LoneRowAttention merges the chunks).
template <typename P>
void attend_chunk(const Rows<P>& r, int64_t h, int64_t c, int64_t chunks, float* o, float* m,
                  float* l, Scratch& w) {
  const int64_t G = r.q.size(1), D = r.q.size(3);
  const int64_t p0 = r.n_prefix * c / chunks, n = r.n_prefix * (c + 1) / chunks - p0;
  const std::vector<RunOf<P>> k = runs_between(r.pk, p0, p0 + n), v = runs_between(r.pv, p0, p0 + n);
  const Rows<P> part{r.q, r.out, r.tail_valid, r.slot, k, v, n};
  point_queries(part, h, 0, 1, n, w);
  for (int64_t g = 0; g < G; ++g) w.os[g] = o + g * D, w.live.push_back(g);  // sums apart
  prefix_scores(part, h, w.qs, w.sc, 1.0f / std::sqrt(static_cast<float>(D)), D);
  for (int64_t g = 0; g < G; ++g) m[g] = max_of(w.sc[g], n), l[g] = exp_shift_sum(w.sc[g], n, m[g]);
  prefix_values(part, h, w.live, w.sc, w.os, D);
}

// Each query's chunk sums (attend_chunk's) merged by their maxima into out [Hk, G, 1, D]
// (zeroed): query (h, g)'s chunk c at h * chunks * G + c * G + g.
void merge_chunks(float* out, int64_t Hk, int64_t G, int64_t D, int64_t chunks, const float* o,
                  const float* m, const float* l) {
  for (int64_t h = 0; h < Hk; ++h)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t first = h * chunks * G + g;  // chunk c of (h, g) at first + c * G
      float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, m[first + c * G]);
      float* dst = out + (h * G + g) * D;
      for (int64_t c = 0; c < chunks; ++c) {
        const float f = std::exp(m[first + c * G] - mx);
        sum += f * l[first + c * G];
        for (int64_t d = 0; d < D; ++d) dst[d] += f * o[(first + c * G) * D + d];
      }
      for (int64_t d = 0; d < D; ++d) dst[d] /= sum;
    }
}

// decode_attention's work, for tails of element type T (fp32 or bf16, read as fp32): per KV
// head and part of its rows, the prefix scores of every query, then each row's tail scores and
// softmax, then the prefix values for every query, then each row's tail values.
template <typename T, typename P>
void attend_rows(const Rows<P>& r, RunOf<T> tk, RunOf<T> tv, int64_t tk_slot, int64_t tv_slot) {
  const int64_t Hk = r.q.size(0), B = r.q.size(2), parts = row_parts(Hk, B);
  if (prefix_chunks(Hk, B, tk.n, r.n_prefix) > 1) {  // a lone row, no tail: LoneRowAttention's
    const int64_t threads = at::get_num_threads();       // tasks on torch's threads
    LoneRowAttention<P> lone(Hk, r.q.size(1), r.q.size(3), r.n_prefix, threads);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) lone.run(t, r.q, r.pk, r.pv);
    });
    return lone.finish(r.out.template data_ptr<float>());
  }
  at::parallel_for(0, Hk * parts, 1, [&](int64_t begin, int64_t end) {
    Scratch& w = thread_scratch();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / parts, part = task % parts;
      attend_head(r, tk, tv, tk_slot, tv_slot, h, B * part / parts, B * (part + 1) / parts, w);
    }
  });
}

}  // namespace

template <typename P>
void attend_decode_into(const torch::Tensor& q, torch::Tensor& out,
                        const std::vector<RunOf<P>>& pk, const std::vector<RunOf<P>>& pv,
                        const torch::Tensor& tail_k, const torch::Tensor& tail_v,
                        const torch::Tensor& tail_valid, const std::vector<int64_t>& slot) {
  int64_t n_prefix = 0;
  for (const RunOf<P>& run : pk) n_prefix += run.n;
  std::fill_n(out.data_ptr<float>(), out.numel(), 0.f);
  const Rows<P> rows{q, out, tail_valid, slot, pk, pv, n_prefix};
  if (tail_k.scalar_type() == torch::kBFloat16)
    attend_rows(rows, run_of<bf16>(tail_k, 0, 2), run_of<bf16>(tail_v, 0, 2), tail_k.stride(1),
                tail_v.stride(1));
  else
    attend_rows(rows, run_of<float>(tail_k, 0, 2), run_of<float>(tail_v, 0, 2), tail_k.stride(1),
                tail_v.stride(1));
}

// decode_attention (below) over runs already checked, or made from checked spans.
template <typename P>
torch::Tensor attend_decode(const torch::Tensor& q, const std::vector<RunOf<P>>& pk,
                            const std::vector<RunOf<P>>& pv, const torch::Tensor& tail_k,
                            const torch::Tensor& tail_v, const torch::Tensor& tail_valid,
                            const std::vector<int64_t>& slot) {
  auto out = torch::empty(q.sizes(), q.options());
  attend_decode_into(q.contiguous(), out, pk, pv, tail_k, tail_v, tail_valid, slot);
  return out;
}

template <typename P>
LoneRowAttention<P>::LoneRowAttention(int64_t kv_heads, int64_t group, int64_t dim,
                                      int64_t n_prefix, int64_t threads)
    : Hk_(kv_heads), G_(group), D_(dim), n_prefix_(n_prefix),
      chunks_(prefix_chunks(kv_heads, 1, 0, n_prefix, threads)) {
  const int64_t tasks = Hk_ * chunks_, used = std::min(std::max<int64_t>(1, threads), tasks);
  per_ = (tasks + used - 1) / used;
  whole_ = torch::empty({Hk_, G_, 1, D_}, torch::kFloat32);  // (attend_chunk's Rows name it too)
  if (chunks_ > 1) o_.resize(tasks * G_ * D_), m_.resize(tasks * G_), l_.resize(tasks * G_);
}

template <typename P>
int64_t LoneRowAttention<P>::last_reader(int64_t h) const {
  return (h * chunks_ + chunks_ - 1) / per_;
}

template <typename P>
void LoneRowAttention<P>::run(int64_t t, const torch::Tensor& q, const std::vector<RunOf<P>>& pk,
                              const std::vector<RunOf<P>>& pv) {
  static const torch::Tensor no_valid = torch::empty({1, 0}, torch::kBool);  // no tail
  static const std::vector<int64_t> no_slot{0};
  const Rows<P> r{q, whole_, no_valid, no_slot, pk, pv, n_prefix_};
  Scratch& w = thread_scratch();
  for (int64_t k = t * per_; k < std::min(Hk_ * chunks_, (t + 1) * per_); ++k) {
    if (chunks_ > 1) {
      float* o = o_.data() + k * G_ * D_;
      std::fill_n(o, G_ * D_, 0.f);
      attend_chunk(r, k / chunks_, k % chunks_, chunks_, o, m_.data() + k * G_, l_.data() + k * G_, w);
    } else {  // whole heads, as attend_rows runs a lone row's below the chunks' length
      std::fill_n(whole_.data_ptr<float>() + k * G_ * D_, G_ * D_, 0.f);
      attend_head(r, RunOf<float>{nullptr, 0, 0, 0}, RunOf<float>{nullptr, 0, 0, 0}, 0, 0, k, 0, 1, w);
    }
  }
}

template <typename P>
void LoneRowAttention<P>::finish(float* out) const {
  if (chunks_ == 1) {
    std::copy_n(whole_.data_ptr<float>(), Hk_ * G_ * D_, out);
    return;
  }
  std::fill_n(out, Hk_ * G_ * D_, 0.f);
  merge_chunks(out, Hk_, G_, D_, chunks_, o_.data(), m_.data(), l_.data());
}

template class LoneRowAttention<float>;
template class LoneRowAttention<bf16>;

template void attend_decode_into<float>(const torch::Tensor&, torch::Tensor&,
                                        const std::vector<RunOf<float>>&,
                                        const std::vector<RunOf<float>>&, const torch::Tensor&,
                                        const torch::Tensor&, const torch::Tensor&,
                                        const std::vector<int64_t>&);
template void attend_decode_into<bf16>(const torch::Tensor&, torch::Tensor&,
                                       const std::vector<RunOf<bf16>>&,
                                       const std::vector<RunOf<bf16>>&, const torch::Tensor&,
                                       const torch::Tensor&, const torch::Tensor&,
                                       const std::vector<int64_t>&);
template torch::Tensor attend_decode<float>(const torch::Tensor&, const std::vector<RunOf<float>>&,
                                           const std::vector<RunOf<float>>&, const torch::Tensor&,
                                           const torch::Tensor&, const torch::Tensor&,
                                           const std::vector<int64_t>&);
template torch::Tensor attend_decode<bf16>(const torch::Tensor&, const std::vector<RunOf<bf16>>&,
                                          const std::vector<RunOf<bf16>>&, const torch::Tensor&,
                                          const torch::Tensor&, const torch::Tensor&,
                                          const std::vector<int64_t>&);

namespace {

// decode_attention's prefix runs, checked, as rows of element type P.
template <typename P>
torch::Tensor attend_prefix_runs(const torch::Tensor& q, const std::vector<torch::Tensor>& prefix_k,
                                 const std::vector<torch::Tensor>& prefix_v,
                                 const torch::Tensor& tail_k, const torch::Tensor& tail_v,
                                 const torch::Tensor& tail_valid, const std::vector<int64_t>& slot) {
  const int64_t Hk = q.size(0), D = q.size(3);
  std::vector<RunOf<P>> pk, pv;
  for (size_t i = 0; i < prefix_k.size(); ++i) {
    TORCH_CHECK(prefix_k[i].dim() == 3 && prefix_k[i].size(0) == Hk && prefix_k[i].size(2) == D &&
                    prefix_k[i].sizes() == prefix_v[i].sizes(),
                "prefix run ", i, " must be [", Hk, ", n, ", D, "], got ", prefix_k[i].sizes());
    pk.push_back(run_of<P>(prefix_k[i], 0, 1));
    pv.push_back(run_of<P>(prefix_v[i], 0, 1));
  }
  return attend_decode(q, pk, pv, tail_k, tail_v, tail_valid, slot);
}

}  // namespace

torch::Tensor decode_attention(const torch::Tensor& q, const std::vector<torch::Tensor>& prefix_k,
                               const std::vector<torch::Tensor>& prefix_v,
                               const torch::Tensor& tail_k, const torch::Tensor& tail_v,
                               const torch::Tensor& tail_valid, const torch::Tensor& slots) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32,
              "q must be float32 [kv_heads, group, rows, dim], got ", q.scalar_type(), " ", q.sizes());
  const int64_t Hk = q.size(0), B = q.size(2), D = q.size(3);
  TORCH_CHECK(prefix_k.size() == prefix_v.size(), "prefix K and V runs differ in number");
  TORCH_CHECK(tail_k.dim() == 4 && tail_k.sizes() == tail_v.sizes() && tail_k.size(0) == Hk &&
                  tail_k.size(3) == D,
              "tails must be [", Hk, ", slots, T, ", D, "], got ", tail_k.sizes(), ", ", tail_v.sizes());
  const int64_t S = tail_k.size(1), T = tail_k.size(2);
  TORCH_CHECK(tail_valid.scalar_type() == torch::kBool && tail_valid.dim() == 2 &&
                  tail_valid.size(0) == S && tail_valid.size(1) == T && tail_valid.stride(1) == 1,
              "tail_valid must be bool [", S, ", ", T, "] with unit stride, got ", tail_valid.sizes());
  std::vector<int64_t> slot(B);
  if (slots.numel() == 0) {
    TORCH_CHECK(B <= S, B, " rows need as many tail slots, got ", S);
    for (int64_t b = 0; b < B; ++b) slot[b] = b;
  } else {
    TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == B, "slots must be int64 [", B, "]");
    auto sc = slots.contiguous();
    for (int64_t b = 0; b < B; ++b) {
      slot[b] = sc.data_ptr<int64_t>()[b];
      TORCH_CHECK(slot[b] >= 0 && slot[b] < S, "slot ", slot[b], " out of range [0, ", S, ")");
    }
  }
  if (!prefix_k.empty() && prefix_k[0].scalar_type() == torch::kBFloat16)
    return attend_prefix_runs<bf16>(q, prefix_k, prefix_v, tail_k, tail_v, tail_valid, slot);
  return attend_prefix_runs<float>(q, prefix_k, prefix_v, tail_k, tail_v, tail_valid, slot);
}


}  // namespace fedkv_decode
