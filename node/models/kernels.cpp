// Fused elementwise kernels of a bf16 Llama decoder layer (node/models/kernels.py builds and
// loads them; node/models/llama.py calls them). Each replaces a chain of eager ATen ops whose
// per-call overhead outweighs the work at decode's few rows. Every intermediate is rounded to
// bf16 where the eager bf16 chain rounds it, so results match the eager path.
#include <torch/extension.h>
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

namespace {

using bf16 = c10::BFloat16;

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

void check_norm(const torch::Tensor& x, const torch::Tensor& w) {
  check_bf16(x, "x");
  check_bf16(w, "weight");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous(),
              "weight must be contiguous [", x.size(-1), "], got ", w.sizes());
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

// x = bf16(x + y) in place (the residual stream), then rms_norm(x): the add that ends one
// sublayer and the norm that starts the next, in one pass.
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& w,
                            double eps) {
  check_norm(x, w);
  check_bf16(y, "y");
  TORCH_CHECK(x.is_contiguous(), "x (updated in place) must be contiguous");
  TORCH_CHECK(x.sizes() == y.sizes(), "x ", x.sizes(), " and y ", y.sizes(), " differ");
  auto yc = y.contiguous();
  bf16* xp = x.data_ptr<bf16>();
  const bf16* yp = yc.data_ptr<bf16>();
  int64_t n = x.numel();
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#ifdef FEDKV_BF16_VEC
    for (; i + 16 <= end; i += 16) store16(xp + i, _mm512_add_ps(load16(xp + i), load16(yp + i)));
#endif
    for (; i < end; ++i) xp[i] = bf16(static_cast<float>(xp[i]) + static_cast<float>(yp[i]));
  });
  auto out = torch::empty_like(x);
  int64_t width = x.size(-1);
  norm_rows(xp, w.data_ptr<bf16>(), out.data_ptr<bf16>(), n / width, width, eps);
  return out;
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
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && dim % 2 == 0,
              "heads ", heads, " must group over kv_heads ", kv_heads, " and dim ", dim, " be even");
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

// gate_up [rows, 2 m] (gate, then up) -> bf16(bf16(silu(gate)) * up) [rows, m]: SwiGLU as
// eager bf16 computes it (silu rounded, then the product rounded).
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 m], got ", gate_up.sizes());
  auto gc = gate_up.contiguous();
  const int64_t rows = gc.size(0), m = gc.size(1) / 2;
  auto out = torch::empty({rows, m}, gc.options());
  const bf16* g = gc.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
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
  return out;
}

// How far ahead of the rows read the weights are fetched, into L2: far enough to keep as many
// lines in flight as one core's memory bandwidth needs, which L1's few fill buffers cannot
// (experiments.int8_rows times it).
constexpr int64_t PREFETCH_BYTES = 8192;

template <int R, int MR>
void int8_block(const int8_t* q, const float* x, const float* scale, bf16* y, int64_t o,
                int64_t m0, int64_t K, int64_t N) {
  float acc[R][MR] = {};
  int64_t k = 0;
#ifdef FEDKV_AVX512
  __m512 v[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) v[r][m] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(q + o * K) + PREFETCH_BYTES;
  for (; k + 16 <= K; k += 16) {
    for (int r = 0; r < R; r += 4) _mm_prefetch(ahead + (k / 16) * 64 + r * 16, _MM_HINT_T1);
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
    for (int m = 0; m < MR; ++m) y[(m0 + m) * N + o + r] = bf16(acc[r][m] * scale[o + r]);
}

template <int R>
void int8_rows(const int8_t* q, const float* x, const float* scale, bf16* y, int64_t o,
               int64_t M, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) int8_block<R, 4>(q, x, scale, y, o, m, K, N);
  switch (M - m) {
    case 3: int8_block<R, 3>(q, x, scale, y, o, m, K, N); break;
    case 2: int8_block<R, 2>(q, x, scale, y, o, m, K, N); break;
    case 1: int8_block<R, 1>(q, x, scale, y, o, m, K, N); break;
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
        _mm_prefetch(reinterpret_cast<const char*>(p + (i + j) * 64) + PREFETCH_BYTES, _MM_HINT_T1);
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

void check_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  check_bf16(x, "x");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(),
              "q must be contiguous int8 [out, in], got ", q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.dim() == 1 &&
                  scale.size(0) == q.size(0) && scale.is_contiguous(),
              "scale must be contiguous float32 [", q.size(0), "], got ", scale.scalar_type(),
              " ", scale.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == q.size(1), "x must be [rows, ", q.size(1), "], got ",
              x.sizes());
}

