// A float32 grouped matmul as an XLA FFI custom call: y[r] = x[r] @ w[g] for the rows r of
// group g, with x [M, K] sorted by group, w [E, K, N] one matrix per group, group_sizes i32[E];
// rows past the groups' total come out zero.
// jaxengine_kernels/cpu/native.py compiles and registers it, jaxengine_kernels/grouped_matmul.py
// calls it (impl "native"), and the tests hold it to numpy's products.
//
// Why native code: a mixture-of-experts layer runs each chosen expert's weights against its few
// rows (a decode step), and XLA's CPU dot reads no slice of a larger array in place: it copies
// each expert's [K, N] out of [E, K, N] first, about twice the dot's own read
// (docs/JAX_NOTES.md, "XLA on CPU"). Here each chosen expert's matrix is read where it lies, and
// an expert no row chose is never read.
//
// Work: units of one strip of kStrip output columns x a run of at most kRunRows rows of one
// group, taken by XLA's intra-op threads from a shared counter (parallel_for.h). Inside a unit,
// blocks of kRowBlock rows keep kRowBlock x kVectors vectors of sums in registers while the
// strip of w (kStrip floats of each of its K rows, stride N) streams by.
// Numerics: float32 multiply-adds in K's order for each output, whatever the rows beside it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxengine_cpu::fvec;
using jaxengine_cpu::kLanes;
using jaxengine_cpu::loadv;
using jaxengine_cpu::parallel_for;
using jaxengine_cpu::storev;

#if defined(__AVX512F__)
constexpr int64_t kRowBlock = 6, kVectors = 4;  // 24 sums + 4 weights + 1 broadcast of 32
#else
constexpr int64_t kRowBlock = 2, kVectors = 4;  // 8 + 4 + 1 of 16
#endif
constexpr int64_t kStrip = kVectors * kLanes;  // output columns per unit
constexpr int64_t kRunRows = 96;               // rows per unit (a decode's rows are one run)
constexpr int64_t kLine = 64 / sizeof(float);  // floats per cache line
constexpr int64_t kAhead = 32;                 // strip rows between a prefetch and its use
// Rows of a chunk: 8 rows a page apart fall in the same L1 sets, within its 12 ways.
constexpr int64_t kChunk = 8;
constexpr int64_t kChunkRows = 48;  // the most rows of a unit taken in chunks

struct Unit {
  int64_t group, n0, m0, m1;  // rows [m0, m1) of `group` against columns [n0, n0 + kStrip)
};

// R rows of x (row stride ldx) against kc rows of a full strip of w (row stride ldw); the sums
// go to y (row stride ldy), added to what it holds when Add. Prefetch: each strip row kAhead
// rows before its use (rows a page apart, as [K, N]'s strips are at N = 1024, defeat the
// hardware's prefetcher).
template <int64_t R, bool Prefetch, bool Add>
inline void row_block(const float* x, int64_t ldx, int64_t kc, const float* w, int64_t ldw,
                      float* y, int64_t ldy) {
  fvec acc[R][kVectors];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kVectors; ++v)
      acc[r][v] = Add ? loadv(y + r * ldy + v * kLanes) : fvec{};
  for (int64_t k = 0; k < kc; ++k) {
    if (Prefetch && k + kAhead < kc)
      for (int64_t v = 0; v < kStrip; v += kLine) __builtin_prefetch(w + (k + kAhead) * ldw + v);
    fvec wv[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) wv[v] = loadv(w + k * ldw + v * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const float b = x[r * ldx + k];  // broadcast by the vector product
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] += wv[v] * b;
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kVectors; ++v) storev(y + r * ldy + v * kLanes, acc[r][v]);
}

template <bool Prefetch, bool Add, int64_t R = kRowBlock>
inline void row_tail(int64_t rows, const float* x, int64_t ldx, int64_t kc, const float* w,
                     int64_t ldw, float* y, int64_t ldy) {
  if constexpr (R > 0) {
    if (rows == R) return row_block<R, Prefetch, Add>(x, ldx, kc, w, ldw, y, ldy);
    row_tail<Prefetch, Add, R - 1>(rows, x, ldx, kc, w, ldw, y, ldy);
  }
}

