// `axcore_cpu_paged_decode`: attention of one new token per row over a paged KV cache, each row's
// blocks read in place through its block table (see PagedDecodeImpl).
#include "common.h"

namespace axcore_cpu {
namespace {

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
  auto head_of = [&](int64_t index) {  // Slot 0 of kv head `kv` in the row's index-th block.
    const int64_t block = std::clamp<int64_t>(a.tables[row * a.width + index], 0, a.num_blocks - 1);
    return cache + (block * a.block_size * a.kv_heads + kv) * a.dim;
  };
  int64_t s = 0;
  for (int64_t index = first / a.block_size; index <= last / a.block_size; ++index) {
    const float* base = head_of(index);
    const int64_t lo = index == first / a.block_size ? first % a.block_size : 0;
    const int64_t hi = index == last / a.block_size ? last % a.block_size : a.block_size - 1;
    if (index < last / a.block_size) {  // The next block lies anywhere: ask for its lines of this head now.
      const char* lines = reinterpret_cast<const char*>(head_of(index + 1));
      for (int64_t offset = 0; offset < a.block_size; ++offset) {
        for (int64_t byte = 0; byte < a.dim * 4; byte += 64) __builtin_prefetch(lines + offset * stride * 4 + byte);
      }
    }
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
  SoftmaxRows(logits, group, count, a.softcap);
  ForEachSlot(a, a.value, row, kv, first, last, [&](int64_t s, const float* v) {
    for (int64_t g = 0; g < group; ++g) {
      const float weight = logits[g * count + s];
      float* o = out + g * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] += weight * v[i];
    }
  });
}


// AttendOne for kDim a multiple of kLanes and kGroup query heads per kv head, in vector registers:
// the group's queries held while the keys stream by, its outputs accumulated while the values do.
template <int kDim, int kGroup>
void AttendGroup(const PagedDecode& a, int64_t row, int64_t kv, std::vector<float>& scratch) {
  constexpr int kVecs = kDim / kLanes;
  const int64_t position = std::max<int64_t>(a.positions[row], 0);
  const int64_t last = std::min<int64_t>(position, a.width * a.block_size - 1);
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, position - a.window + 1) : 0;
  const int64_t count = last - first + 1;
  const float* q = a.q + (row * a.heads + kv * kGroup) * kDim;
  float* out = a.out + (row * a.heads + kv * kGroup) * kDim;
  if (count <= 0) {
    std::fill(out, out + kGroup * kDim, 0.0f);
    return;
  }
  scratch.resize(static_cast<size_t>(count * kGroup));
  float* logits = scratch.data();  // [kGroup, count]
  Vec qv[kGroup][kVecs];
  for (int g = 0; g < kGroup; ++g) {
    for (int i = 0; i < kVecs; ++i) qv[g][i] = LoadVec(q + g * kDim + i * kLanes);
  }
  ForEachSlot(a, a.key, row, kv, first, last, [&](int64_t s, const float* k) {
    Vec kvec[kVecs];
    for (int i = 0; i < kVecs; ++i) kvec[i] = LoadVec(k + i * kLanes);
    for (int g = 0; g < kGroup; ++g) {
      Vec sum = qv[g][0] * kvec[0];
      for (int i = 1; i < kVecs; ++i) sum += qv[g][i] * kvec[i];
      logits[g * count + s] = a.scale * SumLanes(sum);
    }
  });
  SoftmaxRows(logits, kGroup, count, a.softcap);
  Vec acc[kGroup][kVecs];
  for (int g = 0; g < kGroup; ++g) {
    for (int i = 0; i < kVecs; ++i) acc[g][i] = Vec{};
  }
  ForEachSlot(a, a.value, row, kv, first, last, [&](int64_t s, const float* v) {
    Vec vvec[kVecs];
    for (int i = 0; i < kVecs; ++i) vvec[i] = LoadVec(v + i * kLanes);
    for (int g = 0; g < kGroup; ++g) {
      const float weight = logits[g * count + s];
      for (int i = 0; i < kVecs; ++i) acc[g][i] += weight * vvec[i];
    }
  });
  for (int g = 0; g < kGroup; ++g) {
    for (int i = 0; i < kVecs; ++i) StoreVec(out + g * kDim + i * kLanes, acc[g][i]);
  }
}

using AttendFn = void (*)(const PagedDecode&, int64_t, int64_t, std::vector<float>&);

// The attention of (dim, group): AttendGroup for dims 64 and 128 and groups 1-8, else AttendOne.
template <int kDim>
AttendFn AttendFor(int64_t group) {
  switch (group) {
    case 1: return &AttendGroup<kDim, 1>;
    case 2: return &AttendGroup<kDim, 2>;
    case 3: return &AttendGroup<kDim, 3>;
    case 4: return &AttendGroup<kDim, 4>;
    case 5: return &AttendGroup<kDim, 5>;
    case 6: return &AttendGroup<kDim, 6>;
    case 7: return &AttendGroup<kDim, 7>;
    case 8: return &AttendGroup<kDim, 8>;
    default: return &AttendOne<kDim>;
  }
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
  const AttendFn attend = a.dim == 64 ? AttendFor<64>(a.group) : a.dim == 128 ? AttendFor<128>(a.group) : &AttendOne<0>;
  auto run = [a, attend](int64_t task) {
    thread_local std::vector<float> scratch;
    attend(a, task / a.kv_heads, task % a.kv_heads, scratch);
  };
  ParallelFor(pool, qd[0] * a.kv_heads, run);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace axcore_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxcoreCpuPagedDecode, axcore_cpu::PagedDecodeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window"));

