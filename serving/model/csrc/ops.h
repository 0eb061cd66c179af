// The functions the extension exports (bound in bindings.cpp, wrapped by pylon/serving/model/kernels.py).
#pragma once

#include <ATen/core/Tensor.h>

// Decode attention over the paged cache (paged_attention.cpp).
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor context_lens, double scale);

// Causal attention of a prompt chunk over the paged float32 cache, or a draft tree's by ancestry
// (prefill_attention.cpp); has_prefill says whether this build has it (AVX-512 or AVX2).
void prefill_attention_(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor table, int64_t start, double scale, at::Tensor tree);
bool has_prefill();

// A step's keys and values into both caches at their slots (cache.cpp).
void store_kv_(at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor k, at::Tensor v);

// GPT-2's tanh GELU, in place (activation.cpp).
void gelu_tanh_(at::Tensor x);
