// Fused elementwise kernels of a bf16 Llama decoder layer (node/models/kernels.py builds and
// loads them; node/models/llama.py calls them). Each replaces a chain of eager ATen ops whose
// per-call overhead outweighs the work at decode's few rows. Every intermediate is rounded to
// bf16 where the eager bf16 chain rounds it, so results match the eager path.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FEDKV_AVX512 1
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "decode_attention.h"
#include "vec_math.h"

namespace {

using bf16 = c10::BFloat16;
using fedkv_decode::attend_decode;
using fedkv_decode::RunOf;

inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }

#if defined(FEDKV_AVX512) && defined(__AVX512BF16__)
#define FEDKV_BF16_VEC 1
// 16 bf16 <-> 16 fp32 (exact up; down rounds to nearest even, as c10::BFloat16 does)
inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m256i to_bf16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}
#endif

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) row by row (HF's LlamaRMSNorm in bf16:
// normalized in fp32, rounded, scaled by the bf16 weight).
void norm_rows(const bf16* x, const bf16* w, bf16* out, int64_t rows, int64_t width, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const bf16* xr = x + n * width;
      bf16* o = out + n * width;
      float ss = 0.f;
      int64_t i = 0;
#ifdef FEDKV_BF16_VEC
      __m512 acc = _mm512_setzero_ps();
      for (; i + 16 <= width; i += 16) {
        __m512 v = load16(xr + i);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      ss = _mm512_reduce_add_ps(acc);
#endif
      for (; i < width; ++i) {
        float v = xr[i];
        ss += v * v;
      }
      float r = 1.0f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
      i = 0;
#ifdef FEDKV_BF16_VEC
      const __m512 rv = _mm512_set1_ps(r);
      for (; i + 16 <= width; i += 16)
        store16(o + i, _mm512_mul_ps(load16(w + i), round16(_mm512_mul_ps(load16(xr + i), rv))));
#endif
      for (; i < width; ++i)
        o[i] = bf16(static_cast<float>(w[i]) * round_bf16(static_cast<float>(xr[i]) * r));
    }
  });
}

// A norm's weight for rows `width` wide.
void check_norm_weight(const torch::Tensor& w, int64_t width) {
  check_bf16(w, "weight");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == width && w.is_contiguous(),
              "weight must be contiguous [", width, "], got ", w.sizes());
}

void check_norm(const torch::Tensor& x, const torch::Tensor& w) {
  check_bf16(x, "x");
  check_norm_weight(w, x.size(-1));
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_norm(x, w);
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  int64_t width = xc.size(-1);
  norm_rows(xc.data_ptr<bf16>(), w.data_ptr<bf16>(), out.data_ptr<bf16>(), xc.numel() / width,
            width, eps);
  return out;
}

// x = bf16(x + y) in place over `rows` rows `width` wide, then out = their norm_rows.
void add_norm_rows(bf16* x, const bf16* y, const bf16* w, bf16* out, int64_t rows,
                   int64_t width, double eps) {
  at::parallel_for(0, rows * width, 4096, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#ifdef FEDKV_BF16_VEC
    for (; i + 16 <= end; i += 16) store16(x + i, _mm512_add_ps(load16(x + i), load16(y + i)));
#endif
    for (; i < end; ++i) x[i] = bf16(static_cast<float>(x[i]) + static_cast<float>(y[i]));
  });
  norm_rows(x, w, out, rows, width, eps);
}

// x = bf16(x + y) in place (the residual stream), then rms_norm(x): the add that ends one
// sublayer and the norm that starts the next, in one pass.
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& w,
                            double eps) {
  check_norm(x, w);
  check_bf16(y, "y");
  TORCH_CHECK(x.is_contiguous(), "x (updated in place) must be contiguous");
  TORCH_CHECK(x.sizes() == y.sizes(), "x ", x.sizes(), " and y ", y.sizes(), " differ");
  auto yc = y.contiguous();
  auto out = torch::empty_like(x);
  const int64_t width = x.size(-1);
  add_norm_rows(x.data_ptr<bf16>(), yc.data_ptr<bf16>(), w.data_ptr<bf16>(), out.data_ptr<bf16>(),
                x.numel() / width, width, eps);
  return out;
}

// Query heads that group over the KV heads, and a head size RoPE can rotate in halves.
void check_heads(int64_t heads, int64_t kv_heads, int64_t dim) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && dim % 2 == 0,
              "heads ", heads, " must group over kv_heads ", kv_heads, " and dim ", dim, " be even");
}

template <typename out_t>
void rope_split_impl(const bf16* y, const bf16* cos, const bf16* sin, out_t* q, out_t* k,
                     out_t* v, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const bf16* row = y + n * width;
      const bf16* c = cos + n * dim;
      const bf16* s = sin + n * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const bf16* x = row + h * dim;
        // q [kv_heads, group, rows, dim] is [heads, rows, dim]: query head h at h * rows
        out_t* o = h < heads ? q + (h * rows + n) * dim : k + ((h - heads) * rows + n) * dim;
        int64_t i = 0;
#ifdef FEDKV_BF16_VEC
        if (half % 16 == 0) {  // rotate-half in 16-lane pieces: lo gets -hi * sin, hi gets lo * sin
          for (; i < half; i += 16) {
            __m512 lo = load16(x + i), hi = load16(x + half + i);
            __m512 c_lo = load16(c + i), s_lo = load16(s + i);
            __m512 c_hi = load16(c + half + i), s_hi = load16(s + half + i);
            const __m512 neg_hi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
            store16(o + i, round16(_mm512_add_ps(round16(_mm512_mul_ps(lo, c_lo)),
                                                 round16(_mm512_mul_ps(neg_hi, s_lo)))));
            store16(o + half + i, round16(_mm512_add_ps(round16(_mm512_mul_ps(hi, c_hi)),
                                                        round16(_mm512_mul_ps(lo, s_hi)))));
          }
          i = dim;
        }
#endif
        for (; i < dim; ++i) {
          float rot = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
          o[i] = static_cast<out_t>(round_bf16(round_bf16(static_cast<float>(x[i]) * c[i]) +
                                               round_bf16(rot * static_cast<float>(s[i]))));
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const bf16* x = row + (heads + kv_heads + h) * dim;
        out_t* o = v + (h * rows + n) * dim;
        for (int64_t i = 0; i < dim; ++i) o[i] = static_cast<out_t>(static_cast<float>(x[i]));
      }
    }
  });
}

