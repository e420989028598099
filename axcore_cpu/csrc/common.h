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
#include <string>
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

// The sizes (m, k, n) of y [m, n] = x [m, k] . w, w [k, n] (trans_w = 0) or [n, k] (trans_w = 1), all
// three 2-D; an InvalidArgument error naming `target` if they are not, or do not match.
inline ffi::Error ProductSizes(const char* target, const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& w,
                               ffi::ResultBuffer<ffi::F32>& y, int64_t trans_w, int64_t& m, int64_t& k,
                               int64_t& n) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(target) + ": operands must be 2-D");
  }
  m = xd[0];
  k = xd[1];
  n = trans_w ? wd[0] : wd[1];
  if ((trans_w ? wd[1] : wd[0]) != k || yd[0] != m || yd[1] != n) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(target) + ": shapes do not match");
  }
  return ffi::Error::Success();
}

// The binding of a product handler (`axcore_cpu_sgemm`, `axcore_cpu_rows_dot`): XLA's intra-op threads,
// x and w, the result y, and the attribute trans_w (see ProductSizes).
inline auto ProductBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Ret<ffi::Buffer<ffi::F32>>()
      .Attr<int64_t>("trans_w");
}

// Softmax of each of `rows` rows of `count` logits, in place, in float32; first each logit
// softcap * tanh(logit / softcap) if softcap > 0.
inline void SoftmaxRows(float* logits, int64_t rows, int64_t count, float softcap) {
  for (int64_t g = 0; g < rows; ++g) {
    float* lg = logits + g * count;
    if (softcap > 0.0f) {
      for (int64_t s = 0; s < count; ++s) lg[s] = softcap * std::tanh(lg[s] / softcap);
    }
    float top = lg[0];
    for (int64_t s = 1; s < count; ++s) top = std::max(top, lg[s]);
    float total = 0.0f;
    for (int64_t s = 0; s < count; ++s) lg[s] = std::exp(lg[s] - top);
    for (int64_t s = 0; s < count; ++s) total += lg[s];
    const float inverse = 1.0f / total;
    for (int64_t s = 0; s < count; ++s) lg[s] *= inverse;
  }
}

}  // namespace axcore_cpu

#endif  // AXCORE_CPU_COMMON_H_
