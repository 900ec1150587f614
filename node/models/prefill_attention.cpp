// Causal attention of a prefill's bf16 queries over the cache's K/V runs, on AMX tiles where
// the CPU grants them, else on AVX-512 BF16's pair dot products (node/models/kernels.py builds
// it into the same extension as kernels.cpp; node/models/byte_model.py's attend_session calls it).
//
// Why: SDPA's CPU flash kernel spent about twice what its matmuls and softmax need on a
// 512-token prefill of SmolLM2's heads, and a chunk over cached runs first paid a bf16 copy of
// the runs concatenated. Here the runs (fp32 or bf16) are read once into AMX tile order per KV
// head, shared by the group's query heads; each block of 16 query rows takes its scores on AMX
// (bf16 products, fp32 sums), an exact softmax in fp32 on AVX-512 over the keys it may see (no
// online rescaling: a block's whole score row fits in cache), and P.V on AMX again. P is rounded
// to bf16 for that product, as SDPA's bf16 kernel does. Without AMX the same packed tiles feed
// vdpbf16ps register blocks (4 query rows x 64 keys for the scores, 4 rows x 64 dims for P.V):
// on a CPU with AVX-512 BF16 and no AMX, SDPA's flash kernel was, beside the linears, the other
// large part of a prefill (docs/real-llm.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "amx_tiles.h"
#include "vec_math.h"

namespace fedkv_prefill {

using bf16 = c10::BFloat16;

constexpr int64_t D = 64;      // the head size this kernel takes (SmolLM2, Llama-style small models)
constexpr int64_t ROWS = 16;   // query rows per block (one tile's rows)
constexpr int64_t KEYS = 16;   // keys per score tile
constexpr int64_t PAIRS = 32;  // keys per P.V step (16 bf16 pairs)
constexpr int64_t TILE = 512;  // bf16 in one packed 16 x 32 tile

// One run of keys and values: row j of head h at k + h * head_k + j * row_k bytes (v likewise).
// Plain pointers: a tensor per run cost more than attending a short run did.
struct RunPtr {
  const char* k;
  const char* v;
  int64_t head_k, head_v, row_k, row_v, n;
};

RunPtr run_ptr(const torch::Tensor& k, const torch::Tensor& v, int64_t start, int64_t n) {
  const int64_t es = k.element_size();
  return {static_cast<const char*>(k.data_ptr()) + start * k.stride(1) * es,
          static_cast<const char*>(v.data_ptr()) + start * v.stride(1) * es,
          k.stride(0) * es, v.stride(0) * es, k.stride(1) * es, v.stride(1) * es, n};
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define FEDKV_PREFILL 1
#endif

#ifdef FEDKV_AMX
using fedkv_tiles::fence;

// Every tile 16 rows x 64 bytes: tmm0/1 the queries' two halves of D (later P), tmm2 a packed
// K or V tile, tmm3 a block of scores, tmm4-7 the output's four 16-column groups.
void configure() {
  fedkv_tiles::Config c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  fence();
  _tile_loadconfig(&c);
}
#endif

#ifdef FEDKV_PREFILL

// 16 values of a K or V row (fp32 or bf16) as fp32.
inline __m512 load16(const void* p, bool is_bf16) {
  if (!is_bf16) return _mm512_loadu_ps(static_cast<const float*>(p));
  __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Where key i's row of head h lives, over runs laid end to end.
struct Rows {
  std::vector<const char*> k, v;  // [n] row pointers of one head
  bool is_bf16;
};

Rows rows_of(const std::vector<RunPtr>& runs, bool is_bf16, int64_t h, int64_t n) {
  Rows r{std::vector<const char*>(n), std::vector<const char*>(n), is_bf16};
  int64_t i = 0;
  for (const RunPtr& run : runs) {
    const char* kb = run.k + h * run.head_k;
    const char* vb = run.v + h * run.head_v;
    for (int64_t j = 0; j < run.n; ++j, ++i) {
      r.k[i] = kb + j * run.row_k;
      r.v[i] = vb + j * run.row_v;
    }
  }
  return r;
}

// K of one head as B tiles of Q.K^T: per 16 keys, two tiles (D's halves), row r holding each
// key's dims (2r, 2r + 1) side by side; keys past n are zero.
void pack_k(const Rows& r, int64_t n, bf16* out) {
  const int64_t blocks = (n + KEYS - 1) / KEYS;
  std::memset(out, 0, blocks * 2 * TILE * sizeof(bf16));
  const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                              5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(KEYS));  // dword offsets of rows
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t half = 0; half < 2; ++half) {
      const char* src = r.k[i] + half * 32 * (r.is_bf16 ? 2 : 4);
      __m512 lo = load16(src, r.is_bf16);
      __m512 hi = load16(src + 16 * (r.is_bf16 ? 2 : 4), r.is_bf16);
      __m512i pairs = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
      bf16* tile = out + ((i / KEYS) * 2 + half) * TILE + (i % KEYS) * 2;
      _mm512_i32scatter_epi32(tile, stride, pairs, 4);
    }
  }
}

