// axcore-cpu's XLA FFI handlers (one shared library, loaded with ctypes by axcore_cpu.native).
//
// `axcore_cpu_sgemm`: y [m, n] = x [m, k] . w, float32, row-major, with w [k, n]
// (trans_w = 0) or w [n, k] (trans_w = 1), computed by the BLAS sgemm whose address
// Python hands over once (`axcore_cpu_set_sgemm`, OpenBLAS from the scipy-openblas32 wheel,
// set to one thread). The columns of y are split into parts run on XLA's own intra-op
// thread pool, so the BLAS never brings threads of its own to compete with XLA's.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// cblas_sgemm's signature; its enums as ints: row-major 101, no transpose 111, transpose 112.
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                       int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

Sgemm g_sgemm = nullptr;

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

ffi::Error SgemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y, int64_t trans_w) {
  if (g_sgemm == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "axcore_cpu_sgemm: no sgemm was set (axcore_cpu.native.load() sets it)");
  }
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "axcore_cpu_sgemm: operands must be 2-D");
  }
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = trans_w ? wd[0] : wd[1];
  const int64_t w_k = trans_w ? wd[1] : wd[0];
  if (w_k != k || yd[0] != m || yd[1] != n) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "axcore_cpu_sgemm: shapes do not match");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n / kMinColumns));
  const int64_t width = (n + parts - 1) / parts;
  auto run_part = [=](int64_t part) {
    const int64_t first = part * width, count = std::min(n, first + width) - first;
    if (count <= 0) return;
    // Columns [first, first + count) of w: an offset into a row (w [k, n]) or whole rows (w [n, k]).
    const float* wpart = trans_w ? wp + first * k : wp + first;
    g_sgemm(kRowMajor, kNoTrans, trans_w ? kTrans : kNoTrans, static_cast<int>(m), static_cast<int>(count),
            static_cast<int>(k), 1.0f, xp, static_cast<int>(k), wpart, static_cast<int>(trans_w ? k : n), 0.0f,
            yp + first, static_cast<int>(n));
  };
  ParallelFor(pool, parts, run_part);
  return ffi::Error::Success();
}


// Dot product of two float vectors of length kDim (0: `n`), vectorized by the compiler (-ffast-math).
template <int kDim>
inline float Dot(const float* a, const float* b, int64_t n) {
  const int64_t len = kDim > 0 ? kDim : n;
  float sum = 0.0f;
  for (int64_t i = 0; i < len; ++i) sum += a[i] * b[i];
  return sum;
}

// What one paged decode call reads and writes (see PagedDecodeImpl).
struct PagedDecode {
  const float *q, *key, *value;
  const int32_t *tables, *positions;
  float* out;
  int64_t heads, dim, num_blocks, block_size, kv_heads, width, group;
  float scale, softcap;
  int64_t window;
};

// Calls fn(slot index s, pointer to the slot's row of `cache` for kv head `kv`) for the slots
// first..last of `row`, block by block through its table (no division per slot).
template <typename Fn>
inline void ForEachSlot(const PagedDecode& a, const float* cache, int64_t row, int64_t kv, int64_t first,
                        int64_t last, const Fn& fn) {
  const int64_t stride = a.kv_heads * a.dim;  // Between consecutive slots of a block.
  int64_t s = 0;
  for (int64_t index = first / a.block_size; index <= last / a.block_size; ++index) {
    const int64_t block = std::clamp<int64_t>(a.tables[row * a.width + index], 0, a.num_blocks - 1);
    const float* base = cache + (block * a.block_size * a.kv_heads + kv) * a.dim;
    const int64_t lo = index == first / a.block_size ? first % a.block_size : 0;
    const int64_t hi = index == last / a.block_size ? last % a.block_size : a.block_size - 1;
    for (int64_t offset = lo; offset <= hi; ++offset, ++s) fn(s, base + offset * stride);
  }
}

