// llm_cpu::paged_prefill: prefill attention on CPU, fp32, reading K/V straight from the paged cache.
//
// The contract of kernels.reference.paged_prefill_ref: the new query rows of several sequences (ragged,
// as in chunked prefill) attend causally to their cached prefix plus themselves; query i of a sequence
// with q_len new tokens and seq_len positions sits at position seq_len - q_len + i.
// Why not the reference: per sequence it gathers the context into copies, permutes, builds a mask and
// runs SDPA on small matrices, a large share of a prefill step. Where the CPU has AVX-512 and head_dim
// is 32, 64 or 128, cpu_paged_prefill_avx512.cpp runs instead (flash-style, far faster on long contexts), on
// the tasks prefill_avx512 below hands out. Otherwise this file's AVX2 code: one task per (sequence,
// KV head) (or per chunk of its rows, where there are few sequences):
//   - K of that head is copied, transposed, into Kt (D, positions rounded up to 32, zeros past them);
//   - the rows (query position i, query head g of the group) go 3 at a time: scores for 32 positions
//     at once, outer-product style (a broadcast q element times a Kt vector), up to the last position
//     any of the 3 rows may see; an exact softmax per row over its own causal range (zeros after);
//   - then the output, 32 dims at a time, the probabilities broadcast times V rows read in place.
// Needs head_dim % 32 == 0 (64, 128); kernels.cpu_kernels.paged_prefill_cpu sends the rest to the
// reference. Built with the other CPU kernels by kernels/cpu_kernels.py.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_paged_checks.h"
#include "cpu_paged_prefill_avx512.h"
#include "cpu_simd.h"

