"""CPU kernels for serving. A paged-attention kernel for decoding: each sequence's one query attends over its keys and values
where they lie in the paged pool, block by block, without first gathering them into a contiguous batch.

In plain PyTorch (`pylon.serving.attention`) a decode step copies every sequence's blocks into a workspace
(`index_select`) and then runs two batched matmuls over the copy; the copy was a third of a 32-sequence decode
step. This kernel reads each (sequence, kv head)'s blocks once, in place, in one pass with a running softmax
(flash-decoding's max / sum / rescaled accumulator) for all the query heads that share the kv head, in parallel
over (sequence, kv head) pairs on torch's intra-op threads, prefetching the next block's keys and values while
it computes one. It is what vLLM's CPU backend does with its own paged-attention kernels. A decode step reads
the whole live cache (32 sequences of 300 tokens: 20 MB per layer, far past the caches), so it is bound by
memory bandwidth: the one pass with prefetching reads at ~34 GB/s here where the earlier two-pass kernel read
at ~25 (a plain streaming sum reaches ~34 on this 2-core machine).

On one thread (the serving layout on CPUs: one single-threaded engine per core) the scalar loop was the limit
where the cache sits in L3: per key a dot product reduced on its own, a libm `expf` call, and the accumulator
stored and reloaded. Where the compiler targets AVX-512 and the head dimension is 32, 64, 128 or 256, the
kernel keeps a query head's accumulator in registers, takes a block's scores 16 at a time and their
exponentials in one vector (Cephes' polynomial, ~1 ulp): 0.35 against 0.56-0.64 ms for 16 sequences of
200-460 tokens at head_dim 64 when the cache is in L3 (~32 against ~18 GB/s); from DRAM both read ~10-13 GB/s
on one core. Where the compiler targets AVX2 with FMA and F16C but not AVX-512 (AMD Zen 1-3, Intel client cores),
kernel v6 runs the same computation 8 floats a vector (`decode_simd` over `V256`: 8-key chunks, `exp256`; the
AVX-512 loop is the same template over `V512`); on a 2-core Zen 3 EPYC it took a call (16 sequences of 200-460 tokens, head_dim 64, one thread) from the generic loop's 1,937 to
365 us over a float32 cache, 688 -> 394 over bf16, 3,527 -> 429 over fp16, 14,603 -> 562 over fp8. Other head
dimensions and CPUs take the generic loop.

Kernel v4: a block's 16 dot products are added across by one transpose-and-add tree (`sum16`: 45 shuffles and adds
where 16 horizontal reductions took ~128, and the scores come out as a vector instead of through a store and a
reload), and the values go into two sets of accumulators (even and odd keys) so that consecutive multiply-adds do
not wait on each other. On a 2-core Xeon with AMX (480 MiB L3), 16 sequences of ~330 tokens over 4 layers' pools
as the engine lays them out: 654 -> 542 us per call; in the engine, cProfile over one engine's 64 requests:
1.00 -> 0.81-0.86 s. What is left is data movement: a key costs ~6 ns when its block is in L2 and 15-23 ns from
L3 (22-33 GB/s), so fp32 decode attention on one core is bound by how fast the cache hierarchy delivers 512 bytes
of keys and values per cached token (a bf16 or fp8 cache would halve or quarter that, at the price of exact
parity with float32 `generate`).

The same extension has GPT-2's tanh GELU (`gelu_tanh_`): torch's CPU version runs at ~0.3 G elements/s here
(its tanh), ~5% of a decoding step; this one at ~1.6 (AVX-512 or AVX2; the scalar loop: 0.23). And (v7) the store
of a step's keys and values into both caches (`store_kv_`), one row copy per token and head where two
`index_copy_`s a layer went through TensorIterator: 3.0 against 15.7 us a layer for a 16-token decode step, 41
against 187 for a 512-token prompt step (one thread, 4 heads of 64).

Kernel v8 attends prompt chunks too (`prefill_attention_`, AVX-512 or (v9) AVX2, float32 caches, head_dim 32-256):
causal attention of a chunk's queries over its sequence's keys in the pool, 8 queries by 16 keys (AVX2: 8) at a time
in registers,
where torch's flash SDPA multiplied its blocks through MKL's sgemm (operands packed on every call) and computed most of
each prompt's masked half. A 300-token prompt, 4 heads of 64, one thread: 0.65 against 1.26 ms; in a one-thread
engine serving 64 of the serving bench's requests, prompt attention 0.28 -> 0.15 s of ~2.8 s, and 2.48-2.76 against
2.63-2.94 s a run (three alternated pairs). `PYLON_PREFILL_KERNEL=0` keeps SDPA. Kernel v9 builds the same loop
for AVX2 (`prefill_rows` over V256: 8-key groups, an 8x8 transpose); on a 2-core Zen 3 EPYC, one thread, 4 heads of
64: a 300-token prompt 1.66 against 6.03 ms for SDPA over contiguous keys, 512 tokens 4.08 against 13.42; a
one-thread engine prefilling 64 of the bench's prompts (17k tokens, max_tokens 1) 2.16-2.21 against 2.22-2.48 s
(four alternated pairs).

It is compiled once per machine by torch's C++ extension loader into `$TORCH_EXTENSIONS_DIR` (the same cache
as DeepSpeed's ops; `make setup` builds it, `python -m pylon.serving.kernels` builds it by hand). Where it
cannot be built or loaded (no compiler), or with `PYLON_PAGED_KERNEL=0`, the engine uses the PyTorch path,
with the same results up to float rounding. Queries and arithmetic are float32 (half precision on a CPU is slow
anyway, and CUDA devices take the PyTorch path); the cache may be stored as float32, bfloat16, float16 or float8
e4m3 (the engine's kv_cache_dtype), widened to float32 as it is loaded (bf16: a shift; fp16: vcvtph2ps; fp8: its
bits moved into float16's and widened by vcvtph2ps). Kernel v5 (16 sequences of ~330 tokens, 4 layers, one
core, cache in L3): 505-527 us per call over float32, 408-441 over bfloat16, 400-408 over float16, 475-505 over
fp8, whose widening costs about what its bytes save here (fp8 is for capacity); in one engine a bf16 cache took a
step from 7.5-7.8 to 6.9-7.1 ms.
"""
from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