// Weight-only int8 product of a few rows: x bf16 [M, K] (contiguous), q int8 [N, K], scale
// fp32 [N] -> y bf16 [M, N]. Reads each weight byte once per call (memory-bound at decode's
// few rows). x's rows are widened to fp32 in `xf` (grown to M * K floats): no allocation
// past its first use, for a caller that runs many (decode_layers_int8).
void int8_product(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                  std::vector<float>& xf, bf16* y) {
  const int64_t M = x.size(0), K = q.size(1), N = q.size(0);
  const bf16* xb = x.data_ptr<bf16>();
  xf.resize(std::max<size_t>(xf.size(), M * K));
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xb[i]);
  const float* xp = xf.data();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  at::parallel_for(0, N / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) int8_rows<4>(qp, xp, sp, y, b * 4, M, K, N);
  });
  for (int64_t o = N / 4 * 4; o < N; ++o) int8_rows<1>(qp, xp, sp, y, o, M, K, N);
}

// int8_product of checked tensors, its result allocated.
torch::Tensor int8_linear(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& scale) {
  auto x = x_in.contiguous();
  check_int8(x, q, scale);
  std::vector<float> xf;
  auto y = torch::empty({x.size(0), q.size(0)}, x.options());
  int8_product(x, q, scale, xf, y.data_ptr<bf16>());
  return y;
}

// One strided [heads, n, dim] run of keys or values (a view into the cache's arena or its
// tail buffer); row `t` of head `h` at base + h * head_stride + t * row_stride. The arena is
// fp32 or bf16 (cache.config.CacheConfig.kv_dtype), a tail buffer fp32 or bf16
// (CacheConfig.batch_tail_dtype); bf16 rows are read as fp32.
template <typename T>
struct RunOf {
  const T* base;
  int64_t head_stride, row_stride, n;
};

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

// How many chunks of its prefix each KV head of a lone row with no tail is split into (see
// attend_chunks): as row_parts, 1 where the threads divide the heads or the prefix is short.
int64_t prefix_chunks(int64_t Hk, int64_t B, int64_t tail_len, int64_t n_prefix) {
  const int64_t t = std::max(1, at::get_num_threads()), parts = t / std::gcd(Hk, t);
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
// divided by the sum: attend_chunks merges the chunks).
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

// A lone row's attention with each KV head's prefix split into `chunks` (flash-decoding): the
// tasks become a multiple of the threads (SmolLM2's 3 heads over 2 threads left one idle a
// third of the time), then each query's chunks are merged by their maxima.
template <typename P>
void attend_chunks(const Rows<P>& r, int64_t chunks) {
  const int64_t Hk = r.q.size(0), G = r.q.size(1), D = r.q.size(3), tasks = Hk * chunks;
  std::vector<float> o(tasks * G * D, 0.f), m(tasks * G), l(tasks * G);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t t = begin; t < end; ++t)
      attend_chunk(r, t / chunks, t % chunks, chunks, o.data() + t * G * D, m.data() + t * G,
                   l.data() + t * G, w);
  });
  float* out = r.out.template data_ptr<float>();
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
  const int64_t chunks = prefix_chunks(Hk, B, tk.n, r.n_prefix);
  if (chunks > 1) return attend_chunks(r, chunks);
  at::parallel_for(0, Hk * parts, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / parts, part = task % parts;
      attend_head(r, tk, tv, tk_slot, tv_slot, h, B * part / parts, B * (part + 1) / parts, w);
    }
  });
}

// decode_attention (below) over runs already checked, or made from checked spans.
template <typename P>
torch::Tensor attend_decode(const torch::Tensor& q, const std::vector<RunOf<P>>& pk,
                            const std::vector<RunOf<P>>& pv, const torch::Tensor& tail_k,
                            const torch::Tensor& tail_v, const torch::Tensor& tail_valid,
                            const std::vector<int64_t>& slot) {
  int64_t n_prefix = 0;
  for (const RunOf<P>& run : pk) n_prefix += run.n;
  auto out = torch::zeros(q.sizes(), q.options());
  const Rows<P> rows{q.contiguous(), out, tail_valid, slot, pk, pv, n_prefix};
  if (tail_k.scalar_type() == torch::kBFloat16)
    attend_rows(rows, run_of<bf16>(tail_k, 0, 2), run_of<bf16>(tail_v, 0, 2), tail_k.stride(1),
                tail_v.stride(1));
  else
    attend_rows(rows, run_of<float>(tail_k, 0, 2), run_of<float>(tail_v, 0, 2), tail_k.stride(1),
                tail_v.stride(1));
  return out;
}

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

