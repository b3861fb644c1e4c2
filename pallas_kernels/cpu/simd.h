// The CPU kernels' vectors: as wide as the CPU's widest registers (16 floats with AVX-512, 8
// with AVX, else 4: SSE, NEON), as GCC's vector extension (which Clang takes too), so that one
// source builds for every ISA level (included by ragged_paged_attention.cc and
// packed_matmul.cc).
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxengine_cpu {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif

// One register of floats.
typedef float fvec __attribute__((vector_size(kLanes * sizeof(float))));

inline fvec loadv(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, fvec v) { std::memcpy(p, &v, sizeof v); }

}  // namespace jaxengine_cpu
