// Decode attention over the paged KV cache: each sequence's one query attends over its keys and values where they
// lie in the pool, block by block, in one pass with a running softmax, for all the query heads that share a kv
// head, in parallel over (sequence, kv head) pairs. The vector loop (`decode_simd`, over V512 or V256) where the
// build has one and the head dimension fits it, the generic loop otherwise.
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "ops.h"

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
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dtype() == at::kFloat, "paged_decode: float32 queries only");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "paged_decode: keys and values stored alike");
  TORCH_CHECK(block_tables.dtype() == at::kLong && context_lens.dtype() == at::kLong,
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
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const auto kv = k_cache.scalar_type();
  if (kv == at::kFloat) {
    decode_any<F32>(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, lp, op, B, H, D, KVH, NB, BS, MB,
                    fscale);
  } else if (kv == at::kBFloat16) {
    decode_any<BF16>(qp, reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                     reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), tp, lp, op, B, H, D, KVH, NB, BS, MB,
                     fscale);
  } else if (kv == at::kHalf) {
    decode_any<F16>(qp, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), tp, lp, op, B, H, D, KVH, NB,
                    BS, MB, fscale);
  } else if (kv == at::kFloat8_e4m3fn) {
    decode_any<FP8>(qp, reinterpret_cast<const uint8_t*>(k_cache.data_ptr()),
                    reinterpret_cast<const uint8_t*>(v_cache.data_ptr()), tp, lp, op, B, H, D, KVH, NB, BS, MB,
                    fscale);
  } else {
    TORCH_CHECK(false, "paged_decode: caches must be float32, bfloat16, float16 or float8_e4m3fn");
  }
  return out;
}
