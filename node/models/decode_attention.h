// A decode step's attention over the cache's K/V runs, grouped-query (decode_attention.cpp;
// node/models/kernels.py builds it into the same extension as kernels.cpp, whose one-call int8
// step and Python binding call it).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace fedkv_decode {

// One strided [heads, n, dim] run of keys or values (a view into the cache's arena or its
// tail buffer); row `t` of head `h` at base + h * head_stride + t * row_stride. The arena is
// fp32 or bf16 (cache.config.CacheConfig.kv_dtype), a tail buffer fp32 or bf16
// (CacheConfig.batch_tail_dtype); bf16 rows are read as fp32.
template <typename T>
struct RunOf {
  const T* base;
  int64_t head_stride, row_stride, n;
};

// attend_decode into `out` (fp32, q's shape, overwritten) for a contiguous fp32 q: no tensor
// made, for a caller that attends every layer of a step (decode_layers in kernels.cpp).
template <typename P>
void attend_decode_into(const torch::Tensor& q, torch::Tensor& out,
                        const std::vector<RunOf<P>>& pk, const std::vector<RunOf<P>>& pv,
                        const torch::Tensor& tail_k, const torch::Tensor& tail_v,
                        const torch::Tensor& tail_valid, const std::vector<int64_t>& slot);

// One lone query row's attention over prefix runs alone (a decode_layers step's, no tail) as
// tasks for the threads of one parallel region: attend_decode_into's tasks, sums and merge for
// that row, so its results are attend_decode_into's. Per layer: begin (one thread, with the
// region's thread count), run (every thread, its tasks), then finish (one thread, after all).
template <typename P>
class LoneRowAttention {
 public:
  // q [kv_heads, group, 1, dim] and out (q's shape), fp32 contiguous, kept for every layer
  LoneRowAttention(const torch::Tensor& q, const torch::Tensor& out);
  void begin(const std::vector<RunOf<P>>& pk, const std::vector<RunOf<P>>& pv, int64_t threads);
  void run(int64_t thread);
  void finish();

 private:
  torch::Tensor q_, out_;
  int64_t threads_ = 1, n_prefix_ = 0, chunks_ = 1;
  const std::vector<RunOf<P>>* pk_ = nullptr;
  const std::vector<RunOf<P>>* pv_ = nullptr;
  std::vector<float> o_, m_, l_;  // per task: each query's unnormalized sums, maxima, exp sums
};

// decode_attention (below) over runs already checked, or made from checked spans: for an
// arena of P = float or c10::BFloat16 (the two decode_attention.cpp instantiates).
template <typename P>
torch::Tensor attend_decode(const torch::Tensor& q, const std::vector<RunOf<P>>& pk,
                            const std::vector<RunOf<P>>& pv, const torch::Tensor& tail_k,
                            const torch::Tensor& tail_v, const torch::Tensor& tail_valid,
                            const std::vector<int64_t>& slot);

// One decode step's attention, grouped-query, over a shared prefix and each row's tail (what
// cache.attention.attend_shared computes, in one pass per (KV head, row)).
//   q [kv_heads, group, rows, dim] fp32; prefix_k/v: runs [kv_heads, n_i, dim], all fp32 or
//   all bf16;
//   tail_k/v [kv_heads, slots, T, dim] (fp32 or bf16); tail_valid bool [slots, T]; slots: row b's tail slot
//   (int64 [rows]), or empty for slot b -> out [kv_heads, group, rows, dim] fp32.
torch::Tensor decode_attention(const torch::Tensor& q, const std::vector<torch::Tensor>& prefix_k,
                               const std::vector<torch::Tensor>& prefix_v,
                               const torch::Tensor& tail_k, const torch::Tensor& tail_v,
                               const torch::Tensor& tail_valid, const torch::Tensor& slots);

}  // namespace fedkv_decode
