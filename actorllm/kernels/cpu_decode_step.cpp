// A whole decode step of the Llama-family model as one torch op, so the GIL is released
// once per step instead of once per op.
//
// Why: on the CPU every torch op called from Python drops the GIL for its work and takes
// it back after. A decode step of the embedded model is ~150 such calls, and in the
// `single` topology the event loop holds the GIL between them: measured, a 64-sequence
// step took ~10 ms alone and ~24 ms beside a busy loop, each retake waiting for the
// loop's next release. Here the same ATen ops run from C++ under one release (the op is
// called through torch.ops, whose binding drops the GIL for the call).
//
// It computes what actorllm/model/llama.py computes for a batch of one token a row, op for
// op (a prefill chunk comes as a row per token, ops/cpu_step.py says how; the Python
// module stays the reference and the path for other dtypes and tensor parallelism): the
// same RMSNorm, the same mm on the linears' [in, out] weights (ops/cpu_linear.py) and the
// decode attention, windowed per layer, of the C kernel (cpu_paged_decode.c), whose
// address the caller passes in. RoPE, the KV write and q's copy are one loop
// (rope_and_write_kv) rounding as the module's do. Tests compare it with the module bit
// for bit on decode steps, and closely on prefill, whose attention the module does by
// SDPA (tests/test_cpu_step.py).
//
// Built by actorllm/ops/cpu_step.py against the installed torch's headers.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/silu.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/ParallelGuard.h>
#include <omp.h>
#include <torch/library.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/syscall.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using at::Tensor;

using DecodeFn = int (*)(const float*, const float*, const float*, const int32_t*,
                         const int32_t*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, float, int64_t, float, int);

#include "cpu_sample_rows.h"
#include "cpu_small_mm.h"

// Whether the op's own GEMM (cpu_small_mm.h) runs the linears MKL would: where the widest
// body is AVX2 (a CPU without AVX-512, or a cap), and on an AVX-512 CPU that is not
// Intel's. MKL picks its kernels by vendor: on an AMD EPYC with AVX-512 (Zen 4) it ran
// its generic AVX2 ones and copied the weight into its blocks at every call, and the
// panel GEMM beat it at every shape of the embedded and near-zero models from 8 rows up
// (docs/architecture.md, "Weights in panels"); on the Intel AVX-512 host MKL's few-row
// GEMM measured cheap (one row and 8 drafts ~1.2x a plain step's forward).
bool own_gemm() {
#ifdef ACTORLLM_AVX2
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel");
  }();
  const int isa = vector_isa();
  return isa == 1 || (isa == 2 && !intel);
#else
  return false;
#endif
}

// Whether a linear of `rows` rows of an [in, out] weight takes small_mm rather than MKL.
bool small_rows(int64_t rows) {
#ifdef ACTORLLM_AVX2
  return rows >= kSmallRowsMin && rows <= kSmallRowsMax && own_gemm();
#else
  return false;
#endif
}

// Whether `weight` is laid out in panels [out / 16, in, 16] (cpu_small_mm.h; PackedLinear
// makes them where own_gemm() holds when it loads), not [in, out].
bool in_panels(const Tensor& weight) { return weight.dim() == 3; }

// A linear's output width, in either layout.
int64_t out_features(const Tensor& weight) {
  return in_panels(weight) ? weight.size(0) * weight.size(2) : weight.size(1);
}

// out = x @ weight (+ bias) by small_mm or, for panels, panel_mm; x, weight and bias
// contiguous fp32.
void own_linear_into(Tensor& out, const Tensor& x, const Tensor& weight,
                     const std::optional<Tensor>& bias) {
#ifdef ACTORLLM_AVX2
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (in_panels(weight))
    panel_mm(x.data_ptr<float>(), x.size(0), x.size(1), weight.data_ptr<float>(),
             out_features(weight), b, out.data_ptr<float>());
  else
    small_mm(x.data_ptr<float>(), x.size(0), x.size(1), weight.data_ptr<float>(),
             weight.size(1), b, out.data_ptr<float>());
#else
  TORCH_CHECK(false, "actorllm::linear: built without AVX2");
#endif
}