// V of one head as B tiles of P.V: per 32 keys, four tiles (16 columns each), row r holding
// keys (2r, 2r + 1) of each column side by side; keys past n are zero.
void pack_v(const Rows& r, int64_t n, bf16* out) {
  const int64_t chunks = (n + PAIRS - 1) / PAIRS;
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                              24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                              1, 16, 0);
  const int64_t es = r.is_bf16 ? 2 : 4;
  for (int64_t i = 0; i < chunks * PAIRS; i += 2) {
    for (int64_t g = 0; g < 4; ++g) {
      __m512 a = i < n ? load16(r.v[i] + g * 16 * es, r.is_bf16) : _mm512_setzero_ps();
      __m512 b = i + 1 < n ? load16(r.v[i + 1] + g * 16 * es, r.is_bf16) : _mm512_setzero_ps();
      __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));  // a in the low half
      bf16* row = out + ((i / PAIRS) * 4 + g) * TILE + ((i % PAIRS) / 2) * 32;
      _mm512_storeu_si512(row, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// exp(x * scale - shift) of 16 scores as 2^t: P is rounded to bf16 (8 bits), so 2^f on
// |f| <= 1/2 by a degree-4 polynomial (within ~5e-5, far inside bf16's 4e-3) replaces the
// degree-6 exp16 the fp32 kernels need; the softmax's exps were most of its time.
inline __m512 exp_scaled16(__m512 s, __m512 scale_log2e, __m512 shift_log2e) {
  const __m512 t = _mm512_max_ps(_mm512_fmsub_ps(s, scale_log2e, shift_log2e),
                                 _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Softmax of one row's first `seen` scores into bf16 P (zero up to `width`); returns the sum
// of the fp32 weights. `scale` is 1/sqrt(D).
float softmax_row(const float* s, int64_t seen, int64_t width, float scale, bf16* p) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < seen; j += 16) {
    const __mmask16 k = seen - j >= 16 ? 0xFFFF : (__mmask16)((1u << (seen - j)) - 1);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, s + j));
  }
  constexpr float LOG2E = 1.44269504088896341f;
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(m) * scale * LOG2E);
  const __m512 sc = _mm512_set1_ps(scale * LOG2E);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= seen; j += 32) {  // two independent sums: the adds do not queue
    const __m512 e0 = exp_scaled16(_mm512_loadu_ps(s + j), sc, shift);
    const __m512 e1 = exp_scaled16(_mm512_loadu_ps(s + j + 16), sc, shift);
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    _mm512_storeu_si512(p + j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
  }
  for (; j < width; j += 16) {
    const int64_t left = seen - j;
    const __mmask16 k = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    __m512 e = _mm512_maskz_mov_ps(k, exp_scaled16(_mm512_maskz_loadu_ps(k, s + j), sc, shift));
    sum0 = _mm512_add_ps(sum0, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

// A block of query rows, position first_pos.. : the keys its last row sees, as 16-key score
// blocks (ws scores a row) and as whole 32-key chunks of P (width).
struct BlockShape {
  int64_t blocks, width, ws;
  BlockShape(int64_t first_pos, int64_t m)
      : blocks((first_pos + m + KEYS - 1) / KEYS),
        width((first_pos + m + PAIRS - 1) / PAIRS * PAIRS),
        ws(blocks * KEYS) {}
};

// The block's m query rows into qb, zero-padded to ROWS rows; s and p (zeroed) sized for it.
void start_block(const bf16* q, int64_t q_row_stride, int64_t m, const BlockShape& b, bf16* qb,
                 std::vector<float>& s, std::vector<bf16>& p) {
  std::memset(qb, 0, ROWS * D * sizeof(bf16));
  for (int64_t r = 0; r < m; ++r) std::memcpy(qb + r * D, q + r * q_row_stride, D * sizeof(bf16));
  s.resize(ROWS * b.ws);
  p.assign(ROWS * b.width, bf16(0.0f));
}

// Each of the m rows' softmax over the keys it may see, into P; sums[r] its weights' sum.
void softmax_rows(const std::vector<float>& s, int64_t m, int64_t first_pos, const BlockShape& b,
                  std::vector<bf16>& p, float* sums) {
  const float scale = 1.0f / std::sqrt(float(D));
  for (int64_t r = 0; r < m; ++r)
    sums[r] = softmax_row(s.data() + r * b.ws, first_pos + r + 1, b.width, scale,
                          p.data() + r * b.width);
}

// rows of o (D apart) divided by their sums, rounded to bf16 into out (out_row_stride apart).
void store_rows(const float* o, const float* sums, int64_t rows, bf16* out,
                int64_t out_row_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 row = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_row_stride + d),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(row)));
    }
  }
}

