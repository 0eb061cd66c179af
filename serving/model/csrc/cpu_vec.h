// The vector types shared by Pylon's CPU kernels, chosen at compile time (the build passes -march=native): V512
// (16 floats, AVX-512), else V256 (8 floats; AVX2 with FMA and F16C, which defines PYLON_AVX2), as `Vec`; with
// neither, `Vec` is not defined and the kernels take their scalar loops.
#pragma once

#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PYLON_AVX2 1  // AVX2 CPUs without AVX-512 (AMD Zen 1-3, Intel client cores): 8 floats a vector
#endif

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
