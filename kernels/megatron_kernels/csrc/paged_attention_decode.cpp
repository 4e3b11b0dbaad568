// Decode attention over the paged KV cache on a CPU, reading each key and value where it lies in the pool.
//
// The PyTorch reference gathers every sequence's keys and values into a copy and multiplies the copy, so a
// decode step moves the cache through memory three times; here each (sequence, KV head) walks its block table
// and reads every key once for the scores and every value once for the output. The query heads that share a
// KV head go together, so a key is loaded once for all of them.
//
// Each (sequence, KV head) is summed in one fixed order that depends on nothing but its own context, so a
// row's result is the same whatever the batch around it (the engine's parity tests compare with ==).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Strides in elements of one cache (keys or values), logical shape [blocks, block_size, kv_heads, head_dim]:
// a pool stored heads first and one stored blocks first are both read in place.
struct CacheView {
  const float* data;
  int64_t block, token, head;

  const float* row(int64_t block_id, int64_t token_in_block, int64_t kv_head) const {
    return data + block_id * block + token_in_block * token + kv_head * head;
  }
};

CacheView view_of(const at::Tensor& cache) {
  return {cache.data_ptr<float>(), cache.stride(0), cache.stride(1), cache.stride(2)};
}

// One sequence's KV head: softmax(q k^T * scale) v for the `group` query heads at `query` (head stride
// `query_stride`), written at `out` (head stride `out_stride`). `scores` holds group * length floats, `acc`
// group * head_dim. kHeadDim > 0 fixes the width at compile time, so the compiler unrolls each row's
// arithmetic into whole vector registers; 0 reads it from `runtime_dim`.
template <int kHeadDim>
void attend(const float* query, int64_t query_stride, float* out, int64_t out_stride, int64_t group,
            int64_t runtime_dim, int64_t length, const int32_t* table, int64_t block_size, int64_t kv_head,
            const CacheView& keys, const CacheView& values, float scale, float* scores, float* acc) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_dim;
  if (length <= 0) {  // a padding row of a replayed step: attends to nothing, never read
    for (int64_t g = 0; g < group; ++g)
      std::fill(out + g * out_stride, out + g * out_stride + head_dim, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  for (int64_t t = 0; t < length; ++t) {
    const float* key = keys.row(table[t / block_size], t % block_size, kv_head);
    for (int64_t g = 0; g < group; ++g) {
      const float* q = query + g * query_stride;
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * key[d];
      scores[g * length + t] = dot * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * length;
    const float top = *std::max_element(row, row + length);
    float total = 0.f;
    for (int64_t t = 0; t < length; ++t) {
      row[t] = std::exp(row[t] - top);
      total += row[t];
    }
    const float inverse = 1.f / total;
    for (int64_t t = 0; t < length; ++t) row[t] *= inverse;
  }
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t t = 0; t < length; ++t) {
    const float* value = values.row(table[t / block_size], t % block_size, kv_head);
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * length + t];
      float* a = acc + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] += weight * value[d];
    }
  }
  for (int64_t g = 0; g < group; ++g) std::copy(acc + g * head_dim, acc + (g + 1) * head_dim, out + g * out_stride);
}

// q [S, Hq, D], k_cache/v_cache [blocks, block_size, Hkv, D] (last dimension contiguous), block_tables [S, W]
// int32, context_lens [S] int32, out [S, Hq, D]: all float32 on the CPU (the Python side checks).
void paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            const at::Tensor& out) {
  const int64_t seqs = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const CacheView keys = view_of(k_cache), values = view_of(v_cache);
  const float* queries = q.data_ptr<float>();
  float* outputs = out.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lengths = context_lens.data_ptr<int32_t>();
  const int64_t width = block_tables.stride(0);
  // The common head widths get their own unrolled code; any other runs the general loop.
  auto* run = head_dim == 64 ? &attend<64> : head_dim == 128 ? &attend<128> : &attend<0>;
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, kv_head = item % kv_heads;
      const int64_t length = lengths[seq];
      scores.resize(group * std::max<int64_t>(length, 1));
      run(queries + seq * q.stride(0) + kv_head * group * q.stride(1), q.stride(1),
          outputs + seq * out.stride(0) + kv_head * group * out.stride(1), out.stride(1), group, head_dim, length,
          tables + seq * width, block_size, kv_head, keys, values, static_cast<float>(scale), scores.data(),
          acc.data());
    }
  });
}

}  // namespace

TORCH_LIBRARY(megatron_cpu, m) {
  m.def("paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_cpu, CPU, m) { m.impl("paged_attention_decode", &paged_attention_decode); }
