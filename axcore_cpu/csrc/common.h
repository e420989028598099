// What axcore-cpu's XLA FFI handlers share: running parts of a call on XLA's intra-op threads, and the
// compiler's float vectors. The handlers (sgemm.cc, rows_dot.cc, paged_decode.cc) are one shared
// library, loaded with ctypes by axcore_cpu.native.
#ifndef AXCORE_CPU_COMMON_H_
#define AXCORE_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace axcore_cpu {

namespace ffi = xla::ffi;

// Columns per part: at least this many, so a narrow product is not cut into slivers.
constexpr int64_t kMinColumns = 64;

// Parts of one call, claimed one at a time by the calling thread and the pool's tasks; a task that
// starts after every part is claimed touches nothing but this state (which it co-owns).
struct Split {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;
};

// Runs fn(0) ... fn(parts - 1) on the calling thread and XLA's intra-op pool; returns when all are done.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t parts, const Fn& fn) {
  auto split = std::make_shared<Split>();
  auto work = [split, parts](const Fn& run) {
    for (int64_t part = split->next.fetch_add(1); part < parts; part = split->next.fetch_add(1)) {
      run(part);
      if (split->done.fetch_add(1) + 1 == parts) {
        std::lock_guard<std::mutex> lock(split->mu);
        split->all_done.notify_all();
      }
    }
  };
  for (int64_t i = 1; i < std::min(parts, pool.num_threads()); ++i) {  // The caller is the last worker.
    // A copy of fn (pointers and sizes); once every part is claimed the task only reads `split`.
    pool.Schedule([work, fn]() { work(fn); });
  }
  work(fn);
  std::unique_lock<std::mutex> lock(split->mu);
  split->all_done.wait(lock, [&] { return split->done.load() == parts; });
}

// The compiler's vector of kLanes floats (AVX-512: 16, else 8; GCC lowers it to what the target has).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec LoadVec(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void StoreVec(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof(v)); }

// Horizontal sum of a vector's lanes.
inline float SumLanes(Vec v) {
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += v[l];
  return sum;
}

// Dot product of two float vectors of length kDim (0: `n`), vectorized by the compiler (-ffast-math).
template <int kDim>
inline float Dot(const float* a, const float* b, int64_t n) {
  const int64_t len = kDim > 0 ? kDim : n;
  float sum = 0.0f;
  for (int64_t i = 0; i < len; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace axcore_cpu

#endif  // AXCORE_CPU_COMMON_H_
