// Decode and prefill attention over the paged KV cache on a CPU, reading each key and value where it lies in the
// pool.
//
// The PyTorch reference gathers every sequence's keys and values into a copy and multiplies the copy, so a
// decode step moves the cache through memory three times; here each (sequence, KV head) walks its block table
// and reads every key once for the scores and every value once for the output. The query heads that share a
// KV head go together, so a key is loaded once for all of them.
//
// Each (sequence, KV head) is summed in one fixed order that depends on nothing but its own context, so a
// row's result is the same whatever the batch around it (the engine's parity tests compare with ==).
//
// Prefill is the same walk for a chunk of query rows: the reference gathers each sequence into a copy, builds
// a causal mask and calls torch's flash kernel once per sequence (about 0.7 ms a call at the offline
// benchmark's 134 tokens, docs/design-measurements.md). Here a (sequence, KV head) copies its keys once,
// transposed, so that a query row's scores come sixteen keys to a vector with no horizontal sums, and reads
// the values in place. A query row's sums depend only on its own position and context: the same bits whether
// its prompt came in one chunk or several, alone or beside others.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

// Strides in elements of one cache (keys or values), logical shape [blocks, block_size, kv_heads, head_dim]:
// a pool stored heads first and one stored blocks first are both read in place.
struct CacheView {
  const float* data;
  int64_t block, token, head, row_bytes;

  const float* row(int64_t block_id, int64_t token_in_block, int64_t kv_head) const {
    return data + block_id * block + token_in_block * token + kv_head * head;
  }
};

CacheView view_of(const at::Tensor& cache) {
  return {cache.data_ptr<float>(), cache.stride(0), cache.stride(1), cache.stride(2),
          cache.size(3) * static_cast<int64_t>(sizeof(float))};
}

// One sequence's rows of one KV head in token order from `first` up to `length`, walking its block table with no
// division per token (a 64-bit division costs about what a key's arithmetic does at these widths).
//
// Each row read asks for the row at the same place one block ahead. A block's rows of one head are one 4 KB page in
// a heads-first pool, and the blocks of a sequence lie anywhere in it: the hardware prefetcher starts over at every
// page, so without the hint each block began with misses the core waited out (docs/design-measurements.md).
class RowWalk {
 public:
  RowWalk(const CacheView& cache, const int32_t* table, int64_t block_size, int64_t kv_head, int64_t length,
          int64_t first = 0)
      : cache_(cache), table_(table), block_size_(block_size), kv_head_(kv_head), block_(first / block_size),
        offset_(first % block_size), last_block_((length + block_size - 1) / block_size - 1) {}

  const float* next() {
    const float* row = cache_.row(table_[block_], offset_, kv_head_);
    if (block_ < last_block_) {
      const char* ahead = reinterpret_cast<const char*>(cache_.row(table_[block_ + 1], offset_, kv_head_));
      for (int64_t line = 0; line < cache_.row_bytes; line += 64) __builtin_prefetch(ahead + line, 0, 3);
    }
    if (++offset_ == block_size_) {
      offset_ = 0;
      ++block_;
    }
    return row;
  }

 private:
  const CacheView& cache_;
  const int32_t* table_;
  int64_t block_size_, kv_head_, block_, offset_, last_block_;
};

// A float buffer whose first element sits on a 64-byte line, so that the compiler's vector loops over it split
// the same way at every call (where they split would otherwise follow the heap's addresses).
struct AlignedFloats {
  std::vector<float> storage;
  float* resize(int64_t count) {
    storage.resize(count + 16);
    const auto address = reinterpret_cast<std::uintptr_t>(storage.data());
    return storage.data() + ((64 - address % 64) % 64) / sizeof(float);
  }
};

// Sixteen floats in one vector (GCC's and Clang's vector extension, lowered to whatever width the CPU has).
using Vec = float __attribute__((vector_size(64)));
using Lanes = int32_t __attribute__((vector_size(64)));
constexpr int64_t kKeysPerVector = 16;  // one 512-bit vector of float scores

Vec load(const float* from) {
  Vec v;
  std::memcpy(&v, from, sizeof v);
  return v;
}

void store(float* to, const Vec& v) { std::memcpy(to, &v, sizeof v); }