// y [rows, (heads + 2 kv_heads) * dim], the fused q/k/v projection; cos, sin [rows, dim] ->
// q [kv_heads, heads / kv_heads, rows, dim] and k, v [kv_heads, rows, dim], q and k rotated
// (HF's rotate-half RoPE in bf16), all in `dtype` (float32 or bfloat16; exact either way).
std::vector<torch::Tensor> rope_split(const torch::Tensor& y, const torch::Tensor& cos,
                                      const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
                                      int64_t dim, c10::ScalarType dtype) {
  check_bf16(y, "y");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  check_heads(heads, kv_heads, dim);
  TORCH_CHECK(y.dim() == 2 && y.size(1) == (heads + 2 * kv_heads) * dim, "y must be [rows, ",
              (heads + 2 * kv_heads) * dim, "], got ", y.sizes());
  int64_t rows = y.size(0);
  TORCH_CHECK(cos.sizes() == torch::IntArrayRef({rows, dim}) && sin.sizes() == cos.sizes(),
              "cos and sin must be [", rows, ", ", dim, "], got ", cos.sizes(), ", ", sin.sizes());
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "dtype must be float32 or bfloat16, got ", dtype);
  auto yc = y.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  auto opt = torch::TensorOptions().dtype(dtype);
  auto q = torch::empty({kv_heads, heads / kv_heads, rows, dim}, opt);
  auto k = torch::empty({kv_heads, rows, dim}, opt), v = torch::empty({kv_heads, rows, dim}, opt);
  if (dtype == torch::kFloat32)
    rope_split_impl<float>(yc.data_ptr<bf16>(), cc.data_ptr<bf16>(), sc.data_ptr<bf16>(),
                           q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), rows,
                           heads, kv_heads, dim);
  else
    rope_split_impl<bf16>(yc.data_ptr<bf16>(), cc.data_ptr<bf16>(), sc.data_ptr<bf16>(),
                          q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), rows,
                          heads, kv_heads, dim);
  return {q, k, v};
}

template <typename in_t>
void merge_impl(const in_t* a, bf16* out, int64_t heads, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < dim; ++i)
          out[(n * heads + h) * dim + i] = bf16(static_cast<float>(a[(h * rows + n) * dim + i]));
  });
}

// attention's output a [kv_heads, group, rows, dim] (float32 or bfloat16) -> bf16
// [rows, heads * dim], the o_proj input.
torch::Tensor merge_heads(const torch::Tensor& a) {
  TORCH_CHECK(a.dim() == 4, "a must be [kv_heads, group, rows, dim], got ", a.sizes());
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 || a.scalar_type() == torch::kBFloat16,
              "a must be float32 or bfloat16, got ", a.scalar_type());
  auto ac = a.contiguous();
  int64_t heads = ac.size(0) * ac.size(1), rows = ac.size(2), dim = ac.size(3);
  auto out = torch::empty({rows, heads * dim}, torch::TensorOptions().dtype(torch::kBFloat16));
  if (ac.scalar_type() == torch::kFloat32)
    merge_impl<float>(ac.data_ptr<float>(), out.data_ptr<bf16>(), heads, rows, dim);
  else
    merge_impl<bf16>(ac.data_ptr<bf16>(), out.data_ptr<bf16>(), heads, rows, dim);
  return out;
}

#ifdef FEDKV_AVX512
using fedkv_vec::exp16;
#endif

// g [rows, 2 m] (gate, then up) -> o = bf16(bf16(silu(gate)) * up) [rows, m]: SwiGLU as eager
// bf16 computes it (silu rounded, then the product rounded).
void silu_mul_rows(const bf16* g, bf16* o, int64_t rows, int64_t m) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const bf16* gate = g + n * 2 * m;
      const bf16* up = gate + m;
      bf16* on = o + n * m;
      int64_t i = 0;
#ifdef FEDKV_BF16_VEC
      const __m512 one = _mm512_set1_ps(1.0f);
      for (; i + 16 <= m; i += 16) {
        __m512 a = load16(gate + i);
        __m512 silu = _mm512_div_ps(a, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
        store16(on + i, _mm512_mul_ps(round16(silu), load16(up + i)));
      }
#endif
      for (; i < m; ++i) {
        float a = gate[i];
        on[i] = bf16(round_bf16(a / (1.f + std::exp(-a))) * static_cast<float>(up[i]));
      }
    }
  });
}

// gate_up [rows, 2 m] -> silu_mul_rows of it [rows, m].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 m], got ", gate_up.sizes());
  auto gc = gate_up.contiguous();
  const int64_t rows = gc.size(0), m = gc.size(1) / 2;
  auto out = torch::empty({rows, m}, gc.options());
  silu_mul_rows(gc.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, m);
  return out;
}

// How far ahead of the rows read the weights are fetched: far enough to keep as many lines in
// flight as one core's memory bandwidth needs (experiments.int8_rows times it).
constexpr int64_t PREFETCH_BYTES = 8192;
// ... and how: non-temporal, as data read once a step, so the stream displaces less of what
// else the step reads (the K/V it attends, the activations, the interpreter's objects) than
// fetching into L2 did (docs/real-llm.md: bench_llm before and after).
#ifdef FEDKV_AVX512
constexpr auto WEIGHT_HINT = _MM_HINT_NTA;
#endif