NAME = "pylon_paged_attention_v9"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PYLON_AVX2 1  // AVX2 CPUs without AVX-512 (AMD Zen 1-3, Intel client cores): 8 floats a vector
#endif

// How keys and values are stored in the pool (the engine's kv_cache_dtype); attention always computes in float32.
// Each storage type says how to read one element (`get`) and, on AVX-512, 16 consecutive ones (`load16`).
struct F32 {
  using T = float;
  static inline float get(const T* p) { return *p; }
#ifdef __AVX512F__
  static inline __m512 load16(const T* p) { return _mm512_loadu_ps(p); }
#endif
#ifdef PYLON_AVX2
  static inline __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
#endif
};
struct BF16 {  // the upper half of a float32: widening is a shift
  using T = uint16_t;
  static inline float get(const T* p) {
    const uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
#ifdef __AVX512F__
  static inline __m512 load16(const T* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
#endif
#ifdef PYLON_AVX2
  static inline __m256 load8(const T* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
#endif
};
struct F16 {  // IEEE half
  using T = at::Half;
  static inline float get(const T* p) { return static_cast<float>(*p); }
#ifdef __AVX512F__
  static inline __m512 load16(const T* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#endif
#ifdef PYLON_AVX2
  static inline __m256 load8(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
};
struct FP8 {  // float8 e4m3fn (sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities)
  using T = uint8_t;
  static inline float get(const T* p) {
    const uint32_t x = *p, e = (x >> 3) & 15u, m = x & 7u;
    float f;
    if (e) {  // normal: rebias the exponent from 7 to 127, move the mantissa to the top of float32's
      const uint32_t u = ((e + 120u) << 23) | (m << 20);
      std::memcpy(&f, &u, 4);
    } else {  // subnormal: m * 2^-9
      f = static_cast<float>(m) * 0.001953125f;
    }
    return (x & 0x80u) ? -f : f;
  }
#ifdef __AVX512F__
  static inline __m512 load16(const T* p) {
    // As float16 bits: the 7 magnitude bits shifted up by 7 (float16's exponent is biased by 15, not 7, so the
    // value is 2^-8 of the e4m3 one; subnormals map to float16 subnormals, which vcvtph2ps widens exactly), the
    // sign moved from bit 14 to bit 15 by adding it to itself; then widened and scaled back by 2^8.
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 7);
    const __m256i h = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  }
#endif
#ifdef PYLON_AVX2
  static inline __m256 load8(const T* p) {  // as load16, 8 at a time
    const __m128i t = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
    const __m128i h = _mm_add_epi16(t, _mm_and_si128(t, _mm_set1_epi16(0x4000)));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
  }
#endif
};

// Blocks prefetched ahead of the one being computed: the pool is far larger than the caches, so decode
// attention waits on memory; one block ahead took it from ~25 to ~34 GB/s here (a 2-core EPYC).
#define PYLON_PREFETCH_AHEAD 1

template <typename T>
static inline void prefetch_block(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < elems * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, 1);
}

// Block `blk`'s keys and values of kv head `kh` on their way to the cache (an out-of-range id is skipped here and
// refused where the block is read).
template <typename T>
static inline void prefetch_kv(const T* kp, const T* vp, int64_t blk, int64_t kh, int64_t NB,
                               int64_t block_floats) {
  if (blk < 0 || blk >= NB) return;
  prefetch_block(kp + (kh * NB + blk) * block_floats, block_floats);
  prefetch_block(vp + (kh * NB + blk) * block_floats, block_floats);
}

// The start of one (sequence, kv head) pair in either kernel: its length checked, its running softmax reset (the
// accumulators, maxima and sums of its query heads), its first blocks prefetched. Returns its number of blocks.
template <typename T>
static inline int64_t start_pair(int64_t len, int64_t MB, int64_t BS, const int64_t* table, const T* kp,
                                 const T* vp, int64_t kh, int64_t NB, int64_t block_floats, std::vector<float>& acc,
                                 std::vector<float>& mx, std::vector<float>& sum) {
  TORCH_CHECK(len > 0 && len <= MB * BS, "paged_decode: context length out of range");
  const int64_t nblocks = (len + BS - 1) / BS;
  std::fill(acc.begin(), acc.end(), 0.f);
  std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
  std::fill(sum.begin(), sum.end(), 0.f);
  for (int64_t j = 0; j < nblocks && j < PYLON_PREFETCH_AHEAD; ++j)
    prefetch_kv(kp, vp, table[j], kh, NB, block_floats);
  return nblocks;
}

// Block j of a pair: its id checked, the block PYLON_PREFETCH_AHEAD further on prefetched; where its keys and values
// are, and how many of its keys are in the context.
template <typename T>
struct BlockView {
  const T* k;
  const T* v;
  int64_t n;
};
template <typename T>
static inline BlockView<T> visit_block(int64_t j, int64_t nblocks, int64_t len, const int64_t* table, const T* kp,
                                       const T* vp, int64_t kh, int64_t NB, int64_t BS, int64_t block_floats) {
  const int64_t blk = table[j];
  TORCH_CHECK(blk >= 0 && blk < NB, "paged_decode: block id out of range");
  if (j + PYLON_PREFETCH_AHEAD < nblocks)
    prefetch_kv(kp, vp, table[j + PYLON_PREFETCH_AHEAD], kh, NB, block_floats);
  return {kp + (kh * NB + blk) * block_floats, vp + (kh * NB + blk) * block_floats, std::min(BS, len - j * BS)};
}

// The end of a pair: each of its query heads' output is its accumulator over its softmax sum.
static inline void finish_pair(const std::vector<float>& acc, const std::vector<float>& sum, float* op, int64_t b,
                               int64_t H, int64_t kh, int64_t share, int64_t D) {
  for (int64_t s = 0; s < share; ++s) {
    const float inv = 1.f / sum[s];
    const float* a = acc.data() + s * D;
    float* o = op + (b * H + kh * share + s) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
  }
}

// q: [B, H, D] float32; k_cache, v_cache: [KVH, NB, BS, D] of S's storage type; block_tables: [B, MB]
// (int64); context_lens: [B] (int64). out: [B, H, D]. Query heads kh*share .. kh*share+share-1 read kv head kh.
template <typename S>
static void decode_generic(const float* qp, const typename S::T* kp, const typename S::T* vp, const int64_t* tp,
                           const int64_t* lp, float* op, int64_t B, int64_t H, int64_t D, int64_t KVH, int64_t NB,
                           int64_t BS, int64_t MB, float fscale) {
  const int64_t share = H / KVH;
  const int64_t block_floats = BS * D;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(share * BS), acc(share * D), mx(share), sum(share);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, kh = idx % KVH;
      const int64_t len = lp[b];
      const int64_t* table = tp + b * MB;
      const int64_t nblocks = start_pair(len, MB, BS, table, kp, vp, kh, NB, block_floats, acc, mx, sum);
      const float* qrow0 = qp + (b * H + kh * share) * D;
      // One pass over the blocks with a running softmax (max, sum, rescaled accumulator per query head),
      // the next blocks' keys and values prefetched while this one is computed.
      for (int64_t j = 0; j < nblocks; ++j) {
        const auto view = visit_block(j, nblocks, len, table, kp, vp, kh, NB, BS, block_floats);
        const int64_t n = view.n;
        for (int64_t s = 0; s < share; ++s) {
          const float* qrow = qrow0 + s * D;
          float* sc = scores.data() + s * BS;
          float bmax = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) {
            const typename S::T* krow = view.k + t * D;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; ++d) dot += qrow[d] * S::get(krow + d);
            sc[t] = dot * fscale;
            bmax = std::max(bmax, sc[t]);
          }
          const float m = std::max(mx[s], bmax);
          const float correction = std::exp(mx[s] - m);  // 0 for the first block (mx = -inf)
          float* a = acc.data() + s * D;
          if (correction != 1.f) {
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= correction;
          }
          float total = sum[s] * correction;
          for (int64_t t = 0; t < n; ++t) {
            const float p = std::exp(sc[t] - m);
            total += p;
            const typename S::T* vrow = view.v + t * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * S::get(vrow + d);
          }
          sum[s] = total;
          mx[s] = m;
        }
      }
      finish_pair(acc, sum, op, b, H, kh, share, D);
    }
  });
}