// PackedLinear.forward for a 2-D fp32 input (the only dtype the op runs): a weight laid
// out [in, out] is one mm (addmm with a bias), or small_mm for a few rows; one in panels
// is panel_mm at every row count. Registered as actorllm::linear too, which the module
// calls (ops/cpu_linear.py), so the op and the module stay equal bit for bit.
Tensor packed_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  const bool panels = in_panels(weight);
  if (panels || small_rows(x.size(0))) {
    // Anything else goes to mm, whose errors name it; panels have no mm to go to.
    const bool fits = x.dim() == 2 && x.scalar_type() == at::kFloat &&
                      weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                      (panels || weight.dim() == 2) &&
                      weight.size(panels ? 1 : 0) == x.size(1) &&
                      (!bias.has_value() || (bias->scalar_type() == at::kFloat &&
                                             bias->is_contiguous() &&
                                             bias->numel() == out_features(weight)));
    TORCH_CHECK(fits || !panels, "actorllm::linear: a weight in panels [out / 16, in, 16] "
                "takes 2-D fp32 rows of its input width and a contiguous fp32 bias of its "
                "output width");
    TORCH_CHECK(!panels || (weight.size(2) == kPanel && cpu_vector_isa() >= 1),
                "actorllm::linear: panels of 16 columns, on a CPU with AVX2");
    if (fits) {
      Tensor out = at::empty({x.size(0), out_features(weight)}, x.options());
      own_linear_into(out, x.contiguous(), weight, bias);
      return out;
    }
  }
  return bias.has_value() ? at::addmm(*bias, x, weight) : at::mm(x, weight);
}

Tensor sample_rows(const Tensor& logits, const Tensor& temperature,
                   const std::optional<Tensor>& uniforms, double greedy_below);
Tensor head_and_sample(const Tensor& x, const Tensor& head, const Tensor& temperature,
                       double greedy_below, bool helper);

// RoPE on q and k, q into its own tensor, k and v into the caches at their slots: what
// the module does with a mul, a roll, a mul and an add on [T, H + KV, D], two index_copy_
// and a contiguous copy of q (eight op dispatches a layer, launch-bound at 64 rows), in
// one loop. Each value is rounded as those ops round it (x * cos, rolled x * sin, their
// sum; cos and sin come as [T, D / 2], the first half's sin negated by subtracting),
// and nothing here targets FMA, so the result is bit-equal to the module's
// (tests/test_cpu_step.py).
void rope_and_write_kv(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                       const int64_t* slots, Tensor& q, const Tensor& k_cache,
                       const Tensor& v_cache) {
  TORCH_CHECK(qkv.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "llama_decode: qkv and the caches must be contiguous");
  const int64_t tokens = qkv.size(0), heads = q.size(1), dim = q.size(2), half = dim / 2;
  const int64_t kv_heads = (qkv.size(1) - heads) / 2, width = qkv.size(1) * dim;
  TORCH_CHECK(cos.size(-1) == half && sin.size(-1) == half, "llama_decode: rope's half width");
  const float *src = qkv.data_ptr<float>(), *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  float *qs = q.data_ptr<float>(), *ks = k_cache.data_ptr<float>(), *vs = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const float *row = src + t * width, *ct = c + t * half, *st = s + t * half;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const float* x = row + h * dim;
      float* out = h < heads ? qs + (t * heads + h) * dim
                             : ks + (slots[t] * kv_heads + h - heads) * dim;
      for (int64_t d = 0; d < half; ++d) {  // the module's sin is -sin here
        const float a = x[d] * ct[d], b = x[d + half] * st[d];
        out[d] = a - b;
      }
      for (int64_t d = half; d < dim; ++d) {
        const float a = x[d] * ct[d - half], b = x[d - half] * st[d - half];
        out[d] = a + b;
      }
    }
    std::memcpy(vs + slots[t] * kv_heads * dim, row + (heads + kv_heads) * dim,
                sizeof(float) * kv_heads * dim);
  }
}

#include "cpu_step_helper.h"

// Rows a block of the decode kernel's calls when the helper shares the attention.
constexpr int64_t kAttendRows = 16;

// The decode kernel over every row: one call on the whole team, or, on a team of one
// with `helper`, a call per kAttendRows rows, taken from a counter by this thread and
// the helper (cpu_step_helper.h). Each row reads its own table and writes its own
// output, so a call per block computes what one call does, bit for bit.
int attend(DecodeFn decode, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
           const Tensor& block_tables, const Tensor& seq_lens, Tensor& out,
           int64_t num_kv_heads, float scale, int64_t window, bool helper) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t width = block_tables.size(1), block_size = k_cache.size(1);
  const float *qs = q.data_ptr<float>(), *ks = k_cache.data_ptr<float>(),
              *vs = v_cache.data_ptr<float>();
  const int32_t *tables = block_tables.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  float* os = out.data_ptr<float>();
  // Rows [b, b + n) on a team of `team`: the kernel's call with those rows' pointers.
  const auto rows_from = [&](int64_t b, int64_t n, int team) {
    return decode(qs + b * heads * dim, ks, vs, tables + b * width, lens + b,
                  os + b * heads * dim, n, heads, num_kv_heads, dim, block_size, width, scale,
                  window, 0.0f, team);
  };
  const int threads = at::get_num_threads();
  const int64_t blocks = (rows + kAttendRows - 1) / kAttendRows;
  if (threads > 1 || !helper || blocks < 2) return rows_from(0, rows, threads);
  std::atomic<int64_t> next{0};
  std::atomic<int> rc{0};
  StepHelper::get().share([&] {
    for (int64_t i = next++; i < blocks; i = next++) {
      const int64_t b = i * kAttendRows;
      const int r = rows_from(b, std::min(kAttendRows, rows - b), 1);
      if (r != 0) rc = r;
    }
  });
  return rc;
}