// out_t: bf16, or fp32 holding the bf16 value (the head's logits, returned in fp32)
template <int R, int MR, typename out_t>
void int8_block(const int8_t* q, const float* x, const float* scale, out_t* y, int64_t o,
                int64_t m0, int64_t K, int64_t N) {
  float acc[R][MR] = {};
  int64_t k = 0;
#ifdef FEDKV_AVX512
  __m512 v[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) v[r][m] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(q + o * K) + PREFETCH_BYTES;
  for (; k + 16 <= K; k += 16) {
    for (int r = 0; r < R; r += 4) _mm_prefetch(ahead + (k / 16) * 64 + r * 16, WEIGHT_HINT);
    __m512 w[R];
    for (int r = 0; r < R; ++r)
      w[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (o + r) * K + k))));
    for (int m = 0; m < MR; ++m) {
      __m512 xv = _mm512_loadu_ps(x + (m0 + m) * K + k);
      for (int r = 0; r < R; ++r) v[r][m] = _mm512_fmadd_ps(w[r], xv, v[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_reduce_add_ps(v[r][m]);
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MR; ++m)
        acc[r][m] += static_cast<float>(q[(o + r) * K + k]) * x[(m0 + m) * K + k];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) y[(m0 + m) * N + o + r] = static_cast<out_t>(bf16(acc[r][m] * scale[o + r]));
}

template <int R, typename out_t>
void int8_rows(const int8_t* q, const float* x, const float* scale, out_t* y, int64_t o,
               int64_t M, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) int8_block<R, 4, out_t>(q, x, scale, y, o, m, K, N);
  switch (M - m) {
    case 3: int8_block<R, 3, out_t>(q, x, scale, y, o, m, K, N); break;
    case 2: int8_block<R, 2, out_t>(q, x, scale, y, o, m, K, N); break;
    case 1: int8_block<R, 1, out_t>(q, x, scale, y, o, m, K, N); break;
    default: break;
  }
}

// A read of every byte of `buf` (contiguous), the way int8_linear reads its codes: 64-byte
// loads, fetched PREFETCH_BYTES ahead, split over torch's threads. Returns a sum of the bytes
// (so the read is not elided). bench_llm times it as the read bandwidth a decode step's weight
// stream can reach: torch's own reductions prefetch nothing and read slower than the products.
int64_t read_stream(const torch::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous(), "buf must be contiguous");
  const int8_t* p = reinterpret_cast<const int8_t*>(buf.data_ptr());
  const int64_t n = buf.numel() * buf.element_size(), lines = n / 64;
  std::vector<int64_t> part(static_cast<size_t>(std::max(1, at::get_num_threads())), 0);
  at::parallel_for(0, lines, 1024, [&](int64_t begin, int64_t end) {
    int64_t total = 0;
    int64_t i = begin;
#ifdef FEDKV_AVX512
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    for (; i + 4 <= end; i += 4) {
      for (int j = 0; j < 4; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(p + (i + j) * 64) + PREFETCH_BYTES, WEIGHT_HINT);
        acc[j] = _mm512_add_epi64(acc[j], _mm512_sad_epu8(_mm512_loadu_si512(p + (i + j) * 64),
                                                          _mm512_setzero_si512()));
      }
    }
    for (int j = 0; j < 4; ++j) total += _mm512_reduce_add_epi64(acc[j]);
#endif
    for (int64_t b = i * 64; b < end * 64; ++b) total += static_cast<uint8_t>(p[b]);
    part[at::get_thread_num()] += total;
  });
  int64_t total = std::accumulate(part.begin(), part.end(), int64_t{0});
  for (int64_t b = lines * 64; b < n; ++b) total += static_cast<uint8_t>(p[b]);
  return total;
}

// Codes and their per-row scales, whatever multiplies them.
void check_int8_weight(const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(),
              "q must be contiguous int8 [out, in], got ", q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.dim() == 1 &&
                  scale.size(0) == q.size(0) && scale.is_contiguous(),
              "scale must be contiguous float32 [", q.size(0), "], got ", scale.scalar_type(),
              " ", scale.sizes());
}

void check_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  check_bf16(x, "x");
  check_int8_weight(q, scale);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == q.size(1), "x must be [rows, ", q.size(1), "], got ",
              x.sizes());
}

// Weight-only int8 product of a few rows: x bf16 [M, K] (contiguous), q int8 [N, K], scale
// fp32 [N] -> y bf16 [M, N]. Reads each weight byte once per call (memory-bound at decode's
// few rows). x's rows are widened to fp32 once, into `xf` (the caller's buffer, grown to
// M * K floats), for every row block.
struct Int8Parts {
  const int8_t* q;
  const float *scale, *x;
  int64_t M, K, N;
  Int8Parts(const torch::Tensor& x_in, const torch::Tensor& q_in, const torch::Tensor& s,
            std::vector<float>& xf)
      : q(q_in.data_ptr<int8_t>()), scale(s.data_ptr<float>()), M(x_in.size(0)),
        K(q_in.size(1)), N(q_in.size(0)) {
    const bf16* xb = x_in.data_ptr<bf16>();
    xf.resize(std::max<size_t>(xf.size(), M * K));
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xb[i]);
    x = xf.data();
  }
  int64_t blocks() const { return N / 4; }
  // y's columns of blocks [b0, b1) (4 weight rows each), and with `tail` the rows past the last
  // whole block, on the calling thread
  template <typename out_t>
  void rows(out_t* y, int64_t b0, int64_t b1, bool tail) const {
    for (int64_t b = b0; b < b1; ++b) int8_rows<4>(q, x, scale, y, b * 4, M, K, N);
    if (tail)
      for (int64_t o = blocks() * 4; o < N; ++o) int8_rows<1>(q, x, scale, y, o, M, K, N);
  }
};