// The lanes `kLane...` of a and b side by side (0-15 a's, 16-31 b's).
template <int... kLane>
Vec pick(const Vec& a, const Vec& b) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, kLane...);
#else
  return __builtin_shuffle(a, b, Lanes{kLane...});
#endif
}

// Where lane `lane` of one halving step reads its first addend: lanes pair up `half` apart within runs of
// 2 * half, a's runs filling the first half of each output run and b's the second.
constexpr int first_addend(int half, int lane) {
  const int run = lane / (2 * half) * 2 * half, place = lane % (2 * half);
  return place < half ? run + place : 16 + run + place - half;
}

template <int kHalf, int... kLane>
Vec halve(const Vec& a, const Vec& b, std::integer_sequence<int, kLane...>) {
  return pick<first_addend(kHalf, kLane)...>(a, b) + pick<(first_addend(kHalf, kLane) + kHalf)...>(a, b);
}

// Sixteen keys' products with one query, a vector per key (lanes across the head's width), summed across lanes
// into one vector of the sixteen scores: four halving steps add each key's lanes 8, 4, 2 and 1 apart (the order
// a horizontal sum takes), so that key j's score lands in lane j when `partial[i]` holds key kBitReversed[i].
Vec sixteen_sums(const Vec* partial) {
  constexpr auto lanes = std::make_integer_sequence<int, 16>{};
  Vec eight[8], four[4], two[2];
  for (int i = 0; i < 8; ++i) eight[i] = halve<8>(partial[2 * i], partial[2 * i + 1], lanes);
  for (int i = 0; i < 4; ++i) four[i] = halve<4>(eight[2 * i], eight[2 * i + 1], lanes);
  for (int i = 0; i < 2; ++i) two[i] = halve<2>(four[2 * i], four[2 * i + 1], lanes);
  return halve<1>(two[0], two[1], lanes);
}

constexpr int kBitReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

// softmax of `row[0..length)` in place.
void softmax(float* row, int64_t length) {
  const float top = *std::max_element(row, row + length);
  float total = 0.f;
  for (int64_t t = 0; t < length; ++t) {
    row[t] = std::exp(row[t] - top);
    total += row[t];
  }
  const float inverse = 1.f / total;
  for (int64_t t = 0; t < length; ++t) row[t] *= inverse;
}

// NaN in `out`'s `group` heads (head stride `out_stride`): a padding row of a replayed step attends to nothing
// and is never read.
void fill_nan(float* out, int64_t out_stride, int64_t group, int64_t head_dim) {
  for (int64_t g = 0; g < group; ++g)
    std::fill(out + g * out_stride, out + g * out_stride + head_dim, std::numeric_limits<float>::quiet_NaN());
}

// For the keys `from` to `to` of `rows`, adds weight * value to the output sums of up to kRows query rows: row h's
// weights at scores + h * padded, its sums in `sums[h]` (the first `used` rows; the rest stay as they are).
template <int64_t kVecs, int64_t kRows>
void add_weighted_values(RowWalk& rows, int64_t from, int64_t to, const float* scores, int64_t padded,
                         int64_t used, Vec (*sums)[kVecs]) {
  for (int64_t t = from; t < to; ++t) {
    const float* value = rows.next();
    Vec v[kVecs];
    for (int64_t k = 0; k < kVecs; ++k) v[k] = load(value + k * kKeysPerVector);
    for (int64_t h = 0; h < kRows; ++h) {
      if (h >= used) break;
      const float weight = scores[h * padded + t];
      for (int64_t k = 0; k < kVecs; ++k) sums[h][k] += weight * v[k];
    }
  }
}