// Weights per layer in `weights` (after the embedding at index 0), and biases per layer
// in `biases`, in this order.
constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post norm, gate_up, down
constexpr int64_t kBiasesPerLayer = 4;   // qkv, o, gate_up, down

Tensor llama_decode(const Tensor& input_ids, const Tensor& positions,
                    const Tensor& slot_mapping, const Tensor& block_tables,
                    const Tensor& seq_lens, at::TensorList weights,
                    const c10::List<std::optional<Tensor>>& biases, at::TensorList k_caches,
                    at::TensorList v_caches, const Tensor& inv_freq, double rope_scaling,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                    double scale, int64_t decode_fn,
                    at::IntArrayRef windows, at::TensorList qk_norms,
                    const std::optional<Tensor>& final_norm, const std::optional<Tensor>& lm_head,
                    const std::optional<Tensor>& temperature, double greedy_below,
                    bool helper) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 1 + kWeightsPerLayer * layers,
              "llama_decode: expected ", 1 + kWeightsPerLayer * layers, " weights, got ",
              weights.size());
  TORCH_CHECK(std::ssize(biases) == kBiasesPerLayer * layers && std::ssize(windows) == layers,
              "llama_decode: expected ", kBiasesPerLayer * layers, " biases and a window a layer");
  TORCH_CHECK(qk_norms.empty() || std::ssize(qk_norms) == 2 * layers, "llama_decode: q/k norms");
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.size(0) == block_tables.size(0),
              "llama_decode: one token per sequence");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "llama_decode: block tables and lengths must be contiguous int32");
  const auto decode = reinterpret_cast<DecodeFn>(decode_fn);
  const int64_t tokens = input_ids.size(0);
  const int64_t hidden_size = weights[0].size(1);
  const int64_t q_size = num_heads * head_dim;
  const std::vector<int64_t> norm_shape{hidden_size};

  Tensor h = at::embedding(weights[0], input_ids);
  // RotaryEmbedding.forward's cos and sin, [T, D / 2]: the module repeats them to [T, D]
  // and negates sin's first half; rope_and_write_kv reads each half twice and subtracts
  // instead (x - y is x + (-y) exactly), four op dispatches fewer. A scaling of 1 is
  // exact, so its two muls are skipped.
  Tensor freqs = positions.unsqueeze(1).to(at::kFloat).mul(inv_freq.unsqueeze(0));
  Tensor cos = freqs.cos(), sin = freqs.sin();
  if (rope_scaling != 1.0) {
    cos = cos.mul(rope_scaling);
    sin = sin.mul(rope_scaling);
  }
  cos = cos.to(h.scalar_type()).contiguous();
  sin = sin.to(h.scalar_type()).contiguous();
  const Tensor slots = slot_mapping.to(at::kLong).contiguous();

  for (int64_t l = 0; l < layers; ++l) {
    const Tensor* w = &weights[1 + kWeightsPerLayer * l];
    const int64_t b = kBiasesPerLayer * l;
    // Attention.
    Tensor x = at::rms_norm(h, norm_shape, w[0], eps);
    Tensor qkv = packed_linear(x, w[1], biases.get(b))
                     .view({tokens, num_heads + 2 * num_kv_heads, head_dim});
    if (!qk_norms.empty())  // Qwen3: RMSNorm on each q and k head before RoPE, as the module
      qkv = at::cat({at::rms_norm(qkv.narrow(1, 0, num_heads), {head_dim}, qk_norms[2 * l], eps),
                     at::rms_norm(qkv.narrow(1, num_heads, num_kv_heads), {head_dim},
                                  qk_norms[2 * l + 1], eps),
                     qkv.narrow(1, num_heads + num_kv_heads, num_kv_heads)}, 1);
    const Tensor& k_cache = k_caches[l];
    const Tensor& v_cache = v_caches[l];
    Tensor q = at::empty({tokens, num_heads, head_dim}, qkv.options());
    rope_and_write_kv(qkv, cos, sin, slots.data_ptr<int64_t>(), q, k_cache, v_cache);
    Tensor attn = at::empty_like(q);
    const int rc = attend(decode, q, k_cache, v_cache, block_tables, seq_lens, attn,
                          num_kv_heads, static_cast<float>(scale), windows[l], helper);
    TORCH_CHECK(rc == 0, "llama_decode: the decode kernel refused the shape");
    h = h.add(packed_linear(attn.view({tokens, q_size}), w[2], biases.get(b + 1)));
    // MLP.
    x = at::rms_norm(h, norm_shape, w[3], eps);
    auto gate_up = packed_linear(x, w[4], biases.get(b + 2)).chunk(2, -1);
    h = h.add(packed_linear(at::silu(gate_up[0]).mul(gate_up[1]), w[5], biases.get(b + 3)));
  }
  if (!lm_head.has_value()) return h;
  // LlamaForCausalLM.compute_logits for every row (the caller asks only when every row
  // samples): two ops here instead of three calls from Python, each a GIL hand-off.
  TORCH_CHECK(final_norm.has_value(), "llama_decode: lm_head without final_norm");
  const Tensor normed = at::rms_norm(h, norm_shape, *final_norm, eps);
  // With temperatures, the step's tokens: its sampling too under the same GIL release,
  // each block of rows drawn from while its logits are in cache.
  if (temperature.has_value())
    return head_and_sample(normed, *lm_head, *temperature, greedy_below, helper);
  return packed_linear(normed, *lm_head, std::nullopt);
}