#endif

#ifdef FEDKV_AMX
// One chunk c of 32 keys of P.V: P's chunk into tile PT, V's four 16-column tiles through tiles
// 2 and 3 by turns, summed into the output's tiles 4-7. A macro: GCC's tile intrinsics paste
// the tile number into the instruction, so it must be a literal.
#define FEDKV_PV_CHUNK(PT, p, width, vp, c)                  \
  do {                                                       \
    _tile_loadd(PT, (p) + (c) * PAIRS, (width) * 2);         \
    _tile_loadd(2, (vp) + ((c) * 4 + 0) * TILE, 64);         \
    _tile_loadd(3, (vp) + ((c) * 4 + 1) * TILE, 64);         \
    _tile_dpbf16ps(4, PT, 2);                                \
    _tile_dpbf16ps(5, PT, 3);                                \
    _tile_loadd(2, (vp) + ((c) * 4 + 2) * TILE, 64);         \
    _tile_loadd(3, (vp) + ((c) * 4 + 3) * TILE, 64);         \
    _tile_dpbf16ps(6, PT, 2);                                \
    _tile_dpbf16ps(7, PT, 3);                                \
  } while (0)

// Up to 16 query rows of one head, t0.. (position n - T + t), against the packed K/V.
void query_block_tiles(const bf16* q, int64_t q_row_stride, int64_t m, int64_t first_pos,
                       const bf16* kp, const bf16* vp, bf16* out, int64_t out_row_stride,
                       std::vector<float>& s, std::vector<bf16>& p) {
  const BlockShape shape(first_pos, m);
  const int64_t blocks = shape.blocks, width = shape.width, ws = shape.ws;
  alignas(64) bf16 qb[ROWS * D];
  start_block(q, q_row_stride, m, shape, qb, s, p);
  fence();
  _tile_loadd(0, qb, D * 2);
  _tile_loadd(1, qb + 32, D * 2);
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {  // two key blocks at once: two accumulators, four K tiles
    _tile_zero(3);
    _tile_zero(4);
    _tile_loadd(2, kp + (b * 2) * TILE, 64);
    _tile_loadd(5, kp + (b * 2 + 1) * TILE, 64);
    _tile_loadd(6, kp + (b * 2 + 2) * TILE, 64);
    _tile_loadd(7, kp + (b * 2 + 3) * TILE, 64);
    _tile_dpbf16ps(3, 0, 2);
    _tile_dpbf16ps(4, 0, 6);
    _tile_dpbf16ps(3, 1, 5);
    _tile_dpbf16ps(4, 1, 7);
    _tile_stored(3, s.data() + b * KEYS, ws * 4);
    _tile_stored(4, s.data() + (b + 1) * KEYS, ws * 4);
  }
  if (b < blocks) {
    _tile_zero(3);
    _tile_loadd(2, kp + (b * 2) * TILE, 64);
    _tile_loadd(5, kp + (b * 2 + 1) * TILE, 64);
    _tile_dpbf16ps(3, 0, 2);
    _tile_dpbf16ps(3, 1, 5);
    _tile_stored(3, s.data() + b * KEYS, ws * 4);
  }
  fence();
  float sums[ROWS];
  softmax_rows(s, m, first_pos, shape, p, sums);
  fence();
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const int64_t chunks = width / PAIRS;
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {  // P in tiles 0 and 1 by turns: a load never waits on a product
    FEDKV_PV_CHUNK(0, p.data(), width, vp, c);
    FEDKV_PV_CHUNK(1, p.data(), width, vp, c + 1);
  }
  if (c < chunks) FEDKV_PV_CHUNK(0, p.data(), width, vp, c);
  alignas(64) float o[ROWS * D];
  _tile_stored(4, o, D * 4);
  _tile_stored(5, o + 16, D * 4);
  _tile_stored(6, o + 32, D * 4);
  _tile_stored(7, o + 48, D * 4);
  fence();
  store_rows(o, sums, m, out, out_row_stride);
}
#endif

