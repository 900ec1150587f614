// A decode step's (or one session's) new K and V of one layer stored where the cache keeps them
// (node/models/kernels.py builds it into the same extension as kernels.cpp; the cache calls it
// through the store the model hands to KVCache.append_and_read_batch or append_and_read).
//
// Why: the eager path is four indexed ATen stores per layer (K and V into the arena, K and V into
// the batch's tail slots). Their destinations are cold by then -- the layer's weights have just
// streamed through the caches -- and stores retire in order, so each missed line was fetched one
// after the other. Here every destination line is prefetched for writing first, so the misses
// overlap, and then written.
#include <torch/extension.h>
#include <ATen/Dispatch.h>

#include <cstdint>
#include <vector>

namespace {

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 1, 3);
}

template <typename T, typename S>
inline void copy_row(T* dst, const S* src, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d)  // to bf16, fp16: nearest even; from bf16: exact
    dst[d] = static_cast<T>(static_cast<float>(src[d]));
}

// Where each (which of K/V, head, row) goes: its destination row pointers, gathered once so the
// prefetch pass and the store pass walk the same list.
template <typename T, typename S>
struct Rows {
  std::vector<T*> dst;
  std::vector<const S*> src;
};

template <typename T, typename S>
void add_arena(Rows<T, S>& r, const torch::Tensor& arena, const std::vector<int64_t>& pos,
               const S* k, const S* v, int64_t Hk, int64_t B, int64_t D) {
  T* base = arena.data_ptr<T>();
  for (int64_t c = 0; c < 2; ++c)
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t b = 0; b < B; ++b) {
        r.dst.push_back(base + c * arena.stride(0) + h * arena.stride(1) + pos[b] * arena.stride(2));
        r.src.push_back((c ? v : k) + (h * B + b) * D);
      }
}

template <typename T, typename S>
void add_tails(Rows<T, S>& r, const torch::Tensor& tails, const std::vector<int64_t>& slot,
               const std::vector<int64_t>& at, const std::vector<int64_t>& row, const S* k,
               const S* v, int64_t Hk, int64_t B, int64_t D) {
  T* base = tails.data_ptr<T>();
  for (int64_t c = 0; c < 2; ++c)
    for (size_t i = 0; i < slot.size(); ++i)
      for (int64_t h = 0; h < Hk; ++h) {
        r.dst.push_back(base + c * tails.stride(0) + slot[i] * tails.stride(1) +
                        h * tails.stride(2) + at[i] * tails.stride(3));
        r.src.push_back((c ? v : k) + (h * B + row[i]) * D);
      }
}

template <typename T, typename S>
void store(const Rows<T, S>& r, int64_t D) {
  for (T* p : r.dst) prefetch_row(p, D * static_cast<int64_t>(sizeof(T)));
  for (size_t i = 0; i < r.dst.size(); ++i) copy_row(r.dst[i], r.src[i], D);
}

std::vector<int64_t> longs(const torch::Tensor& t, const char* name, int64_t n, int64_t bound) {
  TORCH_CHECK(t.scalar_type() == torch::kLong && t.dim() == 1 && t.numel() == n, name,
              " must be int64 [", n, "], got ", t.scalar_type(), " ", t.sizes());
  auto c = t.contiguous();
  std::vector<int64_t> out(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + n);
  for (int64_t x : out) TORCH_CHECK(x >= 0 && x < bound, name, " ", x, " out of range [0, ", bound, ")");
  return out;
}

void check_store(const torch::Tensor& t, const char* name, int64_t dims, int64_t Hk, int64_t D,
                 int64_t head_dim_at) {
  TORCH_CHECK(t.dim() == dims && t.size(0) == 2 && t.size(head_dim_at) == Hk &&
                  t.size(dims - 1) == D && t.stride(dims - 1) == 1,
              name, " has the wrong shape or layout: ", t.sizes());
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kHalf, name,
              " must be float32, bfloat16 or float16, got ", dt);
}

template <typename S>
void store_rows(torch::Tensor& arena, const std::vector<int64_t>& p, const S* kp, const S* vp,
                torch::Tensor& tails, const std::vector<int64_t>& s, const std::vector<int64_t>& a,
                const std::vector<int64_t>& r, int64_t Hk, int64_t B, int64_t D) {
  AT_DISPATCH_FLOATING_TYPES_AND2(torch::kBFloat16, torch::kHalf, arena.scalar_type(), "arena", [&] {
    Rows<scalar_t, S> rows;
    add_arena(rows, arena, p, kp, vp, Hk, B, D);
    store(rows, D);
  });
  if (s.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(torch::kBFloat16, torch::kHalf, tails.scalar_type(), "tails", [&] {
    Rows<scalar_t, S> rows;
    add_tails(rows, tails, s, a, r, kp, vp, Hk, B, D);
    store(rows, D);
  });
}

}  // namespace

// k, v fp32 or bf16 [kv_heads, B, dim]: row b into arena [2, kv_heads, N, dim] at position
// pos[b]; row rows[i] into tails [2, slots, kv_heads, cap, dim] at slot slots[i], position at[i]
// (slots, at, rows may be empty: no tail store, tails unread). Arena and tails: fp32, bf16 or
// fp16 (rounded to nearest even), as the cache's kv_dtype and batch_tail_dtype make them. A
// decode step's rows, or one session's new tokens (a prefill's bf16 rows among them).
void store_step_kv(torch::Tensor arena, const torch::Tensor& pos, const torch::Tensor& k,
                   const torch::Tensor& v, torch::Tensor tails, const torch::Tensor& slots,
                   const torch::Tensor& at, const torch::Tensor& rows) {
  const auto dt = k.scalar_type();
  TORCH_CHECK((dt == torch::kFloat32 || dt == torch::kBFloat16) && k.dim() == 3 &&
                  k.is_contiguous() && v.sizes() == k.sizes() && v.scalar_type() == dt &&
                  v.is_contiguous(),
              "k, v must be contiguous float32 or bfloat16 [kv_heads, rows, dim] of one dtype, got ",
              k.sizes(), " ", dt, ", ", v.sizes(), " ", v.scalar_type());
  const int64_t Hk = k.size(0), B = k.size(1), D = k.size(2);
  check_store(arena, "arena", 4, Hk, D, 1);
  const auto p = longs(pos, "pos", B, arena.size(2));
  const int64_t n = slots.numel();
  std::vector<int64_t> s, a, r;
  if (n > 0) {
    check_store(tails, "tails", 5, Hk, D, 2);
    s = longs(slots, "slots", n, tails.size(1));
    a = longs(at, "at", n, tails.size(3));
    r = longs(rows, "rows", n, B);
  }
  if (dt == torch::kFloat32)
    store_rows(arena, p, k.data_ptr<float>(), v.data_ptr<float>(), tails, s, a, r, Hk, B, D);
  else
    store_rows(arena, p, k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), tails, s, a, r,
               Hk, B, D);
}
