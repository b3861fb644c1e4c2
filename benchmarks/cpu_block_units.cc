// One core's rate on one cached weight, without JAX: the GGUF block matmul's units
// (jaxengine_kernels/cpu/block_matmul.cc, Q4_1) or, built with -DPACKED, the packed matmul's over
// float32 and int8 panels (packed_matmul.cc), for comparing the loops' compute rates while tuning
// (docs/BENCHMARKS.md §2, "Quantized projections").
//
//   g++ -O3 -march=native -std=c++17 -fopenmp-simd -fno-math-errno -fno-trapping-math -w \
//       -I"$(.venv/bin/python -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
//       benchmarks/cpu_block_units.cc -o /tmp/cpu_block_units [-DPACKED]
//   /tmp/cpu_block_units K N rows [repeats]
//
// Prints the best of `repeats` (5) over every unit of a [rows, K] x [K, N] product, run in the
// kernel's unit order on the calling thread, in ms and GFLOP/s. The weights are constant
// (the rate does not depend on their values) and small enough to stay in cache.
#ifdef PACKED
#include "../jaxengine_kernels/cpu/packed_matmul.cc"
#else
#include "../jaxengine_kernels/cpu/block_matmul.cc"
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

static double best_ms(int repeats, const std::function<void()>& pass) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pass();
    best = std::min(best, std::chrono::duration<double, std::milli>(
                              std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

int main(int argc, char** argv) {
  if (argc < 4) return std::fprintf(stderr, "usage: %s K N rows [repeats]\n", argv[0]), 2;
  const int64_t K = std::atoll(argv[1]), N = std::atoll(argv[2]), M = std::atoll(argv[3]);
  const int repeats = argc > 4 ? std::atoi(argv[4]) : 5;
  const double gflop = 2.0 * M * N * K / 1e9;
  std::vector<float> x(M * K, 0.01f), y(M * N);
#ifdef PACKED
  const int64_t P = (N + kPanel - 1) / kPanel;
  std::vector<float> w(P * K * kPanel, 0.01f), scale(N, 1.0f);
  std::vector<int8_t> w8(P * K * kPanel, 1);
  const double f32 = best_ms(repeats, [&] {
    for (int64_t i = 0; i < unit_count(M, P); ++i) {
      const Unit u = unit_at(i, P, M);
      unit<false>(x.data(), w.data(), y.data(), K, N, u.panel, u.m0, u.m1);
    }
  });
  const double i8 = best_ms(repeats, [&] {
    for (int64_t i = 0; i < unit_count(M, P); ++i) {
      const Unit u = unit_at(i, P, M);
      unit<false>(x.data(), w8.data(), y.data(), K, N, u.panel, u.m0, u.m1, scale.data());
    }
  });
  std::printf("float32 panels K=%ld N=%ld rows=%ld: %.3f ms, %.1f GFLOP/s\n", long(K), long(N),
              long(M), f32, gflop / f32 * 1e3);
  std::printf("int8 panels    K=%ld N=%ld rows=%ld: %.3f ms, %.1f GFLOP/s\n", long(K), long(N),
              long(M), i8, gflop / i8 * 1e3);
#else
  const int64_t row_bytes = K / kBlock * Q4_1::kBytes;
  std::vector<uint8_t> w(N * row_bytes, 0x37);
  for (int64_t b = 0; b < N * K / kBlock; ++b) {  // d = m = 2^-7 (f16 0x2000), finite
    const uint16_t h = 0x2000;
    std::memcpy(&w[b * Q4_1::kBytes], &h, 2);
    std::memcpy(&w[b * Q4_1::kBytes + 2], &h, 2);
  }
  const int64_t span = M <= kRows ? kDecodeUnitRows : kUnitRows;
  const double ms = best_ms(repeats, [&] {
    for (int64_t m0 = 0; m0 < M; m0 += kRunRows)
      for (int64_t n0 = 0; n0 < N; n0 += span)
        unit<Q4_1, false>(x.data(), w.data(), w.data(), row_bytes, y.data(), K, N, n0,
                          std::min(N, n0 + span), m0, std::min(M, m0 + kRunRows));
  });
  std::printf("Q4_1 blocks    K=%ld N=%ld rows=%ld: %.3f ms, %.1f GFLOP/s\n", long(K), long(N),
              long(M), ms, gflop / ms * 1e3);
#endif
}