// The temperatures of a step's rows as fp32, and its uniforms where any row draws (given,
// or from torch's default generator: one call of rows values, whichever caller).
struct Draws {
  Tensor temp, u;
  const float* t = nullptr;
  const float* us = nullptr;
  bool any_drawn = false;
};

Draws step_draws(const Tensor& temperature, const std::optional<Tensor>& uniforms,
                 int64_t rows, double greedy_below, const at::TensorOptions& options) {
  Draws d;
  d.temp = temperature.to(at::kFloat).contiguous();
  TORCH_CHECK(d.temp.dim() == 1 && d.temp.size(0) == rows, "sample_rows: one temperature a row");
  d.t = d.temp.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i) d.any_drawn |= d.t[i] >= greedy_below;
  if (d.any_drawn) {
    d.u = uniforms.has_value() ? uniforms->to(at::kFloat).contiguous() : at::rand({rows}, options);
    TORCH_CHECK(d.u.dim() == 1 && d.u.size(0) == rows, "sample_rows: one uniform a row");
    d.us = d.u.data_ptr<float>();
  }
  return d;
}

// Rows [begin, end) of a step, their logits at xs (row `begin` first): one token each.
// `weights` holds vocab floats where any row draws, `sums` a chunk sum per kChunk tokens.
void sample_block(const float* xs, int64_t begin, int64_t end, int64_t vocab, const Draws& d,
                  double greedy_below, float* weights, double* sums, int64_t* o) {
  for (int64_t i = begin; i < end; ++i) {
    const float* x = xs + (i - begin) * vocab;
    int64_t tok = -1;
    if (d.t[i] >= greedy_below)
      tok = row_draw(x, vocab, 1.0f / d.t[i], 1.0f - d.us[i], weights, sums);
    o[i] = tok >= 0 ? tok : row_argmax_fast(x, vocab);
  }
}

// Caps the draw's vector body (2 AVX-512, 1 AVX2, 0 the plain loops; cpu_sample_rows.h)
// for the whole process and returns the one now taken: the tests run each body the CPU
// has against the same reference.
int64_t cap_vector_isa(int64_t cap) {
  isa_cap.store(static_cast<int>(cap), std::memory_order_relaxed);
  return vector_isa();
}

// One token per row of fp32 logits [rows, vocab]: the argmax where temperature[row] is
// below greedy_below, else a draw from softmax(logits / temperature) with uniform
// 1 - uniforms[row] (drawn here from torch's default generator when not given). The
// sampling of a step without filters, penalties or seeds, as one op: one GIL hand-off,
// no sort, no [rows, vocab] cumsum (worker/sampling_batch.py decides when it applies).
Tensor sample_rows(const Tensor& logits, const Tensor& temperature,
                   const std::optional<Tensor>& uniforms, double greedy_below) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "sample_rows: logits must be [rows, vocab] float32");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "sample_rows: an empty vocabulary");
  const Tensor x = logits.contiguous();
  const Draws d = step_draws(temperature, uniforms, rows, greedy_below, x.options());
  Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xs = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<double> sums((vocab + kChunk - 1) / kChunk);
    std::vector<float> weights(d.any_drawn ? vocab : 0);
    sample_block(xs + begin * vocab, begin, end, vocab, d, greedy_below, weights.data(),
                 sums.data(), o);
  });
  return out;
}

