#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "ops.h"

// A step's new keys and values into both caches at their slots, in one call: k, v [T, KVH, D] (rows may be strided,
// as views of the fused QKV projection are), stored as the caches store them (the same dtype here); caches
// [KVH, NB, BS, D]; slots [T] (int64), each a position in a head's flattened pool. What `index_copy_` did twice a
// layer, at ~20-30 us a call through TensorIterator for a 16-token decode step; this is a row copy per token and head.
void store_kv_(at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor k, at::Tensor v) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "store_kv_: caches [KVH, NB, BS, D], contiguous, alike");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "store_kv_: keys and values [T, KVH, D] with contiguous rows");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "store_kv_: keys, values and caches of one dtype");
  TORCH_CHECK(slots.dtype() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
              slots.size(0) == k.size(0), "store_kv_: int64 slots, one per token");
  const int64_t T = k.size(0), KVH = k_cache.size(0), D = k_cache.size(3);
  const int64_t pool = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(k.size(1) == KVH && k.size(2) == D, "store_kv_: keys and values do not match the caches' heads");
  const int64_t es = k.element_size(), row = D * es;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < pool, "store_kv_: slot out of range");
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks0 = k.stride(0) * es, ks1 = k.stride(1) * es, vs0 = v.stride(0) * es, vs1 = v.stride(1) * es;
  at::parallel_for(0, KVH, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t dst = (h * pool + sp[t]) * row;
        std::memcpy(kc + dst, kp + t * ks0 + h * ks1, row);
        std::memcpy(vc + dst, vp + t * vs0 + h * vs1, row);
      }
    }
  });
}