namespace {

constexpr int kRows = 3;         // query rows per tile: 3 x 4 accumulators of AVX2's 16 registers
constexpr int64_t kCols = 32;    // positions (scores) or dims (output) per tile: 4 vectors

// s[r] = softmax over positions [0, limit[r]) of s[r], zeros in [limit[r], width).
void softmax_rows(float* s, int64_t stride, const int64_t* limit, int rows, int64_t width) {
  for (int r = 0; r < rows; ++r) {
    float* x = s + r * stride;
    const int64_t L = limit[r];
    float m = -INFINITY;
    for (int64_t t = 0; t < L; ++t) m = std::max(m, x[t]);
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) {
      const __m256 e = llm_cpu::exp(_mm256_sub_ps(_mm256_loadu_ps(x + t), vm));
      _mm256_storeu_ps(x + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = llm_cpu::horizontal_sum(vsum);
    for (; t < L; ++t) sum += (x[t] = std::exp(x[t] - m));
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    t = 0;
    for (; t + 8 <= L; t += 8) _mm256_storeu_ps(x + t, _mm256_mul_ps(_mm256_loadu_ps(x + t), inv));
    for (; t < L; ++t) x[t] *= 1.f / sum;
    std::fill(x + L, x + width, 0.f);
  }
}

// R query rows q[r] (each D floats) against Kt (D, kt_stride): s[r][t] = scale * q[r] . K[t] for t < width.
template <int R>
void scores_tile(const float* const* q, const float* Kt, int64_t kt_stride, int64_t width, int64_t D, float scale,
                 float* s, int64_t s_stride) {
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < width; t0 += kCols) {
    __m256 acc[R][4];
    for (auto& row : acc)
      for (auto& a : row) a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const float* k = Kt + d * kt_stride + t0;
      __m256 kv[4];
      for (int j = 0; j < 4; ++j) kv[j] = _mm256_loadu_ps(k + 8 * j);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_broadcast_ss(q[r] + d);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(qv, kv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(s + r * s_stride + t0 + 8 * j, _mm256_mul_ps(acc[r][j], vscale));
  }
}

// o[r] (D floats each) = sum over t < width of p[r][t] * V[t], V rows found through the block table.
template <int R>
void output_tile(const float* p, int64_t p_stride, int64_t width, const float* v_head, const int32_t* table,
                 int64_t BS, int64_t v_sb, int64_t v_so, int64_t D, float* const* o) {
  for (int64_t d0 = 0; d0 < D; d0 += kCols) {
    __m256 acc[R][4];
    for (auto& row : acc)
      for (auto& a : row) a = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < width; t0 += BS) {
      const float* vb = v_head + table[t0 / BS] * v_sb + d0;
      const int64_t n = std::min(width - t0, BS);
      for (int64_t t = 0; t < n; ++t) {
        __m256 vv[4];
        for (int j = 0; j < 4; ++j) vv[j] = _mm256_loadu_ps(vb + t * v_so + 8 * j);
        for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_broadcast_ss(p + r * p_stride + t0 + t);
          for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(a, vv[j], acc[r][j]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o[r] + d0 + 8 * j, acc[r][j]);
  }
}

// The head dims prefill_rows_avx512 takes (cpu_paged_prefill_avx512.h).
bool avx512_path_takes(int64_t D) { return D == 32 || D == 64 || D == 128; }

// The AVX-512 path: tasks (sequence b, KV head h, a range of its rows in whole tiles), heaviest first, taken
// by the threads as they come free (a row's work grows with the positions it sees, so equal row counts are
// not equal work). Enough tasks that the last ones are small: each (b, h) is split in up to 8 x threads /
// (B x KVH) ranges. A task copies the K and V rows it needs once: more ranges, more copies.
void prefill_avx512(const llm_cpu::PagedArgs& a, int64_t B) {
  struct Task {
    int64_t b, h, r_begin, r_end, work;
  };
  const int64_t threads = at::get_num_threads(), G = a.H / a.KVH, tile = llm_cpu::kPrefillTileRows;
  const int64_t chunks = std::max<int64_t>(1, (8 * threads + B * a.KVH - 1) / (B * a.KVH));
  std::vector<Task> tasks;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = a.qsl[b + 1] - a.qsl[b], first = a.lens[b] - q_len, rows = q_len * G;
    const int64_t tiles = (rows + tile - 1) / tile;
    if (rows == 0) continue;
    max_len = std::max<int64_t>(max_len, a.lens[b]);
    const int64_t parts = std::min(chunks, tiles);
    for (int64_t h = 0; h < a.KVH; ++h) {
      for (int64_t c = 0; c < parts; ++c) {
        const int64_t r0 = tiles * c / parts * tile, r1 = std::min(rows, tiles * (c + 1) / parts * tile);
        if (r0 < r1) tasks.push_back({b, h, r0, r1, (r1 - r0) * (first + (r0 + r1) / (2 * G) + tile)});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.work > y.work; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size()), scratch = llm_cpu::prefill_scratch_floats_avx512(a.D, max_len);
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    std::vector<float> buffer(scratch);
    for (int64_t i = next++; i < n; i = next++) {
      const Task& t = tasks[i];
      llm_cpu::prefill_rows_avx512(a, t.b, t.h, t.r_begin, t.r_end, buffer.data());
    }
  });
}

// q (T, H, D); k_cache, v_cache (NB, BS, KVH, D), unit stride on D; block_tables (B, max_blocks) int32;
// query_start_loc (B + 1,) int32; seq_lens (B,) int32 -> (T, H, D)
at::Tensor paged_prefill(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         double scale) {
  for (const at::Tensor* t : {&q_in, &k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, "q and the caches must be CPU float32");
  }
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q must be (T, H, D) and both caches (num_blocks, block_size, KVH, D)");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the caches need unit stride on head_dim");
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt, "block_tables, query_start_loc and seq_lens must be int32");
  }
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor qsl = query_start_loc.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q and the caches differ");
  TORCH_CHECK(D % kCols == 0, "head_dim must be a multiple of 32");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  const int64_t B = lens.numel(), max_blocks = tables.size(1);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && qsl.numel() == B + 1,
              "block_tables (B, max_blocks), query_start_loc (B + 1,), seq_lens (B,)");
  const int32_t* table_p = tables.const_data_ptr<int32_t>();
  const int32_t* qsl_p = qsl.const_data_ptr<int32_t>();
  const int32_t* lens_p = lens.const_data_ptr<int32_t>();
  // Checked here, once, so the parallel loop below cannot read or write outside its tensors.
  TORCH_CHECK(qsl_p[0] == 0 && qsl_p[B] == T, "query_start_loc must run from 0 to T = ", T);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qsl_p[b + 1] - qsl_p[b], L = lens_p[b];
    TORCH_CHECK(q_len >= 0, "query_start_loc must not decrease");
    TORCH_CHECK(L >= q_len && L <= max_blocks * BS, "seq_lens[", b, "] = ", L, " is outside [", q_len, ", ", max_blocks * BS, "]");
    llm_cpu::check_block_table(table_p, max_blocks, b, L, BS, NB);
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.const_data_ptr<float>();
  const float* kp = k_cache.const_data_ptr<float>();
  const float* vp = v_cache.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t k_sb = k_cache.stride(0), k_so = k_cache.stride(1), k_sh = k_cache.stride(2);
  const int64_t v_sb = v_cache.stride(0), v_so = v_cache.stride(1), v_sh = v_cache.stride(2);
  const int64_t G = H / KVH;
  const float fscale = static_cast<float>(scale);
  if (llm_cpu::ops::avx512_on() && avx512_path_takes(D)) {
    const llm_cpu::PagedArgs args{qp, kp, vp, op, table_p, lens_p, max_blocks, H, KVH, D, BS,
                                  k_sb, k_so, k_sh, v_sb, v_so, v_sh, fscale, qsl_p};
    prefill_avx512(args, B);
    return out;
  }

  // Tasks (sequence, KV head, chunk of its rows); a sequence's rows are split in chunks only when there are
  // too few (sequence, head) pairs to keep every thread busy (one 128-token prompt: 3 heads, 2 threads).
  // Threads take tasks round-robin: rows late in a sequence see more positions, and contiguous ranges of
  // tasks would give one thread all the late ones.
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::max<int64_t>(1, (4 * threads + B * KVH - 1) / (B * KVH));
  const int64_t tasks = B * KVH * chunks;
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    std::vector<float> Kt, S;
    for (int64_t tid = first_thread; tid < last_thread; ++tid) {
      for (int64_t task = tid; task < tasks; task += threads) {
        const int64_t b = task / (KVH * chunks), h = task / chunks % KVH, c = task % chunks;
        const int64_t lo = qsl_p[b], q_len = qsl_p[b + 1] - lo, L = lens_p[b], first = L - q_len;
        // Rows r = i * G + g: query position i, head h * G + g; this task's [r_begin, r_end), whole tiles.
        const int64_t rows = q_len * G, tiles = (rows + kRows - 1) / kRows;
        const int64_t r_begin = tiles * c / chunks * kRows, r_end = std::min(rows, tiles * (c + 1) / chunks * kRows);
        if (r_begin >= r_end) continue;
        const int32_t* table = table_p + b * max_blocks;
        const int64_t seen_max = first + (r_end - 1) / G + 1;  // positions this task's last row sees
        const int64_t width = (seen_max + kCols - 1) / kCols * kCols;
        Kt.assign(D * width, 0.f);  // (D, width)
        for (int64_t t = 0; t < seen_max; ++t) {
          const float* k = kp + table[t / BS] * k_sb + (t % BS) * k_so + h * k_sh;
          for (int64_t d = 0; d < D; ++d) Kt[d * width + t] = k[d];
        }
        S.resize(kRows * width);
        for (int64_t r0 = r_begin; r0 < r_end; r0 += kRows) {
          const int R = static_cast<int>(std::min<int64_t>(kRows, r_end - r0));
          const float* qr[kRows];
          float* orow[kRows];
          int64_t limit[kRows];
          for (int r = 0; r < R; ++r) {
            const int64_t i = (r0 + r) / G, g = (r0 + r) % G;
            qr[r] = qp + ((lo + i) * H + h * G + g) * D;
            orow[r] = op + ((lo + i) * H + h * G + g) * D;
            limit[r] = first + i + 1;  // positions this row sees
          }
          const int64_t seen = limit[R - 1];  // the tile's last row sees the most
          const int64_t tile_width = (seen + kCols - 1) / kCols * kCols;
          switch (R) {
            case 1: scores_tile<1>(qr, Kt.data(), width, tile_width, D, fscale, S.data(), width); break;
            case 2: scores_tile<2>(qr, Kt.data(), width, tile_width, D, fscale, S.data(), width); break;
            default: scores_tile<3>(qr, Kt.data(), width, tile_width, D, fscale, S.data(), width); break;
          }
          softmax_rows(S.data(), width, limit, R, seen);
          const float* v_head = vp + h * v_sh;
          switch (R) {
            case 1: output_tile<1>(S.data(), width, seen, v_head, table, BS, v_sb, v_so, D, orow); break;
            case 2: output_tile<2>(S.data(), width, seen, v_head, table, BS, v_sb, v_so, D, orow); break;
            default: output_tile<3>(S.data(), width, seen, v_head, table, BS, v_sb, v_so, D, orow); break;
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("paged_prefill", paged_prefill); }