// A strip narrower than kStrip (N not a multiple of it): plain loops, in K's order too.
void narrow(const float* x, const float* w, float* y, int64_t rows, int64_t K, int64_t N,
            int64_t width) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += x[r * K + k] * w[k * N + c];
      y[r * N + c] = sum;
    }
}

// A run of a few row blocks (a decode's rows of one expert): the strip in chunks of kChunk rows,
// every block over one chunk (in L1) before the next, the sums kept in a buffer, so that the
// strip streams from memory once; the chunk after next is asked for while one computes.
void chunked(const float* x, int64_t rows, const float* w, float* y, int64_t K, int64_t N) {
  alignas(64) float sums[kChunkRows * kStrip];
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, K - k0);
    for (int64_t k = k0 + 2 * kChunk; k < std::min(K, k0 + 3 * kChunk); ++k)
      for (int64_t v = 0; v < kStrip; v += kLine) __builtin_prefetch(w + k * N + v);
    for (int64_t m = 0; m < rows; m += kRowBlock) {
      const int64_t r = std::min(kRowBlock, rows - m);
      if (k0 == 0)
        row_tail<false, false>(r, x + m * K, K, kc, w, N, sums + m * kStrip, kStrip);
      else
        row_tail<false, true>(r, x + m * K + k0, K, kc, w + k0 * N, N, sums + m * kStrip,
                              kStrip);
    }
  }
  for (int64_t m = 0; m < rows; ++m)
    std::memcpy(y + m * N, sums + m * kStrip, sizeof(float) * kStrip);
}

// One unit (see the top). One row block reads its strip once, in place; a few blocks take it
// in chunks (`chunked`); a long run (prefill) first copies the strip into a contiguous buffer
// that its blocks reread from cache (in place, K rows a page apart map to a few cache sets and
// evict each other).
void unit(const float* X, const float* W, float* Y, int64_t K, int64_t N, const Unit& u) {
  const float* w = W + u.group * K * N + u.n0;
  const float* x = X + u.m0 * K;
  float* y = Y + u.m0 * N + u.n0;
  const int64_t width = std::min(kStrip, N - u.n0), rows = u.m1 - u.m0;
  if (width < kStrip) return narrow(x, w, y, rows, K, N, width);
  if (rows <= kRowBlock) return row_tail<true, false>(rows, x, K, K, w, N, y, N);
  if (rows <= kChunkRows) return chunked(x, rows, w, y, K, N);
  thread_local std::vector<float> strip;
  strip.resize(K * kStrip);
  for (int64_t k = 0; k < K; ++k) {
    if (k + kAhead < K)
      for (int64_t v = 0; v < kStrip; v += kLine) __builtin_prefetch(w + (k + kAhead) * N + v);
    std::memcpy(&strip[k * kStrip], w + k * N, sizeof(float) * kStrip);
  }
  for (int64_t m = 0; m < rows; m += kRowBlock)
    row_tail<false, false>(std::min(kRowBlock, rows - m), x + m * K, K, K, strip.data(),
                           kStrip, y + m * N, N);
}

ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[1] != xd[1] ||
      yd[0] != xd[0] || yd[1] != wd[2] || group_sizes.element_count() != wd[0])
    return ffi::Error::InvalidArgument("grouped_matmul: bad shapes");
  const int64_t M = xd[0], K = xd[1], N = wd[2], E = wd[0];
  const int32_t* sizes = group_sizes.typed_data();
  std::vector<Unit> units;
  int64_t start = 0;
  for (int64_t g = 0; g < E; ++g) {
    const int64_t end = std::min<int64_t>(M, start + std::max<int32_t>(sizes[g], 0));
    for (int64_t m0 = start; m0 < end; m0 += kRunRows)
      for (int64_t n0 = 0; n0 < N; n0 += kStrip)
        units.push_back({g, n0, m0, std::min(end, m0 + kRunRows)});
    start = end;
  }
  float* Y = y->typed_data();
  std::fill(Y + start * N, Y + M * N, 0.0f);  // rows in no group
  const float* X = x.typed_data();
  const float* Wd = w.typed_data();
  parallel_for(pool, static_cast<int64_t>(units.size()),
               [&](int64_t i) { unit(X, Wd, Y, K, N, units[i]); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedMatmulF32, GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