void int8_product(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale, bf16* y) {
  std::vector<float> xf;
  const Int8Parts w(x, q, scale, xf);
  at::parallel_for(0, w.blocks(), 16, [&](int64_t begin, int64_t end) { w.rows(y, begin, end, false); });
  w.rows(y, 0, 0, true);
}

// Thread t of T's share of int8_product (its blocks of an even split, the last thread also the
// tail rows), on the calling thread; x widened into the thread's own buffer.
template <typename out_t>
void int8_share(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                out_t* y, int64_t t, int64_t T) {
  thread_local std::vector<float> xf;
  const Int8Parts w(x, q, scale, xf);
  w.rows(y, w.blocks() * t / T, w.blocks() * (t + 1) / T, t == T - 1);
}

// int8_product of checked tensors, its result allocated.
torch::Tensor int8_linear(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& scale) {
  auto x = x_in.contiguous();
  check_int8(x, q, scale);
  auto y = torch::empty({x.size(0), q.size(0)}, x.options());
  int8_product(x, q, scale, y.data_ptr<bf16>());
  return y;
}

// One weight row's dot products with M rows of x, its K bf16 weights read once, front to back,
// PREFETCH_BYTES ahead: on AVX-512 BF16, vdpbf16ps multiplies bf16 pairs exactly and adds them
// to fp32 sums (two per x row, for two chains in flight); a masked load takes K's last < 32.
template <int M, typename out_t>
void bf16_row(const bf16* w, const bf16* x, out_t* y, int64_t K, int64_t N) {
#ifdef FEDKV_BF16_VEC
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(w) + PREFETCH_BYTES;
  auto dot = [&](int c, int64_t k, __m512i wv) {
    for (int m = 0; m < M; ++m)
      acc[m][c] = _mm512_dpbf16_ps(acc[m][c], reinterpret_cast<__m512bh>(wv),
                                   reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + m * K + k)));
  };
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    _mm_prefetch(ahead + 2 * k, WEIGHT_HINT);
    _mm_prefetch(ahead + 2 * k + 64, WEIGHT_HINT);
    dot(0, k, _mm512_loadu_si512(w + k));
    dot(1, k + 32, _mm512_loadu_si512(w + k + 32));
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : (__mmask32{1} << (K - k)) - 1;
    __m512i wv = _mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < M; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], reinterpret_cast<__m512bh>(wv),
                                   reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, x + m * K + k)));
  }
  for (int m = 0; m < M; ++m)
    y[m * N] = static_cast<out_t>(bf16(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]))));
#else
  for (int m = 0; m < M; ++m) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(w[k]) * static_cast<float>(x[m * K + k]);
    y[m * N] = static_cast<out_t>(bf16(acc));
  }
#endif
}

void check_bf16_weight(const torch::Tensor& w) {
  check_bf16(w, "w");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w must be contiguous [out, in], got ", w.sizes());
}

void check_bf16_product(const torch::Tensor& x, const torch::Tensor& w) {
  check_bf16(x, "x");
  check_bf16_weight(w);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && x.is_contiguous() && x.size(0) <= 4,
              "x must be contiguous [1 to 4 rows, ", w.size(1), "], got ", x.sizes());
}

// bf16 product of a few rows: x bf16 [M <= 4, K] and the weights of 1 to 3 parts (ws, each
// bf16 [N_j, K] contiguous: q, k, v side by side) -> y bf16 [M, sum N_j], summed in fp32 and
// rounded once, as oneDNN's bf16 GEMM does. Memory-bound at decode's rows: each weight row is
// read once for all M, and each thread reads its rows' span front to back (one stream where
// the parts lie end to end, as projection.RowStack lays them).
struct Bf16Parts {
  const bf16* w[3];
  int64_t first[4];  // part j's rows are y's columns first[j] .. first[j + 1]
  int64_t K, N;
  Bf16Parts(const torch::Tensor* ws, int parts) : K(ws[0].size(1)), N(0) {
    for (int j = 0; j < parts; ++j) {
      first[j] = N;
      N += ws[j].size(0);
      w[j] = ws[j].data_ptr<bf16>();
    }
    first[parts] = N;
  }
  // y's columns [begin, end) for x's M rows, on the calling thread (out_t: as bf16_row's)
  template <typename out_t>
  void rows(const bf16* xp, int64_t M, out_t* y, int64_t begin, int64_t end) const {
    int j = 0;
    for (int64_t n = begin; n < end; ++n) {
      while (n >= first[j + 1]) ++j;
      const bf16* row = w[j] + (n - first[j]) * K;
      switch (M) {
        case 4: bf16_row<4>(row, xp, y + n, K, N); break;
        case 3: bf16_row<3>(row, xp, y + n, K, N); break;
        case 2: bf16_row<2>(row, xp, y + n, K, N); break;
        default: bf16_row<1>(row, xp, y + n, K, N); break;
      }
    }
  }
};

void bf16_product(const torch::Tensor& x, const torch::Tensor* ws, int parts, bf16* y) {
  const Bf16Parts w(ws, parts);
  at::parallel_for(0, w.N, 16, [&](int64_t begin, int64_t end) {
    w.rows(x.data_ptr<bf16>(), x.size(0), y, begin, end);
  });
}