#ifdef __AVX512F__
// exp of 16 floats (Cephes' expf polynomial, ~1 ulp; the exponent applied by scalef), x clamped to
// [-87.3, 88.3] (exp(-87.3) ~ 1e-38 where it should underflow to 0: nothing here tells the two apart).
static inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The sums of 16 vectors, lane t of the result = the sum of v[t]'s 16 lanes: a transpose-and-add tree (45 shuffles
// and adds for 16 sums, where 16 horizontal reductions take ~128), whose result is already the scores vector.
static inline __m512 sum16(const __m512 v[16]) {
  __m512 s2[8], s4[4], s8[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: x0+x2, y0+y2, x1+x3, y1+y3 of x = v[2i], y = v[2i+1]
    s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v[4i] .. v[4i+3]
    const __m512d a = _mm512_castps_pd(s2[2 * i]), b = _mm512_castps_pd(s2[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // lanes: (L0+L1, L2+L3) of s4[2i], then of s4[2i+1]
    s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s8[0], s8[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s8[0], s8[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 floats a vector. Two sets of value accumulators (even and odd keys): consecutive multiply-adds do not wait
// on each other, and AVX-512's 32 registers hold both, and the query.
struct V512 {
  using R = __m512;
  static constexpr int W = 16;
  static constexpr bool kTwoAccumulators = true;
  static constexpr bool kQInRegisters = true;
  template <typename S>
  static inline R kv(const typename S::T* p) { return S::load16(p); }
  static inline R load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static inline R set1(float x) { return _mm512_set1_ps(x); }
  static inline R zero() { return _mm512_setzero_ps(); }
  static inline R add(R a, R b) { return _mm512_add_ps(a, b); }
  static inline R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static inline R div(R a, R b) { return _mm512_div_ps(a, b); }
  static inline R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static inline R exp(R x) { return exp512(x); }
  static inline R sum_across(const R v[W]) { return sum16(v); }
  static inline __mmask16 live(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static inline R live_or(R v, int64_t n, float other) { return _mm512_mask_mov_ps(set1(other), live(n), v); }
  static inline R live_or_zero(R v, int64_t n) { return _mm512_maskz_mov_ps(live(n), v); }
  static inline float hmax(R v) { return _mm512_reduce_max_ps(v); }
  static inline float hsum(R v) { return _mm512_reduce_add_ps(v); }
};
using Vec = V512;
#endif

#ifdef PYLON_AVX2
// exp of 8 floats: exp512's polynomial; 2^n built in the exponent bits (AVX2 has no scalef). n stays in
// [-126, 128] after the clamp; 128 gives the bits of +inf, which is what exp(88.38) is to a float anyway.
static inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Lane t of the result = the sum of v[t]'s 8 lanes (sum16's tree for 8 vectors of 8).
static inline __m256 sum8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a = [v0 v1 v2 v3 of the low 128 bits | the same of the high 128 bits], b likewise for v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// 8 floats a vector. One set of value accumulators, and the query read from L1 for each key: AVX2 has 16
// registers, and at head_dim 64 one set is 8 of them (with the query kept in registers too: 13% slower).
struct V256 {
  using R = __m256;
  static constexpr int W = 8;
  static constexpr bool kTwoAccumulators = false;
  static constexpr bool kQInRegisters = false;
  template <typename S>
  static inline R kv(const typename S::T* p) { return S::load8(p); }
  static inline R load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static inline R set1(float x) { return _mm256_set1_ps(x); }
  static inline R zero() { return _mm256_setzero_ps(); }
  static inline R add(R a, R b) { return _mm256_add_ps(a, b); }
  static inline R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static inline R div(R a, R b) { return _mm256_div_ps(a, b); }
  static inline R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static inline R exp(R x) { return exp256(x); }
  static inline R sum_across(const R v[W]) { return sum8(v); }
  static inline R live(int64_t n) {  // all ones in lanes 0 .. n-1
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  }
  static inline R live_or(R v, int64_t n, float other) { return _mm256_blendv_ps(set1(other), v, live(n)); }
  static inline R live_or_zero(R v, int64_t n) { return _mm256_and_ps(live(n), v); }
  static inline float hmax(R v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  }
  static inline float hsum(R v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
  }
};
using Vec = V256;
#endif

#if defined(__AVX512F__) || defined(PYLON_AVX2)
// The generic loop's computation with the head dimension in ND vectors of V::W floats (V512 or V256): per block
// and query head, W keys' dot products as W vectors of partial sums, added across (`sum_across`) into the scores
// vector; their exponentials in one vector; the values accumulated in registers. Keys and values are widened to
// float32 as they are loaded (V::kv, S's load16 or load8).
template <typename V, typename S, int ND>
static void decode_simd(const float* qp, const typename S::T* kp, const typename S::T* vp, const int64_t* tp,
                        const int64_t* lp, float* op, int64_t B, int64_t H, int64_t KVH, int64_t NB, int64_t BS,
                        int64_t MB, float fscale) {
  using R = typename V::R;
  constexpr int64_t W = V::W, D = W * ND;
  using T = typename S::T;
  const int64_t share = H / KVH, block_floats = BS * D;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(share * D), mx(share), sum(share);
    alignas(64) float pr[W];
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, kh = idx % KVH;
      const int64_t len = lp[b];
      const int64_t* table = tp + b * MB;
      const int64_t nblocks = start_pair(len, MB, BS, table, kp, vp, kh, NB, block_floats, acc, mx, sum);
      const float* qrow0 = qp + (b * H + kh * share) * D;
      for (int64_t j = 0; j < nblocks; ++j) {
        const auto view = visit_block(j, nblocks, len, table, kp, vp, kh, NB, BS, block_floats);
        const T* kblock = view.k;
        const T* vblock = view.v;
        const int64_t n = view.n;
        for (int64_t s = 0; s < share; ++s) {
          const float* qrow = qrow0 + s * D;
          R qv[V::kQInRegisters ? ND : 1];
          if constexpr (V::kQInRegisters) {
            for (int i = 0; i < ND; ++i) qv[i] = V::load(qrow + W * i);
          }
          auto query = [&](int i) -> R {  // from registers, or (AVX2: they are all taken) from L1 each time
            if constexpr (V::kQInRegisters) return qv[i]; else return V::load(qrow + W * i);
          };
          float* a = acc.data() + s * D;
          for (int64_t c0 = 0; c0 < n; c0 += W) {
            const int64_t cn = std::min<int64_t>(W, n - c0);
            R part[W];
            for (int64_t t = 0; t < W; ++t) {
              if (t >= cn) {  // past the context (or the block): masked out below
                part[t] = V::zero();
                continue;
              }
              const T* krow = kblock + (c0 + t) * D;
              R d0 = V::mul(query(0), V::template kv<S>(krow));
              R d1 = ND > 1 ? V::mul(query(1), V::template kv<S>(krow + W)) : V::zero();
              for (int i = 2; i < ND; i += 2) {
                d0 = V::fmadd(query(i), V::template kv<S>(krow + W * i), d0);
                if (i + 1 < ND) d1 = V::fmadd(query(i + 1), V::template kv<S>(krow + W * (i + 1)), d1);
              }
              part[t] = V::add(d0, d1);
            }
            const R scv = V::live_or(V::mul(V::sum_across(part), V::set1(fscale)), cn,
                                     -std::numeric_limits<float>::infinity());
            const float m = std::max(mx[s], V::hmax(scv));
            const float correction = std::exp(mx[s] - m);  // 0 for the first chunk (mx = -inf)
            const R p = V::live_or_zero(V::exp(V::sub(scv, V::set1(m))), cn);
            sum[s] = sum[s] * correction + V::hsum(p);
            mx[s] = m;
            V::store(pr, p);
            R av[ND], bv[ND];
            const R cv = V::set1(correction);
            for (int i = 0; i < ND; ++i) {
              av[i] = V::mul(V::load(a + W * i), cv);
              bv[i] = V::zero();
            }
            int64_t t = 0;
            if constexpr (V::kTwoAccumulators) {
              for (; t + 1 < cn; t += 2) {
                const R p0 = V::set1(pr[t]), p1 = V::set1(pr[t + 1]);
                const T* v0 = vblock + (c0 + t) * D;
                for (int i = 0; i < ND; ++i) {
                  av[i] = V::fmadd(p0, V::template kv<S>(v0 + W * i), av[i]);
                  bv[i] = V::fmadd(p1, V::template kv<S>(v0 + D + W * i), bv[i]);
                }
              }
            }
            for (; t < cn; ++t) {
              const R p0 = V::set1(pr[t]);
              const T* v0 = vblock + (c0 + t) * D;
              for (int i = 0; i < ND; ++i) av[i] = V::fmadd(p0, V::template kv<S>(v0 + W * i), av[i]);
            }
            for (int i = 0; i < ND; ++i) V::store(a + W * i, V::kTwoAccumulators ? V::add(av[i], bv[i]) : av[i]);
          }
        }
      }
      finish_pair(acc, sum, op, b, H, kh, share, D);
    }
  });
}
#endif

// One storage type: the vector loop where it was compiled for (AVX-512 or AVX2) and the head dimension is 2, 4, 8,
// 16 or 32 vectors (AVX-512: 32-512; AVX2: 16-256), the generic one otherwise.
template <typename S>
static void decode_any(const float* qp, const typename S::T* kp, const typename S::T* vp, const int64_t* tp,
                       const int64_t* lp, float* op, int64_t B, int64_t H, int64_t D, int64_t KVH, int64_t NB,
                       int64_t BS, int64_t MB, float fscale) {
#if defined(__AVX512F__) || defined(PYLON_AVX2)
  auto run = [&](auto nd) {
    decode_simd<Vec, S, decltype(nd)::value>(qp, kp, vp, tp, lp, op, B, H, KVH, NB, BS, MB, fscale);
  };
  if (D == 2 * Vec::W) return run(std::integral_constant<int, 2>{});
  if (D == 4 * Vec::W) return run(std::integral_constant<int, 4>{});
  if (D == 8 * Vec::W) return run(std::integral_constant<int, 8>{});
  if (D == 16 * Vec::W) return run(std::integral_constant<int, 16>{});
  if (D == 32 * Vec::W) return run(std::integral_constant<int, 32>{});
#endif
  decode_generic<S>(qp, kp, vp, tp, lp, op, B, H, D, KVH, NB, BS, MB, fscale);
}

// q: [B, H, D] float32; k_cache, v_cache: [KVH, NB, BS, D], float32, bfloat16, float16 or float8_e4m3fn (both the
// same); block_tables: [B, MB] int64; context_lens: [B] int64. Returns [B, H, D] float32.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "paged_decode: float32 queries only");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "paged_decode: keys and values stored alike");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64,
              "paged_decode: int64 block tables and lengths");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && block_tables.dim() == 2 &&
              context_lens.dim() == 1, "paged_decode: q [B, H, D], caches [KVH, NB, BS, D], tables [B, MB], lens [B]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: contiguous caches");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t MB = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && block_tables.size(0) == B && context_lens.size(0) == B,
              "paged_decode: shape mismatch");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const auto kv = k_cache.scalar_type();
  if (kv == torch::kFloat32) {
    decode_any<F32>(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, lp, op, B, H, D, KVH, NB, BS, MB,
                    fscale);
  } else if (kv == torch::kBFloat16) {
    decode_any<BF16>(qp, reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                     reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), tp, lp, op, B, H, D, KVH, NB, BS, MB,
                     fscale);
  } else if (kv == torch::kHalf) {
    decode_any<F16>(qp, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), tp, lp, op, B, H, D, KVH, NB,
                    BS, MB, fscale);
  } else if (kv == torch::kFloat8_e4m3fn) {
    decode_any<FP8>(qp, reinterpret_cast<const uint8_t*>(k_cache.data_ptr()),
                    reinterpret_cast<const uint8_t*>(v_cache.data_ptr()), tp, lp, op, B, H, D, KVH, NB, BS, MB,
                    fscale);
  } else {
    TORCH_CHECK(false, "paged_decode: caches must be float32, bfloat16, float16 or float8_e4m3fn");
  }
  return out;
}

