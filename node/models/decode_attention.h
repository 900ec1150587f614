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
// that row, so its results are attend_decode_into's. Made once per step (by one thread, with
// the region's thread count); per layer every thread runs its tasks with its own queries and
// runs, then, after all have, each may take the output (finish): no thread's state is another's
// until that barrier, so the row ops around it need none.
template <typename P>
class LoneRowAttention {
 public:
  // queries [kv_heads, group, 1, dim] over n_prefix context rows, split for `threads`
  LoneRowAttention(int64_t kv_heads, int64_t group, int64_t dim, int64_t n_prefix, int64_t threads);
  // the thread whose tasks read KV head h's last context row (the row a step writes)
  int64_t last_reader(int64_t h) const;
  // thread t's tasks: queries q (fp32 contiguous [kv_heads, group, 1, dim]) over runs pk/pv
  void run(int64_t t, const torch::Tensor& q, const std::vector<RunOf<P>>& pk,
           const std::vector<RunOf<P>>& pv);
  // after every thread's run: the output [kv_heads, group, 1, dim] into out (fp32, overwritten)
  void finish(float* out) const;

 private:
  int64_t Hk_, G_, D_, n_prefix_, chunks_, per_;  // per_: tasks a thread runs (ATen's split)
  torch::Tensor whole_;           // whole heads' outputs (chunks_ == 1)
  std::vector<float> o_, m_, l_;  // per chunk task: each query's unnormalized sums, maxima, exp sums
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
