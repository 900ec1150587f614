// Weight-only int8 linear on AMX tiles (node/models/kernels.py builds it into the same extension
// as kernels.cpp; node/models/precision.py calls it).
//
// Why: past a few rows the AVX-512 int8 kernel (kernels.cpp) is bound by its fp32 multiply-adds
// and the bf16 path by reading 2 bytes per weight. Here each 16-column block of int8 codes is
// widened to bf16 once per call, tile by tile, and multiplied on the AMX unit against every
// 32-row block of the input while it is still in cache, so a call reads 1 byte per weight
// whatever its row count (a decode batch, or a mixed step's decode rows and prefill chunks).
// Codes are exact in bf16 and AMX accumulates bf16 products in fp32, so this computes what the
// bf16 copy of the dequantized weights does (up to the order of the fp32 additions).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

namespace fedkv_amx {

using bf16 = c10::BFloat16;

constexpr int64_t TN = 16;   // output columns per tile
constexpr int64_t TK = 32;   // inputs per tile (bf16 pairs x 16)
constexpr int64_t TM = 16;   // rows per tile
constexpr int64_t BLOCK = TN * TK;  // codes per packed block
constexpr int64_t MAX_ROWS = 2 * TM;  // rows per pass over a column block's tiles
constexpr int64_t PREFETCH_BLOCKS = 8;  // how many blocks ahead of the one widened the codes are fetched

#ifdef FEDKV_AMX
using fedkv_tiles::fence;

// Sums of row tile r (16 rows) and column block c in tmm(2c + r); row tile r's bf16 inputs in
// tmm(4 + r); column block c's widened codes in tmm(6 + c). Two row tiles by two column blocks:
// each input tile and each code tile loaded serves two multiplications.
void configure(int64_t m0, int64_t m1, int64_t cols) {
  fedkv_tiles::Config c;
  std::memset(&c, 0, sizeof c);  // ldtilecfg faults on any nonzero reserved byte
  c.palette = 1;
  for (int64_t col = 0; col < cols; ++col) {
    c.rows[2 * col] = m0; c.colsb[2 * col] = TN * 4;
    if (m1) { c.rows[2 * col + 1] = m1; c.colsb[2 * col + 1] = TN * 4; }
    c.rows[6 + col] = TK / 2; c.colsb[6 + col] = TN * 4;
  }
  c.rows[4] = m0; c.colsb[4] = TK * 2;
  if (m1) { c.rows[5] = m1; c.colsb[5] = TK * 2; }
  fence();
  _tile_loadconfig(&c);
}

// 512 int8 codes -> 512 bf16 in the same order (exact: |code| <= 127).
inline void widen(const int8_t* q, bf16* out) {
  for (int64_t i = 0; i < BLOCK; i += 32) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

// `n` rows of one column block's sums (`c`, fp32 [16, 16] as a tile stores them) scaled into y
// from row `r` on, bf16. (GCC's tile intrinsics take literal tile numbers, so the caller stores.)
inline void scale_rows(const float* c, const float* scale, bf16* y, int64_t nb, int64_t r,
                       int64_t n, int64_t N) {
  const __m512 s = _mm512_loadu_ps(scale + nb * TN);
  for (int64_t i = 0; i < n; ++i) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(c + i * TN), s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r + i) * N + nb * TN),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

// Rows [r0, r0 + rows) (rows <= 32) of `cols` (1 or 2) adjacent 16-column blocks of y: the sum
// over K's tiles of the widened codes, either widened here from `q` (the first row block, each
// tile as it is used) or read back from `b` (the next ones; `keep`: the first leaves every tile
// there, [cols][K/32][512], else one 1 KiB tile per column block is rewritten in place).
void row_block(const bf16* x, const int8_t* q, bf16* b, bool widening, bool keep, int64_t cols,
               const float* scale, bf16* y, int64_t nb, int64_t r0, int64_t rows, int64_t K,
               int64_t N) {
  const int64_t m0 = rows < TM ? rows : TM, m1 = rows - m0, kt = K / TK;
  const bf16* xr = x + r0 * K;
  _tile_zero(0);
  if (m1) _tile_zero(1);
  if (cols == 2) {
    _tile_zero(2);
    if (m1) _tile_zero(3);
  }
  for (int64_t t = 0; t < kt; ++t) {
    bf16* b0 = keep ? b + t * BLOCK : b;
    bf16* b1 = keep ? b + (kt + t) * BLOCK : b + BLOCK;
    if (widening) {
      for (int64_t col = 0; col < cols; ++col) {
        const int8_t* qc = q + (col * kt + t) * BLOCK;
        const char* ahead = reinterpret_cast<const char*>(qc + PREFETCH_BLOCKS * BLOCK);
        for (int64_t line = 0; line < BLOCK; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        widen(qc, col ? b1 : b0);
      }
    }
    fence();
    _tile_loadd(4, xr + t * TK, K * 2);
    _tile_loadd(6, b0, TN * 4);
    _tile_dpbf16ps(0, 4, 6);
    if (cols == 2) {
      _tile_loadd(7, b1, TN * 4);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (m1) {
      _tile_loadd(5, xr + TM * K + t * TK, K * 2);
      _tile_dpbf16ps(1, 5, 6);
      if (cols == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[TM * TN];
  _tile_stored(0, c, TN * 4);
  fence();
  scale_rows(c, scale, y, nb, r0, m0, N);
  if (m1) {
    _tile_stored(1, c, TN * 4);
    fence();
    scale_rows(c, scale, y, nb, r0 + TM, m1, N);
  }
  if (cols == 2) {
    _tile_stored(2, c, TN * 4);
    fence();
    scale_rows(c, scale, y, nb + 1, r0, m0, N);
    if (m1) {
      _tile_stored(3, c, TN * 4);
      fence();
      scale_rows(c, scale, y, nb + 1, r0 + TM, m1, N);
    }
  }
}

// Column blocks [begin, end) of y for all M rows on this thread, two at a time: the tile
// configuration is set for a pass's shape (per thread; only a last, partial row block or an odd
// column block changes it), and past 32 rows `b` keeps the pair's widened codes (K * 64 bytes)
// for its next row blocks.
void column_blocks(const bf16* x, const int8_t* packed, const float* scale, bf16* y,
                   int64_t begin, int64_t end, int64_t M, int64_t K, int64_t N) {
  const bool keep = M > MAX_ROWS;
  std::vector<bf16> b(static_cast<size_t>(2 * (keep ? K / TK : 1) * BLOCK));
  int64_t shape = -1;
  for (int64_t nb = begin; nb < end; nb += 2) {
    const int64_t cols = end - nb < 2 ? 1 : 2;
    const int8_t* q = packed + nb * (K / TK) * BLOCK;
    for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
      const int64_t rows = M - r0 < MAX_ROWS ? M - r0 : MAX_ROWS;
      if (rows * 4 + cols != shape) {
        configure(rows < TM ? rows : TM, rows > TM ? rows - TM : 0, cols);
        shape = rows * 4 + cols;
      }
      row_block(x, q, b.data(), r0 == 0, keep, cols, scale, y, nb, r0, rows, K, N);
    }
  }
  _tile_release();
}
#endif

bool available() {
#ifdef FEDKV_AMX
  return fedkv_tiles::request();
#else
  return false;
#endif
}

// q int8 [N, K] -> [N/16, K/32, 16 pairs-of-k, 16 columns, 2]: each 16x32 block in the order
// an AMX bf16 B tile takes it (pairs of consecutive inputs side by side per output column).
torch::Tensor pack(const torch::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(),
              "q must be contiguous int8 [out, in], got ", q.scalar_type(), " ", q.sizes());
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % TN == 0 && K % TK == 0, "AMX packing needs out % 16 == 0 and in % 32 == 0, got ",
              q.sizes());
  return q.view({N / TN, TN, K / TK, TK / 2, 2}).permute({0, 2, 3, 1, 4}).contiguous()
      .view({N / TN, K / TK, BLOCK});
}

// x bf16 [M, K] times the codes packed by pack() (scale fp32 [N]) -> bf16 [M, N].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale) {
  TORCH_CHECK(available(), "AMX bf16 tiles are not available on this CPU or kernel");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2, "x must be bf16 [rows, in]");
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.dim() == 3 &&
                  packed.size(2) == BLOCK && packed.is_contiguous(),
              "packed must come from int8_pack_amx, got ", packed.sizes());
  const int64_t M = x.size(0), K = packed.size(1) * TK, N = packed.size(0) * TN;
  TORCH_CHECK(M >= 1, "int8_linear_amx needs at least one row, got ", M);
  TORCH_CHECK(x.size(1) == K, "x must be [rows, ", K, "], got ", x.sizes());
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == N && scale.is_contiguous(),
              "scale must be contiguous float32 [", N, "]");
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
#ifdef FEDKV_AMX
  const bf16* xp = xc.data_ptr<bf16>();
  const int8_t* qp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, N / TN, 8, [&](int64_t begin, int64_t end) {
    column_blocks(xp, qp, sp, yp, begin, end, M, K, N);
  });
#endif
  return y;
}

}  // namespace fedkv_amx

bool int8_amx_available() { return fedkv_amx::available(); }
torch::Tensor int8_pack_amx(const torch::Tensor& q) { return fedkv_amx::pack(q); }
torch::Tensor int8_linear_amx(const torch::Tensor& x, const torch::Tensor& packed,
                              const torch::Tensor& scale) {
  return fedkv_amx::linear(x, packed, scale);
}
