// The CPU kernels' vectors and the arithmetic they share (included by ragged_paged_attention.cc,
// packed_matmul.cc and block_matmul.cc). Vectors are as wide as the CPU's widest registers (16 floats with
// AVX-512, 8 with AVX, else 4: SSE, NEON), as GCC's vector extension (which Clang takes too),
// so that one source builds for every ISA level.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jaxengine_cpu {

// kIsa names the path for native.isa() (JaxengineCpuIsa), decided here so that it cannot
// disagree with kLanes.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr char kIsa[] = "avx512";
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
constexpr char kIsa[] = "avx2";
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
constexpr char kIsa[] = "avx";
#elif defined(__SSE2__)
constexpr int64_t kLanes = 4;
constexpr char kIsa[] = "sse2";
#elif defined(__ARM_NEON)
constexpr int64_t kLanes = 4;
constexpr char kIsa[] = "neon";
#else
constexpr int64_t kLanes = 4;
constexpr char kIsa[] = "generic";
#endif

// One register of floats.
typedef float fvec __attribute__((vector_size(kLanes * sizeof(float))));

inline fvec loadv(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, fvec v) { std::memcpy(p, &v, sizeof v); }

// The sum of v's lanes, added in a fixed order (a tree of halves with AVX-512 and AVX2, lane by
// lane otherwise), so that it depends on v alone.
inline float lane_sum(fvec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(__m512(v));
#elif defined(__AVX2__)
  const __m256 w = __m256(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float s = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) s += v[l];
  return s;
#endif
}

// kLanes bytes at p (int8 or uint8) widened to a vector of floats. GCC's __builtin_convertvector
// widens bytes one at a time, through general registers; AVX2 and AVX-512 have instructions that
// widen a vector's bytes at once, used where the build has them.
template <typename B>
inline fvec widen(const B* p) {
  static_assert(std::is_same_v<B, int8_t> || std::is_same_v<B, uint8_t>);
  constexpr bool kSigned = std::is_same_v<B, int8_t>;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i i = kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  return fvec(_mm512_cvtepi32_ps(i));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i i = kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  return fvec(_mm256_cvtepi32_ps(i));
#else
  typedef B bytes __attribute__((vector_size(kLanes)));
  bytes b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, fvec);
#endif
}

// e^x for x <= 0 (Cephes' expf polynomial, within ~2 ulp), plain arithmetic so that compilers
// vectorize the loops that call it (std::exp is an opaque call, which blocks that). Always
// inlined: GCC stops inlining it once it has enough callers (fast_tanh's among them), and a
// loop that calls it runs scalar.
[[gnu::always_inline]] inline float fast_exp(float x) {
  x = std::max(x, -87.0f);  // e^-87 ~ 1.6e-38 is still a normal float
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// silu(g) = g * sigmoid(g) (the SwiGLU MLP's activation), vectorisable: e^-|g| never overflows.
[[gnu::always_inline]] inline float fast_silu(float g) {
  const float e = fast_exp(-std::abs(g));
  return g * (g >= 0.0f ? 1.0f : e) / (1.0f + e);
}

// tanh(x) within ~1e-6 relative, vectorisable (Gemma 2's soft-capping of attention scores):
// (1 - e) / (1 + e) with e = e^(-2|x|) <= 1, and under |x| = 1/8, where 1 - e would cancel,
// tanh's odd Taylor series to x^9 (its next term is ~1e-11 relative there); exact at 0.
[[gnu::always_inline]] inline float fast_tanh(float x) {
  const float a = std::fabs(x), a2 = a * a;
  const float series =
      a * (1.0f + a2 * (-1.0f / 3 + a2 * (2.0f / 15 + a2 * (-17.0f / 315 + a2 * (62.0f / 2835)))));
  const float e = fast_exp(-2.0f * a);
  const float t = a < 0.125f ? series : (1.0f - e) / (1.0f + e);
  return std::copysign(t, x);
}

}  // namespace jaxengine_cpu