// Thread t of T's share of bf16_product (its rows of an even split), on the calling thread.
template <typename out_t>
void bf16_share(const torch::Tensor& x, const torch::Tensor* ws, int parts, out_t* y, int64_t t,
                int64_t T) {
  const Bf16Parts w(ws, parts);
  w.rows(x.data_ptr<bf16>(), x.size(0), y, w.N * t / T, w.N * (t + 1) / T);
}

// bf16_product of checked tensors, its result allocated.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& w) {
  check_bf16_product(x, w);
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) > 0) bf16_product(x, &w, 1, y.data_ptr<bf16>());
  return y;
}

// A layer's weights as decode_layers_* takes them, by format: its two norms and its four
// products (q/k/v, o, gate/up, down) into a bf16 row.
// Weight-only int8 (decode_step.PER_LAYER["int8"]): input norm, q/k/v codes and scales, o codes
// and scales, post-attention norm, gate/up codes and scales, down codes and scales.
struct Int8Layer {
  static constexpr int64_t TENSORS = 10;
  static constexpr int NORM[2] = {0, 5}, PRODUCT[4] = {1, 3, 6, 8};
  static void check(const torch::Tensor* lw, int p) {
    check_int8_weight(lw[PRODUCT[p]], lw[PRODUCT[p] + 1]);
  }
  static int64_t out(const torch::Tensor* lw, int p) { return lw[PRODUCT[p]].size(0); }
  static int64_t in(const torch::Tensor* lw, int p) { return lw[PRODUCT[p]].size(1); }
  // thread t of T's share of product p
  static void share(const torch::Tensor* lw, int p, const torch::Tensor& in, bf16* y, int64_t t, int64_t T) {
    int8_share(in, lw[PRODUCT[p]], lw[PRODUCT[p] + 1], y, t, T);
  }
  static constexpr size_t HEAD_TENSORS = 2;  // the output head: codes, scales
  static void check_head(const std::vector<torch::Tensor>& head) { check_int8_weight(head[0], head[1]); }
  static void head_share(const std::vector<torch::Tensor>& head, const torch::Tensor& in, float* y,
                         int64_t t, int64_t T) {
    int8_share(in, head[0], head[1], y, t, T);
  }
};

// bf16 (decode_step.PER_LAYER["bfloat16"]): the parameters themselves, so a write into them or
// new storage is read as it is: input norm, q, k, v, o, post-attention norm, gate, up, down.
struct Bf16Layer {
  static constexpr int64_t TENSORS = 9;
  static constexpr int NORM[2] = {0, 5}, PRODUCT[4] = {1, 4, 6, 8}, PARTS[4] = {3, 1, 2, 1};
  static void check(const torch::Tensor* lw, int p) {
    for (int j = 0; j < PARTS[p]; ++j) {
      check_bf16_weight(lw[PRODUCT[p] + j]);
      TORCH_CHECK(lw[PRODUCT[p] + j].size(1) == lw[PRODUCT[p]].size(1),
                  "the parts of a product must take inputs of one width");
    }
  }
  static int64_t out(const torch::Tensor* lw, int p) {
    int64_t n = 0;
    for (int j = 0; j < PARTS[p]; ++j) n += lw[PRODUCT[p] + j].size(0);
    return n;
  }
  static int64_t in(const torch::Tensor* lw, int p) { return lw[PRODUCT[p]].size(1); }
  static void share(const torch::Tensor* lw, int p, const torch::Tensor& in, bf16* y, int64_t t, int64_t T) {
    bf16_share(in, lw + PRODUCT[p], PARTS[p], y, t, T);
  }
  static constexpr size_t HEAD_TENSORS = 1;  // the output head's weight
  static void check_head(const std::vector<torch::Tensor>& head) { check_bf16_weight(head[0]); }
  static void head_share(const std::vector<torch::Tensor>& head, const torch::Tensor& in, float* y,
                         int64_t t, int64_t T) {
    bf16_share(in, head.data(), 1, y, t, T);
  }
};

// The calling thread's number in the OpenMP region it runs in, and the region's thread count
// (0 and 1 in a build without OpenMP, SERIAL_FLAGS: the region's body runs once).
inline int64_t region_thread() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}
inline int64_t region_threads() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// KV head hk's k and v of the token (fp32 [kv_heads * dim] each, bf16 values) into row `pos` of
// one layer's K/V at `base` in the arena `kv` [layers, 2, kv_heads, tokens, dim]: exact in fp32
// or bf16.
template <typename P>
void store_head_kv(const torch::Tensor& kv, P* base, int64_t pos, const float* k, const float* v,
                   int64_t hk) {
  const int64_t dim = kv.size(4);
  for (int64_t kvi = 0; kvi < 2; ++kvi) {
    P* dst = base + kvi * kv.stride(1) + hk * kv.stride(2) + pos * kv.stride(3);
    for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<P>((kvi == 0 ? k : v)[hk * dim + i]);
  }
}

// One thread's rows between decode_layers' products: its own copy of the residual stream, the
// normed row, the rotated q/k/v, the attention's output, the merged heads and SwiGLU's output.
// Every thread computes these row ops itself (each a few hundred values) from the products'
// shared outputs: one thread doing them while the others waited cost two barriers a sublayer.
struct ThreadRows {
  torch::Tensor x, h, q, k, v, att, merged, act;
  ThreadRows(const torch::Tensor& x0, const torch::Tensor& h0, int64_t heads, int64_t kv_heads,
             int64_t dim, int64_t inter) {
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    x = x0.clone(), h = h0.clone();
    q = torch::empty({kv_heads, heads / kv_heads, 1, dim}, f32), att = torch::empty_like(q);
    k = torch::empty({kv_heads * dim}, f32), v = torch::empty({kv_heads * dim}, f32);
    merged = torch::empty({1, heads * dim}, x0.options()), act = torch::empty({1, inter}, x0.options());
  }
};