// Rows a block of the LM head and the draw (head_and_sample): 32 rows of a 4,096-token
// vocabulary are 512 KiB of logits, which stay in L2 beside the head's weight (1 MiB at
// hidden 64) between the mm and the draw's two passes; 16 measured the same, and each
// mm call has a cost of its own (MKL packs the weight again).
constexpr int64_t kHeadRows = 32;

// sample_rows(x @ head, ...), a block of rows at a time (issue 28): each block's logits
// are sampled while they are in cache, instead of [rows, vocab] floats written to memory
// by one mm and read back twice by the draw. One parallel region does both; its threads
// take blocks as they come free (an atomic counter), not fixed halves, so a thread pushed
// off its core by the event loop's thread or a neighbour holds back one block, not half
// the step. A block's mm runs on the thread that took it (MKL inside a parallel region).
// An mm of some rows gives the same values as those rows of the whole mm (the sum over
// the hidden size is in the same order), so the tokens are sample_rows' on the step's
// logits, with the same uniforms (tests/test_cpu_step.py). On a team of one, `helper`
// lets the process's StepHelper take blocks too, if it gets a core in time, as it does
// the attention's (attend; worker/runner.py asks where ops/threads.py allows it).
Tensor head_and_sample(const Tensor& x, const Tensor& head, const Tensor& temperature,
                       double greedy_below, bool helper) {
  const int64_t rows = x.size(0), vocab = out_features(head);
  const Draws d = step_draws(temperature, std::nullopt, rows, greedy_below, x.options());
  Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t blocks = (rows + kHeadRows - 1) / kHeadRows;
  std::atomic<int64_t> next{0};
  const int64_t team = std::min<int64_t>(at::get_num_threads(), blocks);
  const bool own = (in_panels(head) || small_rows(rows)) && head.is_contiguous();
  const std::function<void()> take_blocks = [&] {
    std::vector<double> sums((vocab + kChunk - 1) / kChunk);
    std::vector<float> weights(d.any_drawn ? vocab : 0);
    Tensor block = at::empty({std::min(kHeadRows, rows), vocab}, x.options());
    for (int64_t i = next++; i < blocks; i = next++) {
      const int64_t b = i * kHeadRows, n = std::min(kHeadRows, rows - b);
      Tensor logits = block.narrow(0, 0, n);
      if (own) {  // (its rows do not depend on the rows beside them)
        own_linear_into(logits, x.narrow(0, b, n).contiguous(), head, std::nullopt);
      } else {
        at::mm_out(logits, x.narrow(0, b, n), head);
      }
      sample_block(logits.data_ptr<float>(), b, b + n, vocab, d, greedy_below, weights.data(),
                   sums.data(), o);
    }
  };
  if (team == 1 && helper && blocks > 1)
    StepHelper::get().share(take_blocks);  // a team of one, and a helper if it comes
  else
    at::parallel_for(0, team, 1, [&](int64_t, int64_t) { take_blocks(); });
  return out;
}

}  // namespace

TORCH_LIBRARY(actorllm, m) {
  m.def("llama_decode(Tensor input_ids, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor[] weights, Tensor?[] biases, "
        "Tensor[] k_caches, Tensor[] v_caches, Tensor inv_freq, float rope_scaling, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, "
        "int decode_fn, int[] windows, Tensor[] qk_norms, "
        "Tensor? final_norm=None, Tensor? lm_head=None, Tensor? temperature=None, "
        "float greedy_below=0.0, bool helper=False) -> Tensor");
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor? uniforms, "
        "float greedy_below) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // No tensors, so no dispatch key: defined with its one (catch-all) kernel.
  m.def("cap_vector_isa(int cap) -> int", &cap_vector_isa);
  m.def("vector_isa() -> int", [] { return static_cast<int64_t>(vector_isa()); });
  m.def("own_gemm() -> bool", [] { return own_gemm(); });
}

// One kernel for every dispatch key: the op runs dense fp32 CPU tensors only, and the
// Python side (ops/cpu_step.why_not) gives it no others.
TORCH_LIBRARY_IMPL(actorllm, CompositeExplicitAutograd, m) {
  m.impl("llama_decode", &llama_decode);
  m.impl("sample_rows", &sample_rows);
  m.impl("linear", &packed_linear);
}