// One sequence's KV head: softmax(q k^T * scale) v for the `group` query heads at `query` (head stride
// `query_stride`), written at `out` (head stride `out_stride`), for a head width of whole vectors. Sixteen keys'
// scores come out of sixteen products as one vector (no horizontal sum per key), and the output sums of four
// query heads at a time stay in registers while the values stream past. `scores` holds group rows of `padded`
// floats (length rounded up to sixteen).
template <int kHeadDim>
void attend_vectors(const float* query, int64_t query_stride, float* out, int64_t out_stride, int64_t group,
                    int64_t length, const int32_t* table, int64_t block_size, int64_t kv_head,
                    const CacheView& keys, const CacheView& values, float scale, float* scores, int64_t padded) {
  constexpr int64_t kVecs = kHeadDim / kKeysPerVector;
  constexpr int64_t kHeads = 4;  // query heads whose output sums share the registers
  RowWalk key_rows(keys, table, block_size, kv_head, length);
  const float* rows[kKeysPerVector];
  for (int64_t t0 = 0; t0 < length; t0 += kKeysPerVector) {
    const int64_t count = std::min(kKeysPerVector, length - t0);
    for (int64_t i = 0; i < count; ++i) rows[i] = key_rows.next();
    for (int64_t g = 0; g < group; ++g) {
      const float* q = query + g * query_stride;
      Vec partial[kKeysPerVector];
      for (int64_t i = 0; i < kKeysPerVector; ++i) {
        const int key = kBitReversed[i];
        if (key >= count) {  // past the last key: a score never read
          partial[i] = Vec{};
          continue;
        }
        Vec sum = load(q) * load(rows[key]);
        for (int64_t k = 1; k < kVecs; ++k) sum += load(q + k * kKeysPerVector) * load(rows[key] + k * kKeysPerVector);
        partial[i] = sum;
      }
      store(scores + g * padded + t0, sixteen_sums(partial) * scale);
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * padded, length);
  for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const int64_t heads = std::min(kHeads, group - g0);
    Vec sums[kHeads][kVecs] = {};
    RowWalk value_rows(values, table, block_size, kv_head, length);
    add_weighted_values<kVecs, kHeads>(value_rows, 0, length, scores + g0 * padded, padded, heads, sums);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t k = 0; k < kVecs; ++k) store(out + (g0 + h) * out_stride + k * kKeysPerVector, sums[h][k]);
  }
}

// attend_vectors for any other head width: one score per key, the output sums in `acc` (group * head_dim).
void attend_any_width(const float* query, int64_t query_stride, float* out, int64_t out_stride, int64_t group,
                      int64_t head_dim, int64_t length, const int32_t* table, int64_t block_size, int64_t kv_head,
                      const CacheView& keys, const CacheView& values, float scale, float* scores, int64_t padded,
                      float* acc) {
  RowWalk key_rows(keys, table, block_size, kv_head, length);
  for (int64_t t = 0; t < length; ++t) {
    const float* key = key_rows.next();
    for (int64_t g = 0; g < group; ++g) {
      const float* q = query + g * query_stride;
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * key[d];
      scores[g * padded + t] = dot * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * padded, length);
  std::fill(acc, acc + group * head_dim, 0.f);
  RowWalk value_rows(values, table, block_size, kv_head, length);
  for (int64_t t = 0; t < length; ++t) {
    const float* value = value_rows.next();
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * padded + t];
      float* a = acc + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] += weight * value[d];
    }
  }
  for (int64_t g = 0; g < group; ++g) std::copy(acc + g * head_dim, acc + (g + 1) * head_dim, out + g * out_stride);
}

// What both kernels read of a call: the cache's layout, the block tables and the context lengths.
struct PagedCall {
  int64_t head_dim, block_size, kv_heads, group, width;
  CacheView keys, values;
  const int32_t* tables;
  const int32_t* lengths;
};

PagedCall paged_call(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& context_lens) {
  const int64_t kv_heads = k_cache.size(2);
  return {q.size(2), k_cache.size(1), kv_heads, q.size(1) / kv_heads, block_tables.stride(0), view_of(k_cache),
          view_of(v_cache), block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>()};
}