// decode_layers' layers over an arena of element type P, weights in format F (checked once, by
// check_layer_weights): the token's K/V (bf16 values, rope_split rounds them) go to row `pos`
// exactly in either type. The whole step is one parallel region on torch's threads: each
// product's rows are split over them, the attention's tasks too, and a barrier after each
// orders it on the next. The row ops between run on every thread from the products' outputs
// into its own ThreadRows (the same values on each), and the token's K/V for a KV head is
// written by the thread that attends that head's last rows (LoneRowAttention::last_reader; the
// spans end at `pos`), so a sublayer costs one barrier. An at::parallel_for per product, each a
// fork and join of the threads, read the weights slower (experiments.bench_llm's fraction).
template <typename P, typename F>
torch::Tensor decode_layers_impl(torch::Tensor x, const std::vector<torch::Tensor>& w,
                                 const torch::Tensor& final_norm, const bf16* cos,
                                 const bf16* sin, const torch::Tensor& kv, int64_t pos,
                                 const std::vector<std::pair<int64_t, int64_t>>& spans,
                                 int64_t heads, int64_t kv_heads, int64_t dim, double eps,
                                 const std::vector<torch::Tensor>& head) {
  const int64_t L = kv.size(0), E = x.size(1), inter = F::out(w.data(), 2) / 2;
  int64_t n_prefix = 0;
  for (const auto& span : spans) n_prefix += span.second;
  auto h = torch::empty({1, E}, x.options());
  norm_rows(x.data_ptr<bf16>(), w[F::NORM[0]].template data_ptr<bf16>(), h.data_ptr<bf16>(), 1, E, eps);
  torch::Tensor ys[4];  // each of a layer's four products' output, reused by every layer
  for (int p = 0; p < 4; ++p) ys[p] = torch::empty({1, F::out(w.data(), p)}, x.options());
  // the head's logits: each its bf16 product (as the per-kernel head rounds it), held in fp32
  torch::Tensor y = head.empty() ? h : torch::empty({1, head[0].size(0)}, torch::kFloat32);
  const int64_t threads = std::max(1, at::get_num_threads());
  std::vector<ThreadRows> rows;
  rows.reserve(threads);
  for (int64_t t = 0; t < threads; ++t) rows.emplace_back(x, h, heads, kv_heads, dim, inter);
  std::optional<fedkv_decode::LoneRowAttention<P>> attention;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = region_thread(), T = region_threads();
    ThreadRows& my = rows[t];
    std::vector<RunOf<P>> pk(spans.size()), pv(spans.size());  // this thread's, per layer its base
#pragma omp single
    attention.emplace(kv_heads, heads / kv_heads, dim, n_prefix, T);
    auto product = [&](const torch::Tensor* lw, int p, const torch::Tensor& in) {
      F::share(lw, p, in, ys[p].data_ptr<bf16>(), t, T);
#pragma omp barrier
      return ys[p].data_ptr<bf16>();
    };
    bf16* xp = my.x.data_ptr<bf16>();
    for (int64_t l = 0; l < L; ++l) {
      const torch::Tensor* lw = w.data() + F::TENSORS * l;
      const bf16* qkv = product(lw, 0, my.h);
      float *q = my.q.data_ptr<float>(), *k = my.k.data_ptr<float>(), *v = my.v.data_ptr<float>();
      rope_split_impl<float>(qkv, cos, sin, q, k, v, 1, heads, kv_heads, dim);
      P* base = kv.data_ptr<P>() + l * kv.stride(0);
      for (int64_t hk = 0; hk < kv_heads; ++hk)
        if (attention->last_reader(hk) == t) store_head_kv(kv, base, pos, k, v, hk);
      for (size_t r = 0; r < spans.size(); ++r) {
        pk[r] = RunOf<P>{base + spans[r].first * kv.stride(3), kv.stride(2), kv.stride(3), spans[r].second};
        pv[r] = RunOf<P>{pk[r].base + kv.stride(1), kv.stride(2), kv.stride(3), spans[r].second};
      }
      attention->run(t, my.q, pk, pv);
#pragma omp barrier
      attention->finish(my.att.data_ptr<float>());
      merge_impl<float>(my.att.data_ptr<float>(), my.merged.data_ptr<bf16>(), heads, 1, dim);
      const bf16* o = product(lw, 1, my.merged);
      add_norm_rows(xp, o, lw[F::NORM[1]].template data_ptr<bf16>(), my.h.data_ptr<bf16>(), 1, E, eps);
      const bf16* gate_up = product(lw, 2, my.h);
      silu_mul_rows(gate_up, my.act.data_ptr<bf16>(), 1, inter);
      const bf16* down = product(lw, 3, my.act);
      const torch::Tensor& next_norm = l + 1 < L ? w[F::TENSORS * (l + 1) + F::NORM[0]] : final_norm;
      add_norm_rows(xp, down, next_norm.data_ptr<bf16>(), my.h.data_ptr<bf16>(), 1, E, eps);
    }
    if (!head.empty()) F::head_share(head, my.h, y.data_ptr<float>(), t, T);
    else if (t == 0) std::memcpy(h.data_ptr<bf16>(), my.h.data_ptr<bf16>(), E * sizeof(bf16));
  }
  return y;
}

