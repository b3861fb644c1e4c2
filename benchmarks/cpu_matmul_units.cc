// The packed matmul's units on two threads, without JAX: steadier timings than a whole step
// while tuning jaxengine_kernels/cpu/packed_matmul.cc (docs/BENCHMARKS.md §2).
//
//   g++ -O3 -march=native -std=c++17 -fopenmp-simd -fno-math-errno -fno-trapping-math \
//       -w -I"$(.venv/bin/python -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
//       benchmarks/cpu_matmul_units.cc -o /tmp/cpu_matmul_units -lpthread
//   /tmp/cpu_matmul_units glu|down|qkv|head [passes] [rows ...]
//
// SmolLM2's projections, float32, random weights: `glu` 30 layers of the fused gate/up
// (576 -> 2 x 1536, 212 MB), `down` 30 of 1536 -> 576, `qkv` 30 of 576 -> 960, `head` the tied
// LM head (576 -> 49152, 113 MB): more than the L3 holds, so every pass reads the weights from
// memory, as a decode step does. Each pass runs every layer's units (panels x runs of rows, in
// the kernel's order) on the calling thread and one helper that spins between layers (the
// engine's parallel_for, without XLA's pool). Prints the best of `passes` (20) per row count
// (default 1 8 16 32 48 64 96; 2048 is a prefill chunk), and the largest difference of the last
// layer's output from a plain loop over the unpacked weights.
#include "../jaxengine_kernels/cpu/packed_matmul.cc"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "glu";
  const int passes = argc > 2 ? std::atoi(argv[2]) : 20;
  std::vector<int64_t> counts;
  for (int i = 3; i < argc; ++i) counts.push_back(std::atoll(argv[i]));
  if (counts.empty()) counts = {1, 8, 16, 32, 48, 64, 96};
  int64_t K = 576, N = 1536, layers = 30;
  if (mode == "down") K = 1536, N = 576;
  else if (mode == "qkv") N = 960;
  else if (mode == "head") N = 49152, layers = 1;
  else if (mode != "glu") return std::fprintf(stderr, "unknown mode %s\n", mode.c_str()), 2;
  const bool glu = mode == "glu";
  const int64_t parts = glu ? 2 : 1, P = (N + kPanel - 1) / kPanel;
  const int64_t M = std::max<int64_t>(128, *std::max_element(counts.begin(), counts.end()));
  const int64_t layer_floats = parts * P * K * kPanel;  // zeros past N in the last panel
  std::vector<float> w(layers * layer_floats, 0.0f), x(M * K), y(M * N);
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> uniform(-0.05f, 0.05f);
  for (int64_t l = 0; l < layers; ++l)  // panel (part, p): rows of K, kPanel columns each
    for (int64_t i = 0; i < parts * P; ++i)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < kPanel && (i / parts) * kPanel + c < N; ++c)
          w[l * layer_floats + (i * K + k) * kPanel + c] = uniform(rng);
  for (auto& v : x) v = uniform(rng);

  std::atomic<int64_t> round{0}, next{0}, done{0};
  std::atomic<bool> stop{false};
  int64_t rows = 1, units = unit_count(rows, P);
  const float* weights = w.data();
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(1)) < units;) {
      const Unit u = unit_at(i, P, rows);
      if (glu) unit<true>(x.data(), weights, y.data(), K, N, u.panel, u.m0, u.m1, nullptr, 0);
      else unit<false>(x.data(), weights, y.data(), K, N, u.panel, u.m0, u.m1, nullptr, 0);
      done.fetch_add(1);
    }
  };
  std::thread helper([&] {
    for (int64_t seen = 0; !stop;)
      if (const int64_t r = round.load(); r != seen) seen = r, work();
  });
  for (const int64_t R : counts) {
    rows = R, units = unit_count(R, P);
    double best = 1e9;
    for (int pass = 0; pass < passes; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t l = 0; l < layers; ++l) {
        weights = w.data() + l * layer_floats;
        done = 0, next = 0;  // in this order: a helper late from the last layer that takes a
                             // panel of this one counts it after the reset, not before
        round.fetch_add(1);
        work();
        while (done.load() < units) {}
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                                .count());
    }
    std::printf("%s rows=%ld: %.3f ms, %.1f GB/s, %.1f GFLOP/s\n", mode.c_str(), long(rows),
                best * 1e3, double(w.size()) * sizeof(float) / best / 1e9,
                2.0 * rows * K * N * parts * layers / best / 1e9);
  }
  stop = true;
  round.fetch_add(1);
  helper.join();

  // The last layer's rows (at most 97 of them, spread) against a plain loop (silu(gate) * up
  // for glu).
  double err = 0;
  for (int64_t m = 0; m < rows; m += std::max<int64_t>(1, rows / 97))
    for (int64_t n = 0; n < N; ++n) {
      double sum[2] = {0, 0};
      for (int64_t part = 0; part < parts; ++part)
        for (int64_t k = 0; k < K; ++k)
          sum[part] += double(x[m * K + k]) *
                       weights[((n / kPanel * parts + part) * K + k) * kPanel + n % kPanel];
      const double want = glu ? sum[0] / (1 + std::exp(-sum[0])) * sum[1] : sum[0];
      err = std::max(err, std::abs(want - y[m * N + n]));
    }
  std::printf("max difference from the plain loop: %.3g\n", err);
}
