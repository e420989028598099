// `axcore_cpu_sgemm`: y [m, n] = x [m, k] . w, float32, row-major, with w [k, n]
// (trans_w = 0) or w [n, k] (trans_w = 1), computed by the BLAS sgemm whose address
// Python hands over once (`axcore_cpu_set_sgemm`, OpenBLAS from the scipy-openblas32 wheel,
// set to one thread). The columns of y are split into parts run on XLA's own intra-op
// thread pool, so the BLAS never brings threads of its own to compete with XLA's.
#include "common.h"

namespace axcore_cpu {
namespace {

// cblas_sgemm's signature; its enums as ints: row-major 101, no transpose 111, transpose 112.
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                       int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

Sgemm g_sgemm = nullptr;

ffi::Error SgemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y, int64_t trans_w) {
  if (g_sgemm == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "axcore_cpu_sgemm: no sgemm was set (axcore_cpu.native.load() sets it)");
  }
  int64_t m = 0, k = 0, n = 0;
  if (auto error = ProductSizes("axcore_cpu_sgemm", x, w, y, trans_w, m, k, n); error.failure()) return error;
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

}  // namespace
}  // namespace axcore_cpu

extern "C" __attribute__((visibility("default"))) void axcore_cpu_set_sgemm(void* fn) {
  axcore_cpu::g_sgemm = reinterpret_cast<axcore_cpu::Sgemm>(fn);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxcoreCpuSgemm, axcore_cpu::SgemmImpl, axcore_cpu::ProductBinding());

