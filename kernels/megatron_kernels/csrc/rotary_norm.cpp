// The CPU engine's per-token passes in one loop each, where the PyTorch reference runs a dozen ops (and a dozen
// passes over the rows): the rotary embedding fused with the KV-cache write, and RMSNorm with its residual add.
//
// The rotary arithmetic is the reference's, operation for operation, and this file is compiled without
// floating-point contraction, so each rotated value is the reference's bit for bit. RMSNorm sums its squares in
// vector lanes (an order of its own, fixed by the row's width alone), so it equals the reference within
// rounding and a row's result never depends on the rows beside it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace {

// Rotates `heads` heads of one token, [head stride `stride`, width `dim`] at `x`, into contiguous `out`:
// (x1 cos - x2 sin, x2 cos + x1 sin, the rest as it is), `half` = the rotary half width.
void rotate(const float* __restrict__ x, int64_t stride, int64_t heads, int64_t dim, int64_t half,
            const float* __restrict__ cos, const float* __restrict__ sin, float* __restrict__ out) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* __restrict__ row = x + h * stride;
    float* __restrict__ target = out + h * dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = row[i], x2 = row[half + i];
      const float first = x1 * cos[i], first_sub = x2 * sin[i];
      const float second = x2 * cos[i], second_add = x1 * sin[i];
      target[i] = first - first_sub;
      target[half + i] = second + second_add;
    }
    for (int64_t i = 2 * half; i < dim; ++i) target[i] = row[i];
  }
}

// q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (last dimension contiguous, any token and head strides),
// positions [T] int64, cos/sin [P, half] contiguous, caches [blocks, block_size, Hkv, D] (last dimension
// contiguous), slot_mapping [T] int64 (negative: not stored). Returns the rotated (q, k), contiguous.
std::tuple<at::Tensor, at::Tensor> rotary_write_kv_cache(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const at::Tensor& positions,
                                                         const at::Tensor& cos, const at::Tensor& sin,
                                                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                         const at::Tensor& slot_mapping) {
  const int64_t tokens = q.size(0), q_heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  const int64_t half = cos.size(1), block_size = k_cache.size(1);
  at::Tensor q_out = at::empty({tokens, q_heads, dim}, q.options());
  at::Tensor k_out = at::empty({tokens, kv_heads, dim}, k.options());
  const int64_t* where = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* cos_table = cos.data_ptr<float>();
  const float* sin_table = sin.data_ptr<float>();
  const float* queries = q.data_ptr<float>();
  const float* keys = k.data_ptr<float>();
  const float* values = v.data_ptr<float>();
  float* rotated_queries = q_out.data_ptr<float>();
  float* rotated_keys = k_out.data_ptr<float>();
  float* key_pool = k_cache.data_ptr<float>();
  float* value_pool = v_cache.data_ptr<float>();
  const int64_t q_token = q.stride(0), q_head = q.stride(1), k_token = k.stride(0), k_head = k.stride(1);
  const int64_t v_token = v.stride(0), v_head = v.stride(1);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_table + where[t] * half;
      const float* s = sin_table + where[t] * half;
      rotate(queries + t * q_token, q_head, q_heads, dim, half, c, s, rotated_queries + t * q_heads * dim);
      float* rotated_key = rotated_keys + t * kv_heads * dim;
      rotate(keys + t * k_token, k_head, kv_heads, dim, half, c, s, rotated_key);
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding row of a replayed step
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::copy(rotated_key + h * dim, rotated_key + (h + 1) * dim, key_pool + block * kb + offset * kt + h * kh);
        const float* value = values + t * v_token + h * v_head;
        std::copy(value, value + dim, value_pool + block * vb + offset * vt + h * vh);
      }
    }
  });
  return {q_out, k_out};
}

// One row: out = weight * (x * rsqrt(mean(x^2) + eps)).
void normalize(const float* x, const float* weight, int64_t width, float eps, float* out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < width; ++i) squares += x[i] * x[i];
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) out[i] = weight[i] * (x[i] * scale);
}

// x [rows, width] contiguous rows, weight [width]: RMSNorm of each row, into a new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t width = x.size(-1), rows = x.numel() / width;
  at::Tensor out = at::empty_like(x);
  const float* input = x.data_ptr<float>();
  const float* scale = weight.data_ptr<float>();
  float* output = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalize(input + r * width, scale, width, static_cast<float>(eps), output + r * width);
  });
  return out;
}

// (rms_norm(x + residual), x + residual) for contiguous x and residual [rows, width].
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  const int64_t width = x.size(-1), rows = x.numel() / width;
  at::Tensor summed = at::empty_like(x), out = at::empty_like(x);
  const float* input = x.data_ptr<float>();
  const float* added = residual.data_ptr<float>();
  const float* scale = weight.data_ptr<float>();
  float* sums = summed.data_ptr<float>();
  float* output = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* a = input + r * width;
      const float* b = added + r * width;
      float* sum = sums + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) sum[i] = a[i] + b[i];
      normalize(sum, scale, width, static_cast<float>(eps), output + r * width);
    }
  });
  return {out, summed};
}

}  // namespace

TORCH_LIBRARY(megatron_cpu_rows, m) {
  m.def("rotary_write_kv_cache(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_cpu_rows, CPU, m) {
  m.impl("rotary_write_kv_cache", &rotary_write_kv_cache);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
}