#ifdef FEDKV_PREFILL
using vbf = __m512bh;
constexpr int RB = 4;  // query rows per register block

// Scores of RB query rows (qb, D apart) against NB packed 16-key blocks (kp: block 0's tiles)
// into s (rows ws apart): per pair of dims, each K tile row (16 keys x one pair) is loaded once
// and meets every row's pair, broadcast.
template <int NB>
inline void scores_block(const bf16* qb, const bf16* kp, float* s, int64_t ws) {
  __m512 acc[RB][NB];
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int32_t* q32 = reinterpret_cast<const int32_t*>(qb);
  for (int pair = 0; pair < int(D / 2); ++pair) {
    const bf16* row = kp + (pair / 16) * TILE + (pair % 16) * 32;
    vbf k[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) k[j] = (vbf)_mm512_loadu_si512(row + j * 2 * TILE);
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
      const vbf qv = (vbf)_mm512_set1_epi32(q32[i * (D / 2) + pair]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qv, k[j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(s + i * ws + j * KEYS, acc[i][j]);
}

// RB rows of P (bf16, width apart) times the packed V's first `chunks` 32-key chunks into
// o (RB x D fp32): per pair of keys, V's four 16-column rows are loaded once for the RB rows.
inline void pv_block(const bf16* p, int64_t width, const bf16* vp, int64_t chunks, float* o) {
  __m512 acc[RB][4];
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i)
    for (int g = 0; g < 4; ++g) acc[i][g] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const bf16* tiles = vp + c * 4 * TILE;
    const int32_t* pc = reinterpret_cast<const int32_t*>(p + c * PAIRS);
    for (int r = 0; r < int(PAIRS / 2); ++r) {
      vbf v[4];
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) v[g] = (vbf)_mm512_loadu_si512(tiles + g * TILE + r * 32);
#pragma GCC unroll 4
      for (int i = 0; i < RB; ++i) {
        const vbf pv = (vbf)_mm512_set1_epi32(pc[i * (width / 2) + r]);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], pv, v[g]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i)
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(o + i * D + g * 16, acc[i][g]);
}

// query_block_tiles' work on AVX-512 BF16 registers: the same packed K/V, the same softmax.
void query_block_avx(const bf16* q, int64_t q_row_stride, int64_t m, int64_t first_pos,
                     const bf16* kp, const bf16* vp, bf16* out, int64_t out_row_stride,
                     std::vector<float>& s, std::vector<bf16>& p) {
  const BlockShape shape(first_pos, m);
  const int64_t blocks = shape.blocks, width = shape.width, ws = shape.ws;
  const int64_t mr = (m + RB - 1) / RB * RB;
  alignas(64) bf16 qb[ROWS * D];
  start_block(q, q_row_stride, m, shape, qb, s, p);
  for (int64_t r = 0; r < mr; r += RB) {
    int64_t b = 0;
    auto at = [&](int64_t blk) { return s.data() + r * ws + blk * KEYS; };
    for (; b + 4 <= blocks; b += 4) scores_block<4>(qb + r * D, kp + b * 2 * TILE, at(b), ws);
    switch (blocks - b) {
      case 3: scores_block<3>(qb + r * D, kp + b * 2 * TILE, at(b), ws); break;
      case 2: scores_block<2>(qb + r * D, kp + b * 2 * TILE, at(b), ws); break;
      case 1: scores_block<1>(qb + r * D, kp + b * 2 * TILE, at(b), ws); break;
      default: break;
    }
  }
  float sums[ROWS];
  softmax_rows(s, m, first_pos, shape, p, sums);
  alignas(64) float o[RB * D];
  for (int64_t r = 0; r < mr; r += RB) {
    pv_block(p.data() + r * width, width, vp, width / PAIRS, o);
    store_rows(o, sums + r, std::min<int64_t>(RB, m - r), out + r * out_row_stride,
               out_row_stride);
  }
}
#endif

// Which product this process runs: AMX tiles if built with them and Linux grants them, else
// AVX-512 BF16 registers if built with them, else none (the eager ops serve).
enum class Engine { none, registers, tiles };

bool registers_built() {
#ifdef FEDKV_PREFILL
  return true;
#else
  return false;
#endif
}

bool tiles_granted() {
#ifdef FEDKV_AMX
  return fedkv_tiles::request();
#else
  return false;
#endif
}

Engine engine() {
  if (tiles_granted()) return Engine::tiles;
  return registers_built() ? Engine::registers : Engine::none;
}

// The engine `name` asks for: "auto" (engine()), or "registers" / "tiles" where they run here
// (the tests run both on a machine with tiles, which "auto" would never leave).
Engine engine_named(const std::string& name) {
  if (name == "auto") return engine();
  if (name == "registers" && registers_built()) return Engine::registers;
  if (name == "tiles" && tiles_granted()) return Engine::tiles;
  TORCH_CHECK(name == "registers" || name == "tiles",
              "engine must be 'auto', 'registers' or 'tiles', got '", name, "'");
  TORCH_CHECK(false, "the ", name, " engine does not run here (",
              name == "tiles" ? "no AMX tiles granted" : "built without AVX-512 BF16", ")");
  return Engine::none;
}

void check_runs(const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                int64_t hk) {
  TORCH_CHECK(!ks.empty() && ks.size() == vs.size(), "k_runs and v_runs: as many runs, at least one");
  const auto dt = ks[0].scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16, "runs must be float32 or bfloat16");
  for (size_t i = 0; i < ks.size(); ++i) {
    for (const auto* t : {&ks[i], &vs[i]}) {
      TORCH_CHECK(t->scalar_type() == dt && t->dim() == 3 && t->size(0) == hk && t->size(2) == D &&
                      t->stride(2) == 1 && t->size(1) == ks[i].size(1),
                  "run ", i, " must be [", hk, ", n, ", D, "] of one dtype, rows contiguous; got ",
                  t->sizes(), " ", t->scalar_type());
    }
  }
}