// One (row, kv head): its `group` query heads over the row's visible slots, softmax in float32.
template <int kDim>
void AttendOne(const PagedDecode& a, int64_t row, int64_t kv, std::vector<float>& scratch) {
  const int64_t dim = kDim > 0 ? kDim : a.dim, group = a.group;
  const int64_t position = std::max<int64_t>(a.positions[row], 0);
  const int64_t last = std::min<int64_t>(position, a.width * a.block_size - 1);
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, position - a.window + 1) : 0;
  const int64_t count = last - first + 1;
  const float* q = a.q + (row * a.heads + kv * group) * dim;  // The group's query heads, contiguous.
  float* out = a.out + (row * a.heads + kv * group) * dim;
  std::fill(out, out + group * dim, 0.0f);
  if (count <= 0) return;  // Nothing visible (not a valid row): zeros.
  scratch.resize(static_cast<size_t>(count * group));
  float* logits = scratch.data();  // [group, count]
  ForEachSlot(a, a.key, row, kv, first, last, [&](int64_t s, const float* k) {
    for (int64_t g = 0; g < group; ++g) logits[g * count + s] = a.scale * Dot<kDim>(q + g * dim, k, dim);
  });
  for (int64_t g = 0; g < group; ++g) {
    float* lg = logits + g * count;
    if (a.softcap > 0.0f) {
      for (int64_t s = 0; s < count; ++s) lg[s] = a.softcap * std::tanh(lg[s] / a.softcap);
    }
    float top = lg[0];
    for (int64_t s = 1; s < count; ++s) top = std::max(top, lg[s]);
    float total = 0.0f;
    for (int64_t s = 0; s < count; ++s) lg[s] = std::exp(lg[s] - top);
    for (int64_t s = 0; s < count; ++s) total += lg[s];
    const float inverse = 1.0f / total;
    for (int64_t s = 0; s < count; ++s) lg[s] *= inverse;
  }
  ForEachSlot(a, a.value, row, kv, first, last, [&](int64_t s, const float* v) {
    for (int64_t g = 0; g < group; ++g) {
      const float weight = logits[g * count + s];
      float* o = out + g * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] += weight * v[i];
    }
  });
}

// `axcore_cpu_paged_decode`: attention of one new token per row over a paged KV cache, reading each
// row's blocks in place through its block table (no gather, only the slots at positions <= its own).
//   q [b, heads, d]; key, value [blocks, block_size, kv_heads, d]; tables [b, w] int32;
//   positions [b] int32 -> out [b, heads, d]. Query head h reads kv head h / (heads / kv_heads).
//   logits = scale q.k, then softcap tanh(logits / softcap) if softcap > 0; slot j is seen if
//   j <= position and (window == 0 or position - j < window). Work is split over (row, kv head).
ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> key,
                           ffi::Buffer<ffi::F32> value, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                           ffi::ResultBuffer<ffi::F32> out, float scale, float softcap, int64_t window) {
  auto qd = q.dimensions();
  auto kd = key.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || value.dimensions().size() != 4) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "axcore_cpu_paged_decode: wrong ranks");
  }
  PagedDecode a{q.typed_data(), key.typed_data(), value.typed_data(), tables.typed_data(), positions.typed_data(),
                out->typed_data(), qd[1], qd[2], kd[0], kd[1], kd[2], td[1], 0, scale, softcap, window};
  if (kd[3] != a.dim || td[0] != qd[0] || a.kv_heads == 0 || a.heads % a.kv_heads != 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "axcore_cpu_paged_decode: shapes do not match");
  }
  a.group = a.heads / a.kv_heads;
  auto run = [a](int64_t task) {
    thread_local std::vector<float> scratch;
    const int64_t row = task / a.kv_heads, kv = task % a.kv_heads;
    if (a.dim == 64) {
      AttendOne<64>(a, row, kv, scratch);
    } else if (a.dim == 128) {
      AttendOne<128>(a, row, kv, scratch);
    } else {
      AttendOne<0>(a, row, kv, scratch);
    }
  };
  ParallelFor(pool, qd[0] * a.kv_heads, run);
  return ffi::Error::Success();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void axcore_cpu_set_sgemm(void* fn) { g_sgemm = reinterpret_cast<Sgemm>(fn); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxcoreCpuSgemm, SgemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("trans_w"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxcoreCpuPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window"));
