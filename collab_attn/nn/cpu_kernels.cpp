// The two products of a collaborative decoding step, for x86 CPUs with AVX2 and FMA, float32: the scores of every
// layout (keys only or with shared values), and the weighted values of keys-only heads (a value per head).
//
// shared_key_scores(q, k): every head scores against the one shared key of each position, (B, R, W) x (B, S, W)
//   -> (B, R, S). PyTorch's batched matrix product runs this shape (a few query rows against many keys) at a
//   fraction of the machine's speed; here a block of four keys is loaded once and scored by every row while it is
//   in L1, and the keys ahead are prefetched, so each key is read from memory once.
// weighted_values(p, v): each head's weighted sum of its own values, (B, H, T, S) x (B, H, S, D) -> (B, H, T, D):
//   one pass over a head's values per query row, eight running vectors of eight columns at a time.
//
// Both take any strides whose last one is 1 (a view of a packed cache reads in place), and split their work over
// PyTorch's intra-op threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

namespace {

constexpr int64_t kKeysPerTile = 4;     // keys scored together against each row
constexpr int64_t kKeysPerJob = 256;    // keys per unit of parallel work
constexpr int64_t kPrefetchKeys = 16;   // how far ahead the keys are prefetched

// Rows r0..r0+NR of q against keys t..t+3: 4 NR running sums of 8 lanes, reduced to 4 NR scores.
template <int NR>
inline void score_tile(const float* q, int64_t q_row, const float* k, int64_t k_row, int64_t width,
                       __m256i tail_mask, float* out, int64_t out_row) {
  const int64_t full = width / 8 * 8;
  __m256 acc[NR][kKeysPerTile];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < kKeysPerTile; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < full; d += 8) {
    __m256 key[kKeysPerTile];
    for (int j = 0; j < kKeysPerTile; ++j) key[j] = _mm256_loadu_ps(k + j * k_row + d);
    for (int i = 0; i < NR; ++i) {
      const __m256 row = _mm256_loadu_ps(q + i * q_row + d);
      for (int j = 0; j < kKeysPerTile; ++j) acc[i][j] = _mm256_fmadd_ps(row, key[j], acc[i][j]);
    }
  }
  if (full < width) {  // the last width % 8 columns, through a masked load (the rest of the lanes read as zero)
    __m256 key[kKeysPerTile];
    for (int j = 0; j < kKeysPerTile; ++j) key[j] = _mm256_maskload_ps(k + j * k_row + full, tail_mask);
    for (int i = 0; i < NR; ++i) {
      const __m256 row = _mm256_maskload_ps(q + i * q_row + full, tail_mask);
      for (int j = 0; j < kKeysPerTile; ++j) acc[i][j] = _mm256_fmadd_ps(row, key[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i) {  // lane sums of the four keys' accumulators, side by side
    const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3]));
    _mm_storeu_ps(out + i * out_row, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
  }
}

float dot(const float* a, const float* b, int64_t width) {
  float sum = 0.f;
  for (int64_t d = 0; d < width; ++d) sum += a[d] * b[d];
  return sum;
}

void check_float_cpu(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dimensions, got shape ", t.sizes());
}

at::Tensor shared_key_scores(const at::Tensor& queries, const at::Tensor& keys) {
  check_float_cpu(queries, "queries", 3);
  check_float_cpu(keys, "keys", 3);
  TORCH_CHECK(queries.size(0) == keys.size(0) && queries.size(2) == keys.size(2),
              "queries (B, R, W) and keys (B, S, W) must agree on B and W, got ", queries.sizes(), " and ",
              keys.sizes());
  const at::Tensor q = queries.contiguous();
  const at::Tensor k = keys.stride(2) == 1 ? keys : keys.contiguous();
  const int64_t batch = q.size(0), rows = q.size(1), width = q.size(2), src = k.size(1);
  at::Tensor out = at::empty({batch, rows, src}, q.options());
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t k_batch = k.stride(0), k_row = k.stride(1);
  const int rest = int(width % 8);
  const __m256i tail_mask = _mm256_setr_epi32(-(0 < rest), -(1 < rest), -(2 < rest), -(3 < rest), -(4 < rest),
                                              -(5 < rest), -(6 < rest), 0);
  const int64_t jobs_per_batch = (src + kKeysPerJob - 1) / kKeysPerJob;
  at::parallel_for(0, batch * jobs_per_batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / jobs_per_batch, start = job % jobs_per_batch * kKeysPerJob;
      const int64_t stop = std::min(src, start + kKeysPerJob);
      const float* qb = q_data + b * rows * width;
      const float* kb = k_data + b * k_batch;
      float* ob = out_data + b * rows * src;
      int64_t t = start;
      for (; t + kKeysPerTile <= stop; t += kKeysPerTile) {
        if (t + kPrefetchKeys + kKeysPerTile <= src)
          for (int64_t j = 0; j < kKeysPerTile; ++j)
            for (int64_t byte = 0; byte < width * 4; byte += 64)
              _mm_prefetch(reinterpret_cast<const char*>(kb + (t + kPrefetchKeys + j) * k_row) + byte, _MM_HINT_T0);
        int64_t r = 0;
        for (; r + 3 <= rows; r += 3)
          score_tile<3>(qb + r * width, width, kb + t * k_row, k_row, width, tail_mask, ob + r * src + t, src);
        if (rows - r == 2)
          score_tile<2>(qb + r * width, width, kb + t * k_row, k_row, width, tail_mask, ob + r * src + t, src);
        if (rows - r == 1)
          score_tile<1>(qb + r * width, width, kb + t * k_row, k_row, width, tail_mask, ob + r * src + t, src);
      }
      for (; t < stop; ++t)
        for (int64_t r = 0; r < rows; ++r) ob[r * src + t] = dot(qb + r * width, kb + t * k_row, width);
    }
  });
  return out;
}