// A step's new keys and values into both caches at their slots, in one call: k, v [T, KVH, D] (rows may be strided,
// as views of the fused QKV projection are), stored as the caches store them (the same dtype here); caches
// [KVH, NB, BS, D]; slots [T] (int64), each a position in a head's flattened pool. What `index_copy_` did twice a
// layer, at ~20-30 us a call through TensorIterator for a 16-token decode step; this is a row copy per token and head.
void store_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "store_kv_: caches [KVH, NB, BS, D], contiguous, alike");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "store_kv_: keys and values [T, KVH, D] with contiguous rows");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "store_kv_: keys, values and caches of one dtype");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous() &&
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

// Causal attention of a prompt chunk (kernel v8): the chunk's queries, at positions start..start+T-1, over its
// sequence's keys and values 0..start+T-1 where they lie in a float32 pool (the chunk's own already stored), query
// t seeing keys up to start+t. torch's flash SDPA on a CPU runs its blocks' products through MKL's sgemm, which
// packs both operands on every call and, with its 64-query by 512-key blocks, computes the masked half of most
// prompts' squares too. Here a kv head's keys are first gathered and transposed into groups of a vector's width W
// (16 on AVX-512, 8 on AVX2; `[groups][head_dim][W]`: one vector holds one dimension of W keys) and its values
// gathered contiguously; then each query head's queries go 8 at a time (`PYLON_PREFILL_ROWS`) through the groups up
// to the last one they see: 8 score vectors in registers (a broadcast query element times a key vector, head_dim
// times), the online softmax of flash attention per row, and the W keys' values added into the 8 rows'
// accumulators. A 300-token prompt, 4 heads of 64, one thread (AVX-512): 0.65 against 1.26 ms for SDPA; 512 tokens:
// 1.77 against 3.32. The AVX2 build (kernel v9) is the same template over V256.
#define PYLON_PREFILL_ROWS 8
#ifdef __AVX512F__
static inline void transpose16(__m512 r[16]) {  // r[i][j] <- r[j][i]
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
  }
}
static inline void transpose_keys(__m512 r[16]) { transpose16(r); }
#endif
#ifdef PYLON_AVX2
static inline void transpose_keys(__m256 r[8]) {  // r[i][j] <- r[j][i], 8 x 8
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {  // 128-bit halves: rows 0-3 from u[0-3], rows 4-7 from u[4-7]
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}
#endif

#if defined(__AVX512F__) || defined(PYLON_AVX2)
// `rows` (<= NR) queries of one head at positions pos0.. (scaled, `qs`: NR rows of D, the last repeated as padding)
// over one kv head's transposed keys `kt` (groups of V::W keys: `[group][D][W]`) and values `vc`; their outputs to
// `out` (row stride `out_stride`). NR score vectors, a key vector and a broadcast query element in registers: 10 of
// AVX2's 16, 10 of AVX-512's 32.
template <typename V, int NR, int ND>
static void prefill_rows(const float* qs, float* out, int64_t out_stride, int64_t rows, int64_t pos0,
                         const float* kt, const float* vc) {
  using R = typename V::R;
  constexpr int W = V::W, D = ND * W;
  alignas(64) float o[NR][D];
  alignas(64) float p[NR][W];
  float m[NR], l[NR];
  for (int r = 0; r < NR; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::memset(o, 0, sizeof(o));
  const int64_t last = pos0 + rows - 1;  // the last key any of the rows sees
  for (int64_t g = 0; g <= last / W; ++g) {
    const float* K = kt + g * D * W;
    R s[NR];
    for (int r = 0; r < NR; ++r) s[r] = V::zero();
    for (int d = 0; d < D; ++d) {
      const R kv = V::load(K + d * W);
      for (int r = 0; r < NR; ++r) s[r] = V::fmadd(V::set1(qs[r * D + d]), kv, s[r]);
    }
    const int64_t k0 = g * W;
    for (int r = 0; r < NR; ++r) {
      const int64_t n = pos0 + std::min<int64_t>(r, rows - 1) - k0 + 1;  // keys of this group row r sees
      if (n <= 0) {
        V::store(p[r], V::zero());
        continue;
      }
      const int64_t live = std::min<int64_t>(n, W);
      const float mnew = std::max(m[r], V::hmax(V::live_or(s[r], live, -std::numeric_limits<float>::infinity())));
      const float corr = std::exp(m[r] - mnew);  // 0 for the first group a row sees (m = -inf)
      const R pv = V::live_or_zero(V::exp(V::sub(s[r], V::set1(mnew))), live);
      l[r] = l[r] * corr + V::hsum(pv);
      V::store(p[r], pv);
      if (corr != 1.f) {
        const R c = V::set1(corr);
        for (int i = 0; i < ND; ++i) V::store(o[r] + W * i, V::mul(c, V::load(o[r] + W * i)));
      }
      m[r] = mnew;
    }
    const float* Vp = vc + k0 * D;
    const int64_t nk = std::min<int64_t>(W, last - k0 + 1);
    for (int i = 0; i < ND; ++i) {
      R acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = V::load(o[r] + W * i);
      for (int64_t j = 0; j < nk; ++j) {
        const R vv = V::load(Vp + j * D + W * i);
        for (int r = 0; r < NR; ++r) acc[r] = V::fmadd(V::set1(p[r][j]), vv, acc[r]);
      }
      for (int r = 0; r < NR; ++r) V::store(o[r] + W * i, acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const R inv = V::set1(1.f / l[r]);
    for (int i = 0; i < ND; ++i) V::store(out + r * out_stride + W * i, V::mul(inv, V::load(o[r] + W * i)));
  }
}

template <typename V, int ND>
static void prefill_heads(torch::Tensor& out, const torch::Tensor& q, const float* kt, const float* vc,
                          int64_t start, float scale, int64_t KH, int64_t NK) {
  constexpr int W = V::W, D = ND * W, NR = PYLON_PREFILL_ROWS;
  const int64_t T = q.size(0), H = q.size(1), share = H / KH, tiles = (T + NR - 1) / NR;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  at::parallel_for(0, H * tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qs[NR * D];
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t h = idx / tiles, t0 = (idx % tiles) * NR, rows = std::min<int64_t>(NR, T - t0), kh = h / share;
      for (int r = 0; r < NR; ++r) {
        const float* src = qp + (t0 + std::min<int64_t>(r, rows - 1)) * qs0 + h * qs1;
        for (int d = 0; d < D; ++d) qs[r * D + d] = src[d] * scale;
      }
      prefill_rows<V, NR, ND>(qs, op + t0 * os0 + h * os1, os0, rows, start + t0, kt + kh * NK * D * W,
                              vc + kh * NK * W * D);
    }
  });
}
#endif

bool has_prefill() {
#if defined(__AVX512F__) || defined(PYLON_AVX2)
  return true;
#else
  return false;
#endif
}

// out `[T, heads, head_dim]` (rows contiguous) <- attention of q `[T, heads, head_dim]` (a prompt chunk's queries,
// any row and head strides) over keys 0..start+T-1 of the float32 caches through `table` (the sequence's block table,
// at least (start+T)/block_size blocks).
void prefill_attention_(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor table, int64_t start, double scale) {
#if !defined(__AVX512F__) && !defined(PYLON_AVX2)
  TORCH_CHECK(false, "prefill_attention_: built without AVX-512 or AVX2");
#else
  TORCH_CHECK(q.dim() == 3 && q.dtype() == torch::kFloat32 && q.stride(2) == 1 && out.sizes() == q.sizes() &&
              out.dtype() == torch::kFloat32 && out.stride(2) == 1, "prefill_attention_: float32 q and out");
  TORCH_CHECK(k_cache.dtype() == torch::kFloat32 && v_cache.dtype() == torch::kFloat32 && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "prefill_attention_: contiguous float32 caches");
  TORCH_CHECK(table.dtype() == torch::kInt64 && table.is_contiguous(), "prefill_attention_: an int64 block table");
  using R = Vec::R;
  constexpr int64_t W = Vec::W;
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t L = start + T, NK = (L + W - 1) / W;
  TORCH_CHECK(k_cache.size(3) == D && H % KH == 0 && table.numel() * BS >= L, "prefill_attention_: shapes");
  if (T == 0) return;
  const int64_t* tb = table.data_ptr<int64_t>();
  for (int64_t j = 0; j < L; j += BS) TORCH_CHECK(tb[j / BS] >= 0 && tb[j / BS] < NB, "prefill_attention_: block id");
  auto kt = torch::empty({KH, NK, D, W}, q.options());
  auto vc = torch::empty({KH, NK * W, D}, q.options());
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* ktp = kt.data_ptr<float>();
  float* vcp = vc.data_ptr<float>();
  at::parallel_for(0, KH * NK, 4, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t kh = idx / NK, g = idx % NK;
      const float* rows[W];
      for (int64_t jj = 0; jj < W; ++jj) {
        const int64_t j = g * W + jj;
        float* vdst = vcp + (kh * NK * W + j) * D;
        if (j < L) {
          const int64_t off = ((kh * NB + tb[j / BS]) * BS + j % BS) * D;
          rows[jj] = kp + off;
          std::memcpy(vdst, vp + off, D * sizeof(float));
        } else {
          rows[jj] = nullptr;
          std::memset(vdst, 0, D * sizeof(float));
        }
      }
      float* dst = ktp + idx * D * W;
      for (int64_t d0 = 0; d0 < D; d0 += W) {
        R r[W];
        for (int jj = 0; jj < W; ++jj) r[jj] = rows[jj] ? Vec::load(rows[jj] + d0) : Vec::zero();
        transpose_keys(r);
        for (int i = 0; i < W; ++i) Vec::store(dst + (d0 + i) * W, r[i]);
      }
    }
  });
  const float sc = static_cast<float>(scale);
  switch (D) {
    case 32: prefill_heads<Vec, 32 / W>(out, q, ktp, vcp, start, sc, KH, NK); break;
    case 64: prefill_heads<Vec, 64 / W>(out, q, ktp, vcp, start, sc, KH, NK); break;
    case 128: prefill_heads<Vec, 128 / W>(out, q, ktp, vcp, start, sc, KH, NK); break;
    case 256: prefill_heads<Vec, 256 / W>(out, q, ktp, vcp, start, sc, KH, NK); break;
    default: TORCH_CHECK(false, "prefill_attention_: head_dim must be 32, 64, 128 or 256 (got ", D, ")");
  }
#endif
}

