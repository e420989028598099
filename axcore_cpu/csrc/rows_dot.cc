// `axcore_cpu_rows_dot`: y [m, n] = x [m, k] . w for a few rows of x (a decode step's), float32,
// without the BLAS: sgemm (and XLA's dot) first copy the weight into panels, which at a few rows
// costs as much as the product. RowsDot reads w in its own layout, each weight once per call, into
// accumulators held in vector registers (see RowsDotImpl).
#include "common.h"

namespace axcore_cpu {
namespace {

// w [k, n]: rows of x per register tile, vectors of columns per tile, rows of w per block.
constexpr int kTileRows = 6, kTileVecs = 4, kBlockRows = 32;
constexpr int64_t kPanel = kTileVecs * kLanes;  // Columns of one tile.

// y[0:kM, 0:kPanel] (+)= x[0:kM, k0:k0+kb] . w[k0:k0+kb, 0:kPanel]; x rows of stride ldx, w rows of
// stride ldw, y rows of stride ldy; the sum starts at 0 when `fresh`, else continues y.
template <int kM, bool kPrefetch>
inline void LeadingTile(const float* x, int64_t ldx, int64_t k0, int64_t kb, bool fresh, const float* w, int64_t ldw,
                        float* y, int64_t ldy) {
  Vec acc[kM][kTileVecs];
  for (int r = 0; r < kM; ++r) {
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = fresh ? Vec{} : LoadVec(y + r * ldy + v * kLanes);
  }
  for (int64_t p = k0; p < k0 + kb; ++p) {
    if (kPrefetch) {  // The next panel's part of this row of w, from memory while this one computes.
      for (int64_t byte = 0; byte < kPanel * 4; byte += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(w + p * ldw + kPanel) + byte);
      }
    }
    Vec b[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) b[v] = LoadVec(w + p * ldw + v * kLanes);
    for (int r = 0; r < kM; ++r) {
      const float a = x[r * ldx + p];
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < kM; ++r) {
    for (int v = 0; v < kTileVecs; ++v) StoreVec(y + r * ldy + v * kLanes, acc[r][v]);
  }
}

using LeadingFn = void (*)(const float*, int64_t, int64_t, int64_t, bool, const float*, int64_t, float*, int64_t);
// kLeadingTiles[m - 1] computes a tile of m rows (1..kTileRows).
constexpr LeadingFn kLeadingTiles[kTileRows] = {&LeadingTile<1, false>, &LeadingTile<2, false>, &LeadingTile<3, false>,
                                                &LeadingTile<4, false>, &LeadingTile<5, false>, &LeadingTile<6, false>};
// The same, each also prefetching the next panel (the first tile of rows of a panel).
constexpr LeadingFn kPrefetchingTiles[kTileRows] = {&LeadingTile<1, true>, &LeadingTile<2, true>, &LeadingTile<3, true>,
                                                    &LeadingTile<4, true>, &LeadingTile<5, true>, &LeadingTile<6, true>};

// y [m, n] = x[:, begin:end] . w[begin:end, :] for w [k, n] (a part of the product's sum over k).
// w is read kBlockRows rows at a time, then every tile of rows of x over them, panel by panel: the
// part's rows of w are one contiguous stream the hardware prefetcher follows, and the first tile of
// each panel prefetches the next. The last n % kPanel columns one by one.
void LeadingRows(const float* x, int64_t m, int64_t k, const float* w, int64_t n, float* y, int64_t begin,
                 int64_t end) {
  const int64_t panels_end = n / kPanel * kPanel;
  for (int64_t k0 = begin; k0 < end; k0 += kBlockRows) {
    const int64_t kb = std::min<int64_t>(kBlockRows, end - k0);
    for (int64_t j = 0; j < panels_end; j += kPanel) {
      for (int64_t r = 0; r < m; r += kTileRows) {
        const LeadingFn* tiles = r == 0 && j + 2 * kPanel <= panels_end ? kPrefetchingTiles : kLeadingTiles;
        tiles[std::min<int64_t>(kTileRows, m - r) - 1](x + r * k, k, k0, kb, k0 == begin, w + j, n, y + r * n + j, n);
      }
    }
  }
  for (int64_t j = panels_end; j < n; ++j) {
    for (int64_t r = 0; r < m; ++r) {
      float sum = 0.0f;
      for (int64_t p = begin; p < end; ++p) sum += x[r * k + p] * w[p * n + j];
      y[r * n + j] = sum;
    }
  }
}

// w_t [n, k] (a tied head's rows): output columns per tile.
constexpr int kTileColumns = 4;

// y[r, c] = x[r] . w_t[c] for a tile of kM rows and kTileColumns columns; y rows of stride ldy.
template <int kM>
inline void TrailingTile(const float* x, int64_t k, const float* w_t, float* y, int64_t ldy) {
  Vec acc[kM][kTileColumns];
  for (int r = 0; r < kM; ++r) {
    for (int c = 0; c < kTileColumns; ++c) acc[r][c] = Vec{};
  }
  const int64_t whole = k / kLanes * kLanes;
  for (int64_t p = 0; p < whole; p += kLanes) {
    Vec b[kTileColumns];
    for (int c = 0; c < kTileColumns; ++c) b[c] = LoadVec(w_t + c * k + p);
    for (int r = 0; r < kM; ++r) {
      const Vec a = LoadVec(x + r * k + p);
      for (int c = 0; c < kTileColumns; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < kM; ++r) {
    for (int c = 0; c < kTileColumns; ++c) {
      float sum = SumLanes(acc[r][c]);
      for (int64_t p = whole; p < k; ++p) sum += x[r * k + p] * w_t[c * k + p];
      y[r * ldy + c] = sum;
    }
  }
}

using TrailingFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr TrailingFn kTrailingTiles[kTileRows] = {&TrailingTile<1>, &TrailingTile<2>, &TrailingTile<3>,
                                                  &TrailingTile<4>, &TrailingTile<5>, &TrailingTile<6>};

// Columns [first, last) of y [m, n] = x [m, k] . w_t^T for w_t [n, k]; first is a multiple of
// kTileColumns; the last columns of a part that fill no tile one by one.
void TrailingColumns(const float* x, int64_t m, int64_t k, const float* w_t, int64_t n, float* y, int64_t first,
                     int64_t last) {
  const int64_t tiles_end = first + (last - first) / kTileColumns * kTileColumns;
  for (int64_t j = first; j < tiles_end; j += kTileColumns) {
    for (int64_t r = 0; r < m; r += kTileRows) {
      kTrailingTiles[std::min<int64_t>(kTileRows, m - r) - 1](x + r * k, k, w_t + j * k, y + r * n + j, n);
    }
  }
  for (int64_t j = tiles_end; j < last; ++j) {
    for (int64_t r = 0; r < m; ++r) y[r * n + j] = Dot<0>(x + r * k, w_t + j * k, k);
  }
}

// Weights of w [k, n] below which one thread computes the whole product.
constexpr int64_t kMinSplitWeights = 1 << 16;

// `axcore_cpu_rows_dot`: y [m, n] = x [m, k] . w for w [k, n] (trans_w = 0) or w [n, k] (trans_w = 1),
// float32, row-major, no copy of w. Work is split into parts run on XLA's intra-op threads, each part
// a contiguous range of w's memory: for w [k, n], blocks of w's rows (each part's sum into a buffer of
// its own, added into y at the end); for w [n, k], its rows (y's columns: whole tiles, at least
// kMinColumns). Within a part, tiles of up to kTileRows rows of x accumulate in registers (kTileRows x
// kTileVecs vectors of kLanes columns for w [k, n]; kTileRows x kTileColumns dot products for
// w [n, k]), so w is read from memory once per call. (Splitting w [k, n] by columns instead measured
// 1.2x faster on 2 threads than on 1: each thread's part of a row broke the prefetcher's streams.)
ffi::Error RowsDotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y, int64_t trans_w) {
  int64_t m = 0, k = 0, n = 0;
  if (auto error = ProductSizes("axcore_cpu_rows_dot", x, w, y, trans_w, m, k, n); error.failure()) return error;
  if (m == 0 || n == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  if (trans_w) {
    const int64_t units = (n + kTileColumns - 1) / kTileColumns;
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n / kMinColumns));
    ParallelFor(pool, parts, [=](int64_t part) {
      const int64_t first = units * part / parts * kTileColumns;
      const int64_t last = std::min(n, units * (part + 1) / parts * kTileColumns);
      if (first < last) TrailingColumns(xp, m, k, wp, n, yp, first, last);
    });
    return ffi::Error::Success();
  }
  const int64_t blocks = (k + kBlockRows - 1) / kBlockRows;
  const int64_t parts = k * n < kMinSplitWeights ? 1 : std::max<int64_t>(1, std::min(pool.num_threads(), blocks));
  thread_local std::vector<float> partial;  // Parts 1.. sum here; part 0 into y.
  partial.resize(static_cast<size_t>((parts - 1) * m * n));
  float* sums = partial.data();
  ParallelFor(pool, parts, [=](int64_t part) {
    const int64_t begin = std::min(k, blocks * part / parts * kBlockRows);
    const int64_t end = std::min(k, blocks * (part + 1) / parts * kBlockRows);
    float* out = part == 0 ? yp : sums + (part - 1) * m * n;
    if (begin < end) {
      LeadingRows(xp, m, k, wp, n, out, begin, end);
    } else {
      std::fill(out, out + m * n, 0.0f);
    }
  });
  for (int64_t part = 1; part < parts; ++part) {
    const float* add = sums + (part - 1) * m * n;
    for (int64_t i = 0; i < m * n; ++i) yp[i] += add[i];
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace axcore_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxcoreCpuRowsDot, axcore_cpu::RowsDotImpl, axcore_cpu::ProductBinding());