// out[d] = sum_s p[s] v[s, d] for columns d0 .. d0 + 8 n (n <= 8 vectors held in registers)
void weighted_columns(const float* p, const float* v, int64_t v_row, int64_t src, int64_t d0, int64_t n,
                      float* out) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < src; ++s) {
    const __m256 w = _mm256_set1_ps(p[s]);
    const float* row = v + s * v_row + d0;
    for (int j = 0; j < n; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * j), acc[j]);
  }
  for (int j = 0; j < n; ++j) _mm256_storeu_ps(out + d0 + 8 * j, acc[j]);
}

at::Tensor weighted_values(const at::Tensor& weights, const at::Tensor& values) {
  check_float_cpu(weights, "weights", 4);
  check_float_cpu(values, "values", 4);
  TORCH_CHECK(weights.size(0) == values.size(0) && weights.size(1) == values.size(1) &&
                  weights.size(3) == values.size(2),
              "weights (B, H, T, S) and values (B, H, S, D) must agree on B, H and S, got ", weights.sizes(), " and ",
              values.sizes());
  const at::Tensor p = weights.contiguous();
  const at::Tensor v = values.stride(3) == 1 ? values : values.contiguous();
  const int64_t batch = p.size(0), heads = p.size(1), tgt = p.size(2), src = p.size(3), width = v.size(3);
  at::Tensor out = at::empty({batch, heads, tgt, width}, p.options());
  const float* p_data = p.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t full = width / 8 * 8;
  at::parallel_for(0, batch * heads * tgt, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (heads * tgt), h = row / tgt % heads;
      const float* pr = p_data + row * src;
      const float* vh = v_data + b * v.stride(0) + h * v.stride(1);
      float* o = out_data + row * width;
      for (int64_t d0 = 0; d0 < full; d0 += 64) weighted_columns(pr, vh, v.stride(2), src, d0,
                                                                  std::min<int64_t>(8, (full - d0) / 8), o);
      for (int64_t d = full; d < width; ++d) {
        float sum = 0.f;
        for (int64_t s = 0; s < src; ++s) sum += pr[s] * vh[s * v.stride(2) + d];
        o[d] = sum;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(collab_attn, m) {
  m.def("shared_key_scores(Tensor queries, Tensor keys) -> Tensor");
  m.def("weighted_values(Tensor weights, Tensor values) -> Tensor");
}

TORCH_LIBRARY_IMPL(collab_attn, CPU, m) {
  m.impl("shared_key_scores", &shared_key_scores);
  m.impl("weighted_values", &weighted_values);
}
