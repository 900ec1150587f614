// Weight-only int8 linear on AMX tiles for a decode batch's rows (node/models/kernels.py builds
// it into the same extension as kernels.cpp; node/models/precision.py calls it).
//
// Why: past a few rows the AVX-512 int8 kernel (kernels.cpp) is bound by its fp32 multiply-adds
// and the bf16 path by reading 2 bytes per weight. Here each 16x32 block of int8 codes is widened
// to bf16 once per call and multiplied on the AMX unit for up to 32 rows at a time, so a step
// reads 1 byte per weight whatever its row count. Codes are exact in bf16 and AMX accumulates
// bf16 products in fp32, so this computes what the bf16 copy of the dequantized weights does
// (up to the order of the fp32 additions).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "amx_tiles.h"

namespace fedkv_amx {

using bf16 = c10::BFloat16;

constexpr int64_t TN = 16;   // output columns per tile
constexpr int64_t TK = 32;   // inputs per tile (bf16 pairs x 16)
constexpr int64_t TM = 16;   // rows per tile
constexpr int64_t BLOCK = TN * TK;  // codes per packed block
constexpr int64_t MAX_ROWS = 2 * TM;
constexpr int64_t PREFETCH_BLOCKS = 8;  // how many blocks ahead of the one widened the codes are fetched

#ifdef FEDKV_AMX
using fedkv_tiles::fence;

// tmm0/1: fp32 sums of row blocks 0/1; tmm2/3: their bf16 inputs; tmm4: the widened codes.
void configure(int64_t m0, int64_t m1) {
  fedkv_tiles::Config c;
  std::memset(&c, 0, sizeof c);  // ldtilecfg faults on any nonzero reserved byte
  c.palette = 1;
  c.rows[0] = m0; c.colsb[0] = TN * 4;
  c.rows[2] = m0; c.colsb[2] = TK * 2;
  if (m1) {
    c.rows[1] = m1; c.colsb[1] = TN * 4;
    c.rows[3] = m1; c.colsb[3] = TK * 2;
  }
  c.rows[4] = TK / 2; c.colsb[4] = TN * 4;
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

// One 16-column block of y: sum over K's tiles, then scale and round to bf16.
void column_block(const bf16* x, const int8_t* packed, const float* scale, bf16* y,
                  int64_t nb, int64_t M, int64_t K, int64_t N) {
  const int64_t m0 = M < TM ? M : TM, m1 = M - m0, kt = K / TK;
  alignas(64) bf16 b[BLOCK];
  alignas(64) float c[TM * TN];
  _tile_zero(0);
  if (m1) _tile_zero(1);
  const int8_t* q = packed + nb * kt * BLOCK;
  for (int64_t t = 0; t < kt; ++t) {
    const char* ahead = reinterpret_cast<const char*>(q + (t + PREFETCH_BLOCKS) * BLOCK);
    for (int64_t line = 0; line < BLOCK; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    widen(q + t * BLOCK, b);
    fence();
    _tile_loadd(4, b, TN * 4);
    _tile_loadd(2, x + t * TK, K * 2);
    _tile_dpbf16ps(0, 2, 4);
    if (m1) {
      _tile_loadd(3, x + TM * K + t * TK, K * 2);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  for (int64_t half = 0; half < (m1 ? 2 : 1); ++half) {
    if (half == 0) _tile_stored(0, c, TN * 4); else _tile_stored(1, c, TN * 4);
    fence();
    const int64_t rows = half ? m1 : m0;
    __m512 s = _mm512_loadu_ps(scale + nb * TN);
    for (int64_t r = 0; r < rows; ++r) {
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(c + r * TN), s);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (half * TM + r) * N + nb * TN),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
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

// x bf16 [M <= 32, K] times the codes packed by pack() (scale fp32 [N]) -> bf16 [M, N].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale) {
  TORCH_CHECK(available(), "AMX bf16 tiles are not available on this CPU or kernel");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2, "x must be bf16 [rows, in]");
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.dim() == 3 &&
                  packed.size(2) == BLOCK && packed.is_contiguous(),
              "packed must come from int8_pack_amx, got ", packed.sizes());
  const int64_t M = x.size(0), K = packed.size(1) * TK, N = packed.size(0) * TN;
  TORCH_CHECK(M >= 1 && M <= MAX_ROWS, "int8_linear_amx takes 1 to ", MAX_ROWS, " rows, got ", M);
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
  const int64_t m0 = M < TM ? M : TM;
  at::parallel_for(0, N / TN, 8, [&](int64_t begin, int64_t end) {
    configure(m0, M - m0);  // tile state is per thread
    for (int64_t nb = begin; nb < end; ++nb) column_block(xp, qp, sp, yp, nb, M, K, N);
    _tile_release();
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