void check_q(const torch::Tensor& q, Engine engine) {
  TORCH_CHECK(engine != Engine::none,
              "prefill_attention needs AVX-512 BF16 or AMX tiles; this build has neither");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && q.dim() == 4 && q.size(3) == D &&
                  q.stride(3) == 1,
              "q must be bf16 [kv_heads, group, T, ", D, "] with contiguous rows, got ", q.sizes());
}

// q bf16 [Hk, G, T, D] (checked): the last T positions of a context whose K/V are `runs`
// (checked, fp32 or bf16, n keys in all, n >= T) -> bf16 [Hk, G, T, D], causal.
torch::Tensor attend_runs(const torch::Tensor& q, const std::vector<RunPtr>& runs, bool is_bf16,
                          Engine engine) {
  const int64_t hk = q.size(0), groups = q.size(1), T = q.size(2);
  int64_t n = 0;
  for (const RunPtr& run : runs) n += run.n;
  TORCH_CHECK(T >= 1 && n >= T, "need 1 <= T <= the runs' ", n, " keys, got T = ", T);
  auto out = torch::empty({hk, groups, T, D}, q.options());
#ifdef FEDKV_PREFILL
  const int64_t kblocks = (n + KEYS - 1) / KEYS, vchunks = (n + PAIRS - 1) / PAIRS;
  std::vector<bf16> kp(hk * kblocks * 2 * TILE), vp(hk * vchunks * 4 * TILE);
  at::parallel_for(0, hk, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      Rows r = rows_of(runs, is_bf16, h, n);
      pack_k(r, n, kp.data() + h * kblocks * 2 * TILE);
      pack_v(r, n, vp.data() + h * vchunks * 4 * TILE);
    }
  });
  const int64_t qblocks = (T + ROWS - 1) / ROWS;
  const bf16* qd = q.data_ptr<bf16>();
  bf16* od = out.data_ptr<bf16>();
  const bool tiles = engine == Engine::tiles;
  at::parallel_for(0, hk * groups * qblocks, 1, [&](int64_t begin, int64_t end) {
#ifdef FEDKV_AMX
    if (tiles) configure();  // tile state is per thread
#endif
    std::vector<float> s;
    std::vector<bf16> p;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task % qblocks, hg = task / qblocks, h = hg / groups, g = hg % groups;
      const int64_t t0 = b * ROWS, m = std::min(ROWS, T - t0);
      auto* block = query_block_avx;
#ifdef FEDKV_AMX
      if (tiles) block = query_block_tiles;
#endif
      block(qd + h * q.stride(0) + g * q.stride(1) + t0 * q.stride(2), q.stride(2), m,
            n - T + t0, kp.data() + h * kblocks * 2 * TILE, vp.data() + h * vchunks * 4 * TILE,
            od + ((h * groups + g) * T + t0) * D, D, s, p);
    }
#ifdef FEDKV_AMX
    if (tiles) _tile_release();
#endif
  });