// One decode step's attention, grouped-query, over a shared prefix and each row's tail (what
// cache.attention.attend_shared computes, in one pass per (KV head, row)).
//   q [kv_heads, group, rows, dim] fp32; prefix_k/v: runs [kv_heads, n_i, dim], all fp32 or
//   all bf16;
//   tail_k/v [kv_heads, slots, T, dim] (fp32 or bf16); tail_valid bool [slots, T]; slots: row b's tail slot
//   (int64 [rows]), or empty for slot b -> out [kv_heads, group, rows, dim] fp32.
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

constexpr int64_t LAYER_TENSORS = 10;  // decode_layers_int8's per layer (decode_step.PER_LAYER)

// decode_layers_int8's layers over an arena of element type P (the checks done): the token's
// K/V (bf16 values, rope_split rounds them) go to row `pos` exactly in either type.
template <typename P>
torch::Tensor int8_layers(torch::Tensor x, const std::vector<torch::Tensor>& w,
                          const torch::Tensor& final_norm, const torch::Tensor& cos,
                          const torch::Tensor& sin, const torch::Tensor& kv, int64_t pos,
                          const int64_t* s, int64_t n_runs, int64_t heads, int64_t kv_heads,
                          int64_t dim, double eps) {
  const int64_t L = kv.size(0);
  std::vector<RunOf<P>> pk(n_runs), pv(n_runs);  // heads and rows; per layer their base
  for (int64_t r = 0; r < n_runs; ++r) pk[r] = pv[r] = RunOf<P>{nullptr, kv.stride(2), kv.stride(3), s[2 * r + 1]};
  auto no_tail = torch::empty({kv_heads, 1, 0, dim}, torch::TensorOptions().dtype(torch::kFloat32));
  auto no_valid = torch::empty({1, 0}, torch::TensorOptions().dtype(torch::kBool));
  const std::vector<int64_t> no_slot{0};
  std::vector<float> xf;  // a product's input row, widened
  torch::Tensor ys[4];    // each of a layer's four products' output, reused by every layer
  auto product = [&](int i, const torch::Tensor& in, const torch::Tensor& q, const torch::Tensor& sc) {
    check_int8(in, q, sc);
    TORCH_CHECK(in.is_contiguous(), "a product's input must be contiguous");
    if (!ys[i].defined() || ys[i].size(1) != q.size(0)) ys[i] = torch::empty({1, q.size(0)}, in.options());
    int8_product(in, q, sc, xf, ys[i].data_ptr<bf16>());
    return ys[i];
  };
  auto h = rms_norm(x, w[0], eps);
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* lw = w.data() + LAYER_TENSORS * l;
    P* base = kv.data_ptr<P>() + l * kv.stride(0);
    auto qkv = rope_split(product(0, h, lw[1], lw[2]), cos, sin, heads, kv_heads, dim,
                          torch::kFloat32);
    for (int64_t kvi = 0; kvi < 2; ++kvi) {  // the token's K and V into its arena row
      const float* src = qkv[1 + kvi].template data_ptr<float>();
      for (int64_t hk = 0; hk < kv_heads; ++hk) {
        P* dst = base + kvi * kv.stride(1) + hk * kv.stride(2) + pos * kv.stride(3);
        for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<P>(src[hk * dim + i]);
      }
    }
    for (int64_t r = 0; r < n_runs; ++r) {
      pk[r].base = base + s[2 * r] * kv.stride(3);
      pv[r].base = pk[r].base + kv.stride(1);
    }
    auto a = attend_decode(qkv[0], pk, pv, no_tail, no_tail, no_valid, no_slot);
    h = add_rms_norm_(x, product(1, merge_heads(a), lw[3], lw[4]), lw[5], eps);
    auto act = silu_mul(product(2, h, lw[6], lw[7]));
    const torch::Tensor& next_norm = l + 1 < L ? w[LAYER_TENSORS * (l + 1)] : final_norm;
    h = add_rms_norm_(x, product(3, act, lw[8], lw[9]), next_norm, eps);
  }
  return h;
}