// GPT-2's GELU, the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in place. Written as
// x * sigmoid(2u) = x / (1 + exp(-2u)), which is the same function: one exponential and one division per
// element. torch's CPU `gelu(approximate="tanh")` runs at ~0.3 G elements/s here (its tanh is the slow part),
// ~5% of a decoding step; this runs at several G elements/s. Results agree within a few float ulps.
void gelu_tanh_(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "gelu_tanh_: a contiguous float32 CPU tensor");
  float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX512F__) || defined(PYLON_AVX2)
    using R = Vec::R;
    const R c0 = Vec::set1(-2.f * 0.7978845608028654f), c1 = Vec::set1(0.044715f), one = Vec::set1(1.f);
    for (; i + Vec::W <= end; i += Vec::W) {
      const R v = Vec::load(p + i);
      const R inner = Vec::fmadd(Vec::mul(c1, v), Vec::mul(v, v), v);  // x + 0.044715 x^3
      Vec::store(p + i, Vec::div(v, Vec::add(one, Vec::exp(Vec::mul(c0, inner)))));
    }
#endif
    for (; i < end; ++i) {
      const float v = p[i];
      p[i] = v / (1.f + std::exp(-2.f * 0.7978845608028654f * (v + 0.044715f * v * v * v)));
    }
  });
}
"""

_lock = threading.Lock()
_module = None
_failed: str | None = None


def enabled() -> bool:
    from pylon.serving import switched_on

    return switched_on("PYLON_PAGED_KERNEL")


def load(verbose: bool = False):
    """The compiled module (building it the first time on this machine), or None where it cannot be had."""
    global _module, _failed
    if _module is not None or _failed is not None or not enabled():
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        try:
            from torch.utils.cpp_extension import load_inline

            from pylon.ops import venv_tools_first

            venv_tools_first()  # torch runs the `ninja` first on PATH: the venv's, as for every build of Pylon's

            _module = load_inline(
                name=NAME, cpp_sources=[_SOURCE], functions=["paged_decode", "gelu_tanh_", "store_kv_", "prefill_attention_", "has_prefill"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=verbose)
        except Exception as e:  # no compiler, no headers, a build error: the PyTorch path still works
            _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("paged-attention kernel unavailable (%s); decoding uses the PyTorch path", _failed)
    return _module


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`[B, heads, head_dim]` attention output of one query per sequence; see the module's docstring."""
    module = load()
    if module is None:
        raise RuntimeError(f"the paged-attention kernel is not available: {_failed or 'disabled'}")
    return module.paged_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale))


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (GPT-2's "gelu_new") applied to the contiguous float32 CPU tensor `x` in
    place; returns `x`."""
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU kernels are not available: {_failed or 'disabled'}")
    module.gelu_tanh_(x)
    return x


def store_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    """Write a step's keys and values (`[T, kv_heads, head_dim]`, the caches' dtype) at their slots of both caches
    (`[kv_heads, num_blocks, block_size, head_dim]`) in one call; see `pylon.serving.attention.store_kv`."""
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU kernels are not available: {_failed or 'disabled'}")
    module.store_kv_(k_cache, v_cache, slot_mapping, k, v)


def prefill_attention_(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       table: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of a prompt chunk's queries `q` (`[T, heads, head_dim]`, at positions start..start+T-1) over
    its sequence's keys and values 0..start+T-1 in the float32 caches, found through its block `table`, into `out`
    (`q`'s shape, rows contiguous); returns `out`. Only where `prefill_usable` says so."""
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU kernels are not available: {_failed or 'disabled'}")
    module.prefill_attention_(out, q, k_cache, v_cache, table, int(start), float(scale))
    return out