#endif
  return out;
}

// q bf16 [Hk, G, T, D] over K/V runs ([Hk, n_i, D] each, fp32 or bf16), on `engine`.
torch::Tensor attention(const torch::Tensor& q, const std::vector<torch::Tensor>& k_runs,
                        const std::vector<torch::Tensor>& v_runs, Engine engine) {
  check_q(q, engine);
  check_runs(k_runs, v_runs, q.size(0));
  std::vector<RunPtr> runs;
  for (size_t i = 0; i < k_runs.size(); ++i)
    runs.push_back(run_ptr(k_runs[i], v_runs[i], 0, k_runs[i].size(1)));
  return attend_runs(q, runs, k_runs[0].scalar_type() == torch::kBFloat16, engine);
}

// The same over (start, length) rows of `spans` (int64 [R, 2], in order) of one layer's K and
// V as the arena holds them ([Hk, N, D] each): no tensor per run is made.
torch::Tensor attention_spans(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& spans) {
  const Engine chosen = engine();
  check_q(q, chosen);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [kv_heads, tokens, ",
              D, "] of one shape, got ", k.sizes(), " and ", v.sizes());
  check_runs({k}, {v}, q.size(0));
  TORCH_CHECK(spans.scalar_type() == torch::kLong && spans.dim() == 2 && spans.size(1) == 2 &&
                  spans.is_contiguous() && spans.size(0) >= 1,
              "spans must be contiguous int64 [runs >= 1, 2] (start, length), got ",
              spans.sizes(), " ", spans.scalar_type());
  const int64_t* sp = spans.data_ptr<int64_t>();
  std::vector<RunPtr> runs;
  for (int64_t i = 0; i < spans.size(0); ++i) {
    const int64_t start = sp[2 * i], len = sp[2 * i + 1];
    TORCH_CHECK(start >= 0 && len >= 1 && start <= k.size(1) - len, "span ", i, " (", start, ", ",
                len, ") is not within the ", k.size(1), " tokens");
    runs.push_back(run_ptr(k, v, start, len));
  }
  return attend_runs(q, runs, k.scalar_type() == torch::kBFloat16, chosen);
}

}  // namespace fedkv_prefill

bool prefill_attention_available() {
  return fedkv_prefill::engine() != fedkv_prefill::Engine::none;
}

std::vector<std::string> prefill_attention_engines() {
  std::vector<std::string> out;
  if (fedkv_prefill::registers_built()) out.push_back("registers");
  if (fedkv_prefill::tiles_granted()) out.push_back("tiles");
  return out;
}

torch::Tensor prefill_attention_spans(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const torch::Tensor& spans) {
  return fedkv_prefill::attention_spans(q, k, v, spans);
}

torch::Tensor prefill_attention(const torch::Tensor& q, const std::vector<torch::Tensor>& k_runs,
                                const std::vector<torch::Tensor>& v_runs,
                                const std::string& engine) {
  return fedkv_prefill::attention(q, k_runs, v_runs, fedkv_prefill::engine_named(engine));
}