// q [S, Hq, D], k_cache/v_cache [blocks, block_size, Hkv, D] (last dimension contiguous), block_tables [S, W]
// int32, context_lens [S] int32, out [S, Hq, D]: all float32 on the CPU (the Python side checks).
void paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            const at::Tensor& out) {
  const PagedCall call = paged_call(q, k_cache, v_cache, block_tables, context_lens);
  const int64_t seqs = q.size(0);
  const float* queries = q.data_ptr<float>();
  float* outputs = out.data_ptr<float>();
  // The common head widths get their own unrolled code; any other runs the general loop.
  auto* run = call.head_dim == 64 ? &attend_vectors<64> : call.head_dim == 128 ? &attend_vectors<128> : nullptr;
  at::parallel_for(0, seqs * call.kv_heads, 1, [&](int64_t begin, int64_t end) {
    AlignedFloats scores;
    std::vector<float> acc(call.group * call.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / call.kv_heads, kv_head = item % call.kv_heads;
      const int64_t length = call.lengths[seq];
      const float* query = queries + seq * q.stride(0) + kv_head * call.group * q.stride(1);
      float* output = outputs + seq * out.stride(0) + kv_head * call.group * out.stride(1);
      if (length <= 0) {
        fill_nan(output, out.stride(1), call.group, call.head_dim);
        continue;
      }
      const int64_t padded = (length + kKeysPerVector - 1) / kKeysPerVector * kKeysPerVector;
      float* score_rows = scores.resize(call.group * padded);
      const int32_t* table = call.tables + seq * call.width;
      if (run != nullptr)
        run(query, q.stride(1), output, out.stride(1), call.group, length, table, call.block_size, kv_head,
            call.keys, call.values, static_cast<float>(scale), score_rows, padded);
      else
        attend_any_width(query, q.stride(1), output, out.stride(1), call.group, call.head_dim, length, table,
                         call.block_size, kv_head, call.keys, call.values, static_cast<float>(scale), score_rows,
                         padded, acc.data());
    }
  });
}

constexpr int64_t kTile = 4;  // query rows computed together: independent sums that share each load

// The keys 0..length of one sequence's KV head, transposed into `transposed` ([head_dim][padded length], the
// padding zeroed), so that a query's dot products with sixteen keys are sixteen lanes of one vector.
void transpose_keys(const CacheView& keys, const int32_t* table, int64_t block_size, int64_t kv_head,
                    int64_t head_dim, int64_t length, int64_t padded, float* transposed) {
  RowWalk rows(keys, table, block_size, kv_head, length);
  for (int64_t t = 0; t < length; ++t) {
    const float* key = rows.next();
    for (int64_t d = 0; d < head_dim; ++d) transposed[d * padded + t] = key[d];
  }
  for (int64_t d = 0; d < head_dim; ++d)  // the padding past the last key: scores computed there are never read
    std::fill(transposed + d * padded + length, transposed + (d + 1) * padded, 0.f);
}

// Up to kTile query rows of one sequence's KV head (`queries[i]`, each seeing keys 0..visible[i], visible
// ascending; a tile of fewer rows repeats its last query and drops what it computes): softmax(q k^T * scale) v
// into `outs[i]`. `scores` holds kTile rows of `padded` floats, `acc` kTile rows of head_dim. Every row's sums
// run in an order set by its own `visible` alone, never by the rows beside it: each score is one sum over the
// head's width, each output width one sum over the keys in order.
template <int kHeadDim>
void attend_rows(const float* const* queries, float* const* outs, const int64_t* visible, int64_t count,
                 int64_t runtime_dim, int64_t padded, const float* transposed, const int32_t* table,
                 int64_t block_size, int64_t kv_head, const CacheView& values, float scale, float* scores,
                 float* acc) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_dim;
  const int64_t widest = visible[count - 1], narrowest = visible[0];
  for (int64_t t0 = 0; t0 < widest; t0 += kKeysPerVector) {
    Vec lanes[kTile] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
      const Vec column = load(transposed + d * padded + t0);
      for (int64_t i = 0; i < kTile; ++i) lanes[i] += queries[i][d] * column;
    }
    for (int64_t i = 0; i < count; ++i) store(scores + i * padded + t0, lanes[i] * scale);
  }
  for (int64_t i = 0; i < kTile; ++i) {
    float* row = scores + i * padded;
    if (i >= count) {  // no row: weights of zero for the values loop below
      std::fill(row, row + narrowest, 0.f);
      continue;
    }
    softmax(row, visible[i]);
  }
  if constexpr (kHeadDim > 0 && kHeadDim % kKeysPerVector == 0) {
    // The sums stay in registers: the values every row sees are loaded once for all of them, then each row
    // takes its own last keys alone.
    constexpr int64_t kVecs = kHeadDim / kKeysPerVector;
    Vec sums[kTile][kVecs] = {};
    RowWalk shared_rows(values, table, block_size, kv_head, widest);
    add_weighted_values<kVecs, kTile>(shared_rows, 0, narrowest, scores, padded, kTile, sums);
    for (int64_t i = 0; i < count; ++i) {
      RowWalk own_rows(values, table, block_size, kv_head, widest, narrowest);
      add_weighted_values<kVecs, 1>(own_rows, narrowest, visible[i], scores + i * padded, padded, 1, sums + i);
      for (int64_t k = 0; k < kVecs; ++k) store(outs[i] + k * kKeysPerVector, sums[i][k]);
    }
  } else {  // any other width: the same sums, in memory
    std::fill(acc, acc + kTile * head_dim, 0.f);
    for (int64_t i = 0; i < count; ++i) {
      float* a = acc + i * head_dim;
      RowWalk rows(values, table, block_size, kv_head, widest);
      for (int64_t t = 0; t < visible[i]; ++t) {
        const float* value = rows.next();
        const float weight = scores[i * padded + t];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += weight * value[d];
      }
      std::copy(a, a + head_dim, outs[i]);
    }
  }
}