// Every layer's weights in F's format and of shapes that chain (hidden -> q/k/v -> o -> hidden
// -> gate/up -> down -> hidden), checked before the first layer runs: a bad tensor in a late
// layer must not leave the early layers' K/V written.
template <typename F>
void check_layer_weights(const std::vector<torch::Tensor>& w, const torch::Tensor& final_norm,
                         int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim) {
  check_norm_weight(final_norm, hidden);
  for (size_t l = 0; l < w.size() / F::TENSORS; ++l) {
    const torch::Tensor* lw = w.data() + F::TENSORS * l;
    for (int i : F::NORM) check_norm_weight(lw[i], hidden);
    for (int p = 0; p < 4; ++p) F::check(lw, p);
    const int64_t ins[4] = {hidden, heads * dim, hidden, F::out(lw, 2) / 2};
    TORCH_CHECK(F::out(lw, 0) == (heads + 2 * kv_heads) * dim && F::out(lw, 1) == hidden &&
                    F::out(lw, 3) == hidden && F::out(lw, 2) % 2 == 0 && F::in(lw, 0) == ins[0] &&
                    F::in(lw, 1) == ins[1] && F::in(lw, 2) == ins[2] && F::in(lw, 3) == ins[3],
                "layer ", l, "'s weights do not chain: q/k/v ", F::out(lw, 0), " x ", F::in(lw, 0),
                ", o ", F::out(lw, 1), " x ", F::in(lw, 1), ", gate/up ", F::out(lw, 2), " x ",
                F::in(lw, 2), ", down ", F::out(lw, 3), " x ", F::in(lw, 3), " (hidden ", hidden, ")");
  }
}

// A list of tensors converted from Python once and kept: decode_step holds a model's ~270
// weights (and its head) in one, so a step's call does not convert the list again -- taking and
// dropping a reference to each tensor, their objects cold after the weights streamed. A Python
// list converts implicitly (the tests' calls).
struct TensorList {
  std::vector<torch::Tensor> tensors;
};

// One session's one-token decode through every layer: what LlamaModel._hidden's fused form
// does for a lone token, without a return to Python between the kernels
// (node/models/decode_step.py). F: the weights' format (Int8Layer, Bf16Layer).
//   embed bf16 [vocab, hidden], the embedding table; token: the row of it embedding the token
//      (copied: the residual stream);
//   w: per layer F::TENSORS tensors in F's order;
//   final_norm: the model's last norm; cos, sin bf16 [>= position + 1, dim], the rotary tables,
//      and `position` the token's row of them;
//   kv: the arena's K/V, fp32 or bf16 [layers, 2, kv_heads, arena tokens, dim]; pos: the arena
//      row the token's K/V go to; spans: (start, length) of each of the context's runs
//      in the arena, the new token's row included;
//   head: the output head in F's format (F::HEAD_TENSORS tensors), or none
// -> the head's fp32 logits [1, vocab] (each its bf16 product, as the per-kernel head rounds
//    it), or without a head the final-normed bf16 [1, hidden].
template <typename F>
torch::Tensor decode_layers(const torch::Tensor& embed, int64_t token, const TensorList& w_list,
                            const torch::Tensor& final_norm, const torch::Tensor& cos,
                            const torch::Tensor& sin, int64_t position, const torch::Tensor& kv,
                            int64_t pos, const std::vector<std::pair<int64_t, int64_t>>& spans,
                            int64_t heads, int64_t kv_heads, int64_t dim, double eps,
                            const TensorList& head_list) {
  const std::vector<torch::Tensor>& w = w_list.tensors;
  const std::vector<torch::Tensor>& head = head_list.tensors;
  const bool bf16_arena = kv.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((kv.scalar_type() == torch::kFloat32 || bf16_arena) && kv.dim() == 5 &&
                  kv.size(1) == 2 && kv.size(2) == kv_heads && kv.size(4) == dim && kv.stride(4) == 1,
              "kv must be float32 or bfloat16 [layers, 2, ", kv_heads, ", tokens, ", dim, "], got ",
              kv.scalar_type(), " ", kv.sizes());
  const int64_t L = kv.size(0), cap = kv.size(3);
  TORCH_CHECK(pos >= 0 && pos < cap, "pos ", pos, " outside the arena's ", cap, " rows");
  TORCH_CHECK(static_cast<int64_t>(w.size()) == F::TENSORS * L, "w must hold ", F::TENSORS,
              " tensors per layer (", F::TENSORS * L, "), got ", w.size());
  check_bf16(embed, "embed");
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(),
              "embed must be a contiguous [vocab, hidden] table, got ", embed.sizes());
  TORCH_CHECK(token >= 0 && token < embed.size(0), "token ", token, " outside the vocabulary of ",
              embed.size(0));
  check_heads(heads, kv_heads, dim);
  for (const torch::Tensor* t : {&cos, &sin}) {
    check_bf16(*t, t == &cos ? "cos" : "sin");
    TORCH_CHECK(t->dim() == 2 && t->size(0) > position && t->size(1) == dim && t->is_contiguous(),
                "cos and sin must be contiguous [> ", position, ", ", dim, "], got ", t->sizes());
  }
  TORCH_CHECK(position >= 0, "position must be >= 0, got ", position);
  for (size_t r = 0; r < spans.size(); ++r) {
    const auto [start, length] = spans[r];
    TORCH_CHECK(start >= 0 && length >= 0 && start + length <= cap, "span ", r, " (", start, ", ",
                length, ") outside the arena's ", cap, " rows");
    // the thread that writes the token's row is the one that reads the context's last rows
    TORCH_CHECK(pos < start || pos >= start + length ||
                    (r + 1 == spans.size() && pos == start + length - 1),
                "span ", r, " (", start, ", ", length, ") holds the token's row ", pos,
                " other than as the context's last");
  }
  const int64_t E = embed.size(1);
  check_layer_weights<F>(w, final_norm, E, heads, kv_heads, dim);
  TORCH_CHECK(head.empty() || head.size() == F::HEAD_TENSORS, "head must be empty or hold ",
              F::HEAD_TENSORS, " tensors, got ", head.size());
  if (!head.empty()) {
    F::check_head(head);  // [vocab, hidden] in either format (int8: its codes)
    TORCH_CHECK(head[0].size(1) == E, "head must take ", E, " inputs, got ", head[0].size(1));
  }
  auto x = torch::empty({1, E}, embed.options());
  std::memcpy(x.data_ptr<bf16>(), embed.data_ptr<bf16>() + token * E, E * sizeof(bf16));
  const bf16 *c = cos.data_ptr<bf16>() + position * dim, *sn = sin.data_ptr<bf16>() + position * dim;
  if (bf16_arena)
    return decode_layers_impl<bf16, F>(x, w, final_norm, c, sn, kv, pos, spans, heads, kv_heads,
                                       dim, eps, head);
  return decode_layers_impl<float, F>(x, w, final_norm, c, sn, kv, pos, spans, heads, kv_heads,
                                      dim, eps, head);
}