// One session's one-token decode through every layer on weight-only int8 weights: what
// LlamaModel._hidden's fused form does for a lone token, without a return to Python between
// the kernels (node/models/decode_step.py).
//   x bf16 [1, hidden], the embedded token: the residual stream, updated in place;
//   w: per layer its input norm, q/k/v codes and scales, o codes and scales, post-attention
//      norm, gate/up codes and scales, down codes and scales (10 tensors a layer);
//   final_norm: the model's last norm; cos, sin bf16 [1, dim] of the token's position;
//   kv: the arena's K/V, fp32 or bf16 [layers, 2, kv_heads, arena tokens, dim]; pos: the arena
//      row the token's K/V go to; spans int64 [runs, 2]: (start, length) of the context's runs
//      in the arena, the new token's row included -> the final-normed bf16 [1, hidden].
torch::Tensor decode_layers_int8(torch::Tensor x, const std::vector<torch::Tensor>& w,
                                 const torch::Tensor& final_norm, const torch::Tensor& cos,
                                 const torch::Tensor& sin, const torch::Tensor& kv, int64_t pos,
                                 const torch::Tensor& spans, int64_t heads, int64_t kv_heads,
                                 int64_t dim, double eps) {
  const bool bf16_arena = kv.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((kv.scalar_type() == torch::kFloat32 || bf16_arena) && kv.dim() == 5 &&
                  kv.size(1) == 2 && kv.size(2) == kv_heads && kv.size(4) == dim && kv.stride(4) == 1,
              "kv must be float32 or bfloat16 [layers, 2, ", kv_heads, ", tokens, ", dim, "], got ",
              kv.scalar_type(), " ", kv.sizes());
  const int64_t L = kv.size(0), cap = kv.size(3);
  TORCH_CHECK(pos >= 0 && pos < cap, "pos ", pos, " outside the arena's ", cap, " rows");
  TORCH_CHECK(static_cast<int64_t>(w.size()) == LAYER_TENSORS * L, "w must hold ", LAYER_TENSORS,
              " tensors per layer (", LAYER_TENSORS * L, "), got ", w.size());
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "x must be one row, got ", x.sizes());
  TORCH_CHECK(spans.scalar_type() == torch::kLong && spans.dim() == 2 && spans.size(1) == 2,
              "spans must be int64 [runs, 2], got ", spans.scalar_type(), " ", spans.sizes());
  auto sp = spans.contiguous();
  const int64_t* s = sp.data_ptr<int64_t>();
  for (int64_t r = 0; r < sp.size(0); ++r)
    TORCH_CHECK(s[2 * r] >= 0 && s[2 * r + 1] >= 0 && s[2 * r] + s[2 * r + 1] <= cap, "span ", r,
                " (", s[2 * r], ", ", s[2 * r + 1], ") outside the arena's ", cap, " rows");
  if (bf16_arena)
    return int8_layers<bf16>(x, w, final_norm, cos, sin, kv, pos, s, sp.size(0), heads, kv_heads, dim, eps);
  return int8_layers<float>(x, w, final_norm, cos, sin, kv, pos, s, sp.size(0), heads, kv_heads, dim, eps);
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
torch::Tensor prefill_attention(const torch::Tensor& q, const std::vector<torch::Tensor>& k_runs,
                                const std::vector<torch::Tensor>& v_runs);
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
  m.def("decode_attention", &decode_attention, "one decode step's attention over prefix runs and tails", nogil);
  m.def("decode_layers_int8", &decode_layers_int8,
        "one token of one session through every weight-only int8 layer", nogil);
  m.def("silu_mul", &silu_mul, "SwiGLU's silu(gate) * up", nogil);
  m.def("int8_linear", &int8_linear, "weight-only int8 linear of a few bf16 rows", nogil);
  m.def("read_stream", &read_stream, "a prefetched read of every byte of a buffer (a bandwidth probe)", nogil);
  m.def("int8_amx_available", &int8_amx_available, "AMX bf16 tiles usable in this process", nogil);
  m.def("int8_pack_amx", &int8_pack_amx, "int8 codes in the AMX tile order of int8_linear_amx", nogil);
  m.def("int8_linear_amx", &int8_linear_amx, "weight-only int8 linear on AMX (codes read once for all rows)", nogil);
  m.def("store_step_kv", &store_step_kv,
        "a decode step's K/V into the arena and the tail slots, destinations prefetched", nogil);
  m.def("prefill_attention", &prefill_attention,
        "causal attention of bf16 prefill queries over K/V runs on AMX", nogil);
  m.def("prefill_attention_spans", &prefill_attention_spans,
        "prefill_attention over (start, length) spans of one layer's K/V", nogil);
}