PREFILL_HEAD_DIMS = (32, 64, 128, 256)


def prefill_usable(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prompt chunks of a CPU model can go to `prefill_attention_`: float32 compute over a float32 cache
    (narrower caches keep SDPA over the chunk's own unrounded keys), a head_dim it is built for, and AVX-512 or AVX2."""
    from pylon.serving import switched_on

    if dtype != torch.float32 or kv_dtype != torch.float32 or head_dim not in PREFILL_HEAD_DIMS:
        return False
    module = load()
    return module is not None and bool(module.has_prefill()) and switched_on("PYLON_PREFILL_KERNEL")


KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)  # how the kernel reads a cache


def usable(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether decodes of a model computing in `dtype` over a cache stored as `kv_dtype` (default: `dtype`) can
    go to the kernel: on a CPU, float32 compute, any of KV_DTYPES, and the kernel built."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return device.type == "cpu" and dtype == torch.float32 and kv_dtype in KV_DTYPES and load() is not None


if __name__ == "__main__":
    import time

    started = time.perf_counter()
    mod = load(verbose=False)
    if mod is None:
        raise SystemExit(f"paged-attention kernel: not built ({_failed or 'disabled by PYLON_PAGED_KERNEL'})")
    print(f"paged-attention kernel ready ({time.perf_counter() - started:.1f}s)")