// How many threads at::parallel_for runs a 64-way loop on: torch's thread count when the build
// has OpenMP (kernels.py's FLAGS), one when the pragma was compiled out.
int64_t parallel_threads() {
  std::vector<char> ran(static_cast<size_t>(std::max(1, at::get_num_threads())), 0);
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) { ran[at::get_thread_num()] = 1; });
  return std::count(ran.begin(), ran.end(), 1);
}

}  // namespace

// int8_amx.cpp
bool int8_amx_available();
torch::Tensor int8_pack_amx(const torch::Tensor& q);
torch::Tensor int8_linear_amx(const torch::Tensor& x, const torch::Tensor& packed,
                              const torch::Tensor& scale);
// kv_store.cpp
void store_step_kv(torch::Tensor arena, const torch::Tensor& pos, const torch::Tensor& k,
                   const torch::Tensor& v, torch::Tensor tails, const torch::Tensor& slots,
                   const torch::Tensor& at, const torch::Tensor& rows);
// prefill_attention.cpp
bool prefill_attention_available();
std::vector<std::string> prefill_attention_engines();
torch::Tensor prefill_attention(const torch::Tensor& q, const std::vector<torch::Tensor>& k_runs,
                                const std::vector<torch::Tensor>& v_runs,
                                const std::string& engine);
torch::Tensor prefill_attention_spans(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const torch::Tensor& spans);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL (they touch tensors only, as ATen's own bindings do):
  // a server's HTTP threads and a load test's clients run beside a long call.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows", nogil);
  m.def("add_rms_norm_", &add_rms_norm_, "x += y in place, then RMSNorm of x", nogil);
  m.def("rope_split", &rope_split, "q/k/v from the fused projection, q and k rotated", nogil);
  m.def("merge_heads", &merge_heads, "attention heads -> the o_proj input", nogil);
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for runs on here");
  m.def("decode_attention", &fedkv_decode::decode_attention, "one decode step's attention over prefix runs and tails", nogil);
  py::class_<TensorList>(m, "TensorList", "tensors kept for decode_layers_* (from a list)")
      .def(py::init([](std::vector<torch::Tensor> t) { return TensorList{std::move(t)}; }))
      .def("__len__", [](const TensorList& l) { return l.tensors.size(); });
  py::implicitly_convertible<py::list, TensorList>();
  // decode_layers' arguments by name; without `head` it returns the final-normed row
  auto def_step = [&](const char* name, auto fn, const char* doc) {
    m.def(name, fn, doc, py::arg("embed"), py::arg("token"), py::arg("w"), py::arg("final_norm"),
          py::arg("cos"), py::arg("sin"), py::arg("position"), py::arg("kv"), py::arg("pos"),
          py::arg("spans"), py::arg("heads"),
          py::arg("kv_heads"), py::arg("dim"), py::arg("eps"),
          py::arg("head") = TensorList{}, nogil);
  };
  def_step("decode_layers_bf16", &decode_layers<Bf16Layer>,
           "a session's one-token decode step through every layer, bf16 weights (and the output "
           "head: fp32 logits)");
  def_step("decode_layers_int8", &decode_layers<Int8Layer>,
           "one token of one session through every weight-only int8 layer (and the output head: "
           "fp32 logits)");
  m.def("silu_mul", &silu_mul, "SwiGLU's silu(gate) * up", nogil);
  m.def("bf16_linear", &bf16_linear, "bf16 linear of a few bf16 rows (weights read once)", nogil);
  m.def("int8_linear", &int8_linear, "weight-only int8 linear of a few bf16 rows", nogil);
  m.def("read_stream", &read_stream, "a prefetched read of every byte of a buffer (a bandwidth probe)", nogil);
  m.def("int8_amx_available", &int8_amx_available, "AMX bf16 tiles usable in this process", nogil);
  m.def("int8_pack_amx", &int8_pack_amx, "int8 codes in the AMX tile order of int8_linear_amx", nogil);
  m.def("int8_linear_amx", &int8_linear_amx, "weight-only int8 linear on AMX (codes read once for all rows)", nogil);
  m.def("store_step_kv", &store_step_kv,
        "a decode step's K/V into the arena and the tail slots, destinations prefetched", nogil);
  m.def("prefill_attention_available", &prefill_attention_available,
        "prefill_attention runs here (AMX tiles or AVX-512 BF16)", nogil);
  m.def("prefill_attention", &prefill_attention,
        "causal attention of bf16 prefill queries over K/V runs (AMX or AVX-512 BF16; engine "
        "'auto', or 'registers' / 'tiles' where they run)",
        py::arg("q"), py::arg("k_runs"), py::arg("v_runs"), py::arg("engine") = "auto", nogil);
  m.def("prefill_attention_engines", &prefill_attention_engines,
        "the engines prefill_attention runs on here ('registers', 'tiles')");
  m.def("prefill_attention_spans", &prefill_attention_spans,
        "prefill_attention over (start, length) spans of one layer's K/V", nogil);
}