// q [T, Hq, D] packed chunks (sequence i's rows query_start_loc[i]..query_start_loc[i+1], the last positions
// of its context_lens[i] cached tokens), caches and tables as for decode, out [T, Hq, D]: float32 on the CPU.
void paged_attention_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& context_lens, double scale, const at::Tensor& out) {
  const PagedCall call = paged_call(q, k_cache, v_cache, block_tables, context_lens);
  const int64_t seqs = context_lens.size(0);
  const float* query_data = q.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  auto* run = call.head_dim == 64 ? &attend_rows<64> : call.head_dim == 128 ? &attend_rows<128> : &attend_rows<0>;
  at::parallel_for(0, seqs * call.kv_heads, 1, [&](int64_t begin, int64_t end) {
    AlignedFloats transposed, scores, acc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / call.kv_heads, kv_head = item % call.kv_heads;
      const int64_t length = call.lengths[seq], first = starts[seq], rows = starts[seq + 1] - first;
      // Where a query row of this KV head sits in `q` or `out`: pairs run row-major, pair = row * group + head.
      auto offset_of = [&](const at::Tensor& rows_of, int64_t pair) {
        return (first + pair / call.group) * rows_of.stride(0) + (kv_head * call.group + pair % call.group) *
               rows_of.stride(1);
      };
      auto query = [&](int64_t pair) { return query_data + offset_of(q, pair); };
      auto output = [&](int64_t pair) { return out_data + offset_of(out, pair); };
      if (length <= 0) {  // a padding sequence: attends to nothing, never read
        for (int64_t pair = 0; pair < rows * call.group; ++pair)
          std::fill(output(pair), output(pair) + call.head_dim, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      if (rows <= 0) continue;
      const int64_t padded = (length + kKeysPerVector - 1) / kKeysPerVector * kKeysPerVector;
      float* keys_t = transposed.resize(call.head_dim * padded);
      float* score_rows = scores.resize(kTile * padded);
      float* sums = acc.resize(kTile * call.head_dim);
      const int32_t* table = call.tables + seq * call.width;
      transpose_keys(call.keys, table, call.block_size, kv_head, call.head_dim, length, padded, keys_t);
      for (int64_t pair = 0; pair < rows * call.group; pair += kTile) {
        const int64_t count = std::min(kTile, rows * call.group - pair);
        const float* tile_queries[kTile];
        float* tile_outs[kTile];
        int64_t visible[kTile];
        for (int64_t i = 0; i < kTile; ++i) {
          const int64_t row_pair = pair + std::min(i, count - 1);
          tile_queries[i] = query(row_pair);
          tile_outs[i] = output(row_pair);
          visible[i] = length - rows + row_pair / call.group + 1;  // causal: its own position and every one before
        }
        run(tile_queries, tile_outs, visible, count, call.head_dim, padded, keys_t, table, call.block_size, kv_head,
            call.values, static_cast<float>(scale), score_rows, sums);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(megatron_cpu, m) {
  m.def("paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, Tensor(a!) out) -> ()");
  m.def("paged_attention_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor context_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_cpu, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("paged_attention_prefill", &paged_attention_prefill);
}
