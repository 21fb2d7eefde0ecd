// Every block of an engine step in one call, with one parallel region for the whole step: the composition of
// model/transformer.py's `Block.forward` over the native ops' own per-row functions, with no Python between them.
//
// The Python modules run the very same functions (rms_norm_row, the linear kernels, rope_head, the paged write and
// attention, silu_mul_row) one op call at a time, each op its own parallel region: at the default model's size
// that per-call and per-region cost was a third of a quantized decode step. Here the threads start once per step
// and meet at a barrier between ops; each op splits its work the same way every time (rows, output columns or
// (row, head) tasks), and no output depends on the split (qgemm.h), so the result is bitwise the modules'.
// Every row attends over the paged pool up to its own position (paged_cache.py's `paged_prefill`), so the same
// call serves decode rows, prefill chunks and mixed steps. The LLaMA-family switches of ModelConfig (`Switches`
// below) are honoured in the same loop, each where `Block.forward` applies it.
#include <omp.h>

#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_telemetry.h"
#include "ops.h"
#include "simd.h"
#include "qgemm.h"

namespace ls {

// One projection as step_layers takes it: a float weight (N, K) of the activation dtype (b empty), or a quantized
// layer's two buffers (model/quantize/'s `native_buffers`), or the parts of a quantized `StackedLinear` (several
// quantized layers of one input in different formats, stacked along the output: `stacked`, each with its first
// output column; q is then unused).
struct Projection {
  bool quantized;
  QWeight q;
  const void* w;
  int64_t N, K;
  std::vector<std::pair<int64_t, QWeight>> stacked;
  bool k_acts = false;  // a Q4_K or Q6_K part: the rows are also rounded per 256 (qgemm.h's QActs)
};

static Projection projection(const View& a, const View& b, ScalarType dtype) {
  if (a.scalar_type() == kByte || a.scalar_type() == kChar) {
    const QWeight q = qweight_of(a, b);
    return Projection{true, q, nullptr, q.N, q.K, {}, k_acts(q)};
  }
  LS_CHECK(a.scalar_type() == dtype && a.dim() == 2 && a.is_contiguous(), "step_layers: float weights of the activation dtype");
  return Projection{false, QWeight{}, a.data_ptr(), a.size(0), a.size(1), {}};
}

// The (a, b) pairs w[2 i], w[2 i + 1] for i in [first, last) as one projection: quantized parts stacked when more
// than one.
static Projection projection_of(const std::vector<View>& w, size_t first, size_t last, ScalarType dtype) {
  if (last - first == 1) return projection(w[2 * first], w[2 * first + 1], dtype);
  Projection p{true, QWeight{}, nullptr, 0, 0, {}};
  for (size_t i = first; i < last; ++i) {
    const Projection part = projection(w[2 * i], w[2 * i + 1], dtype);
    LS_CHECK(part.quantized && (p.N == 0 || part.K == p.K), "step_layers: stacked parts are quantized, of one input");
    p.stacked.emplace_back(p.N, part.q);
    p.k_acts = p.k_acts || part.k_acts;
    p.N += part.N;
    p.K = part.K;
  }
  return p;
}

// The family switches of model/config.py's ModelConfig that change a block (model/transformer.py's Attention and
// Block), with each layer's own tensors for them in step_layers' `extras`: [bqkv, q_norm, k_norm], each empty where
// the model has none.
struct Switches {
  int64_t window = 0;       // sliding window (Mistral): keys at positions <= p - window are not attended; 0: none
  double scale = 0.0;       // attention scale (Granite's attention multiplier); 0: 1/sqrt(E)
  float residual = 1.f;     // Granite: each sub-block's output times this before its residual add
  bool post_norm = false;   // OLMo-2: attention_norm / ffn_norm after their sub-block, no norm before it
  int64_t qk_norm = 0;      // RMSNorm of q and k before RoPE: 1 per head (Qwen3), 2 over the whole projection (OLMo-2)
};

// Scratch for one step's activations, allocated before the parallel region.
template <typename T>
struct Step {
  int64_t N, D, H, K, E, F;
  T *h, *xn, *qkv, *att, *gu, *act, *sub;  // sub (N, D): a sub-block's output, when interventions edit it
  const T *cos, *ssin;
  float* y;  // (N, widest projection) float32 outputs before their epilogue
  QActs a;   // activations rounded for the quantized kernels (rows of the widest input)
};

// Rows [mb, me) of x (M, K) rounded for projection p into a.
template <typename T>
static void quantize_rows(const Projection& p, const T* x, int64_t mb, int64_t me, const QActs& a) {
  if (!p.quantized) return;
  for (int64_t m = mb; m < me; ++m) quantize_act(x + m * p.K, p.K, a, m, p.k_acts);
}

// This thread's share of the rows of x (M, K), rounded into the step's shared activations s.a.
template <typename T>
static void quantize_share(const Projection& p, const T* x, int64_t M, const Step<T>& s, int tid, int nt) {
  int64_t b, e;
  split_range(M, 1, tid, nt, b, e);
  quantize_rows(p, x, b, e, s.a);
}

// This thread's output columns of p (whole tiles of `tile` columns) for every row (x: its float input, or `acts` for
// a quantized p), then `epi(m, n, y)`; -> the columns [begin, end) it computed.
template <typename T, typename Epi>
static std::pair<int64_t, int64_t> project(const Projection& p, const T* x, const QActs& acts, Step<T>& s, int64_t tile,
                                           int tid, int nt, const Epi& epi) {
  int64_t b, e;
  split_range(p.N, tile, tid, nt, b, e);
  QActs a = acts;
  a.row_bytes = act_row_bytes(p.K / QK);
  a.nbp = padded_blocks(p.K / QK);
  if (!p.stacked.empty()) {
    for (const auto& [first, q] : p.stacked) {  // each part's share of [b, e), into its own columns of y
      const int64_t lo = std::max(b, first), hi = std::min(e, first + q.N);
      if (lo < hi) qgemm_range(q, a, s.N, lo - first, hi - first, s.y + first, p.N);
    }
  } else if (p.quantized)
    qgemm_range(p.q, a, s.N, b, e, s.y, p.N);
  else
    float_gemm_range<T>(x, s.N, static_cast<const T*>(p.w), p.K, b, e, s.y, p.N);
  for (int64_t m = 0; m < s.N; ++m)
    for (int64_t n = b; n < e; ++n) epi(m, n, s.y[m * p.N + n]);
  return {b, e};
}

// A step's LoRA targets (model/features/lora/adapters.py) and scratch for their products, allocated before the parallel region.
template <typename T>
struct LoRAStep {
  const std::vector<View>& rows;           // per group: the packed rows (n,) under one adapter
  const std::vector<std::vector<LoRAPart>>& parts;  // per block
  std::vector<int64_t> roff;                        // group g's rows are [roff[g], roff[g + 1]) of the gathered inputs
  T *x, *t;      // the groups' input rows (sum n, widest in); a site's A products rounded (sum over targets n r)
  float *tf, *df;  // float32 products before rounding: a site's A products, its B products (sum over targets n out)
  // block l has a target at `site` (of group `g`; -1: any)
  bool at(size_t l, int64_t site, int64_t g = -1) const {
    if (l >= parts.size()) return false;
    for (const auto& p : parts[l])
      if (std::get<1>(p) == site && (g < 0 || std::get<0>(p) == g)) return true;
    return false;
  }
};

// This thread's (row, head) attention tasks [begin, end) of R rows x H heads, contiguous, split so that every thread
// gets about the same number of keys to attend over (a task costs its row's length, plus a fixed 16 keys' worth):
// a prefill chunk's rows attend over 1 .. T keys, and an even split by count left the thread with the first rows
// waiting at the next barrier for the one with the last. Which thread runs a task never changes its result.
static void attention_share(const int64_t* lens, int64_t R, int64_t H, int64_t window, int tid, int nt, int64_t& begin,
                            int64_t& end) {
  constexpr int64_t FIXED = 16;
  const auto keys = [&](int64_t r) { return window > 0 ? std::min(lens[r], window) : lens[r]; };  // (a window's keys)
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) total += keys(r) + FIXED;
  const auto bound = [&](int t) {  // the first task whose cumulative cost (tasks before it) reaches t / nt of the total
    if (t >= nt) return R * H;
    const int64_t target = total * H * t / nt;
    int64_t acc = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t c = keys(r) + FIXED;
      if (acc + c * H > target) return r * H + std::min<int64_t>(H, (target - acc + c - 1) / c);
      acc += c * H;
    }
    return R * H;
  };
  begin = bound(tid);
  end = bound(tid + 1);
}

// hidden[l, slot[r]] = h[rows[r]] for the rows r in [rb, re) with a telemetry slot: the residual stream after
// block l. hidden (L, Rt, D) of h's dtype, contiguous. Each thread copies its own rows, so no barrier is added: h is final once the
// block's last barrier is passed, and no thread writes it again before two more barriers. Plain copies, no tensor
// ops: a pool thread is not in the caller's inference mode.
static void keep_rows(const View& h, const View& rows, const View& slot, const View& hidden,
                      int64_t l, int64_t rb, int64_t re) {
  const int64_t* s = slot.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  const size_t bytes = h.size(1) * h.element_size();
  const char* src = static_cast<const char*>(h.data_ptr());
  char* dst = static_cast<char*>(hidden.data_ptr()) + l * hidden.size(1) * bytes;  // hidden (L, Rt, D): layer l
  for (int64_t r = rb; r < std::min(re, slot.numel()); ++r)
    if (s[r] >= 0) std::memcpy(dst + s[r] * bytes, src + rw[r] * bytes, bytes);
}

// h += edit(sub) at `site`: the sub-block's output (rounded to T) edited for the rows the table names, then added.
template <typename T>
static void add_edited(Step<T>& s, const View& subt, const std::vector<View>& edits, int64_t site) {
  apply_site(subt, edits, site);
  read_site(subt, edits, site);
  for (int64_t i = 0; i < s.N * s.D; ++i) s.h[i] = from_f<T>(to_f(s.h[i]) + to_f(s.sub[i]));
}

// Steps of at most this many rows (decode of one or a few streams) run each block with 5 barriers instead of 10:
// every thread computes the whole of each small row-wise op (the norms, the activation rounding, SiLU-mul) into its
// own buffers instead of its share of the rows followed by a barrier, and ropes and stores the heads of its own q/k/v
// columns. At one row a thread's share of a row-wise op is the whole row or nothing, so the split left one thread
// idle at each of those barriers. The same functions compute the same values, whichever thread runs them.
constexpr int64_t FEW_ROWS = 4;

// A thread's own copies of the few-row path's row-wise results.
template <typename T>
struct Own {
  T *xn, *act;  // (N, D), (N, F)
  QActs a;      // the rows rounded for the next projection
};

template <typename T>
static void run_layers(Step<T>& s, const std::vector<std::vector<View>>& layers,
                       const std::vector<std::vector<Projection>>& proj, double eps, std::vector<View>& k_pools,
                       std::vector<View>& v_pools, const int64_t* slots, const View& q,
                       const View& att, const View& rows, const View& tables, const View& lens,
                       const View& ht, const View& subt, const View& xnt, const std::vector<View>& edits,
                       const std::vector<View>& telemetry, const std::vector<Telemetry>& tel,
                       const std::vector<Own<T>>& own, const std::vector<std::vector<View>>& extras,
                       const Switches& sw, const LoRAStep<T>& lora) {
  // Interventions (interventions.cpp) and telemetry run on one thread between barriers (`omp single`, whose own
  // barrier ends it): they touch a few rows. At a site the table edits or reads (`touched`), a sub-block's output is
  // rounded to T into `sub`, edited, then added: the module path's h + edit(a), bit for bit; at every other site the
  // add is fused into the projection, which is the same sum (the output rounded to T, then added): a step that steers
  // or reads at one site of one block pays for that site alone, and keeps the few-row path. A post-norm (OLMo-2)
  // needs the whole row of the sub-block's output first: it goes through `sub` at every site.
  const bool edited = !edits.empty();
  std::vector<char> touched(edited ? layers.size() * SITES_PER_BLOCK : 0);
  for (size_t k = 0; k < touched.size(); ++k) touched[k] = site_touched(edits, static_cast<int64_t>(k));
  const auto at = [&](int64_t k) { return edited && touched[k] != 0; };
  const bool scaled = sw.residual != 1.f;
  const float mult = sw.residual;
  // a sub-block's output y (float32, before rounding) as its residual add takes it: rounded to T, then (scaled)
  // times Granite's multiplier and rounded again (the module path's `a * residual_multiplier`); each epilogue is
  // chosen once per call below, so LLaMA's step runs the plain one with no test per element
  const auto plain_out = [](float y) { return round_to<T>(y); };
  const auto scaled_out = [mult](float y) { return round_to<T>(round_to<T>(y) * mult); };
  const int64_t N = s.N, D = s.D, H = s.H, K = s.K, E = s.E, F = s.F, QKV = (H + 2 * K) * E, R = rows.numel();
  const bool few = !own.empty();  // the few-row path (FEW_ROWS): never with edits or reads of the MLP's input
  const float feps = static_cast<float>(eps);
#pragma omp parallel num_threads(num_threads())  // (never more threads than `own` holds)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t rb, re;  // this thread's rows
    split_range(N, 1, tid, nt, rb, re);
    int64_t tb, te;  // this thread's attention tasks
    attention_share(lens.data_ptr<int64_t>(), R, H, sw.window, tid, nt, tb, te);
    const int64_t ob = few ? 0 : rb, oe = few ? N : re;  // the rows this thread runs the row-wise ops for
    const Own<T>* mine = few ? &own[tid] : nullptr;
    T* xn = few ? mine->xn : s.xn;         // the normed rows the next projection reads
    T* act = few ? mine->act : s.act;      // SiLU-mul's rows
    const QActs& acts = few ? mine->a : s.a;
    // h (N, D) normed by w (no norm before the sub-block under post_norm: h itself), then rounded for p: by every
    // thread into its own buffers, or by each for its rows; -> the rows the projection reads
    const auto norm_for = [&](const Projection& p, const View& w) -> const T* {
      const T* x = s.h;
      if (!sw.post_norm) {
        for (int64_t m = ob; m < oe; ++m) rms_norm_row(s.h + m * D, w.data_ptr<T>(), xn + m * D, D, feps);
        x = xn;
      }
      if (few) {
        quantize_rows(p, x, 0, N, acts);
      } else {
        quantize_share(p, x, N, s, tid, nt);
#pragma omp barrier
      }
      return x;
    };
    // norm_for with edits (never the few-row path): every row normed into xn (under post_norm: h copied, so an edit
    // of the MLP's input leaves the stream), the rows' edits and reads at `site` (mlp_input) by one thread, then
    // rounded for p
    const auto norm_edited = [&](const Projection& p, const View& w, int64_t site) -> const T* {
      for (int64_t m = rb; m < re; ++m) {
        if (sw.post_norm)
          std::memcpy(s.xn + m * D, s.h + m * D, D * sizeof(T));
        else
          rms_norm_row(s.h + m * D, w.data_ptr<T>(), s.xn + m * D, D, feps);
      }
#pragma omp barrier
#pragma omp single
      {
        apply_site(xnt, edits, site);
        read_site(xnt, edits, site);
      }
      quantize_share(p, s.xn, N, s, tid, nt);
#pragma omp barrier
      return s.xn;
    };
    // this thread's rows of `sub` (a sub-block's output, rounded to T; already scaled unless post-normed) ->
    // post-normed by w and scaled, as the residual add takes them; then added to h (its rows), or edited and added
    // by one thread (add_edited)
    const auto finish_sub = [&](const View& w, int64_t site) {
#pragma omp barrier
      for (int64_t m = rb; m < re; ++m) {
        T* row = s.sub + m * D;
        if (sw.post_norm) {
          rms_norm_row(row, w.data_ptr<T>(), row, D, feps);
          if (scaled)
            for (int64_t n = 0; n < D; ++n) row[n] = from_f<T>(to_f(row[n]) * sw.residual);
        }
        if (!at(site))
          for (int64_t n = 0; n < D; ++n) s.h[m * D + n] = from_f<T>(to_f(s.h[m * D + n]) + to_f(row[n]));
      }
#pragma omp barrier
      if (at(site)) {
#pragma omp single
        add_edited(s, subt, edits, site);
      }
    };
    // a sub-block's last projection p of x and its residual add: fused into the projection's epilogue (h += its
    // output, rounded and scaled), or through `sub` (finish_sub: edits, post-norms by `norm`) at `site`
    const auto project_out = [&](const Projection& p, const T* x, bool through_sub, int64_t site, const View& norm) {
      const auto run = [&](const auto& out) {
        if (through_sub) {
          project(p, x, acts, s, 16, tid, nt, [&](int64_t m, int64_t n, float y) {
            s.sub[m * D + n] = from_f<T>(sw.post_norm ? y : out(y));  // (a post-norm scales after the norm)
          });
          finish_sub(norm, site);
        } else {
          project(p, x, acts, s, 16, tid, nt, [&](int64_t m, int64_t n, float y) {
            s.h[m * D + n] = from_f<T>(to_f(s.h[m * D + n]) + out(y));
          });
#pragma omp barrier
        }
      };
      if (scaled)
        run(scaled_out);
      else
        run(plain_out);
    };
    const auto round_for = [&](const Projection& p, const T* x) {  // x (N, p.K) complete: rounded for p
      if (few) {
        quantize_rows(p, x, 0, N, acts);
      } else {
        quantize_share(p, x, N, s, tid, nt);
        if (p.quantized) {
#pragma omp barrier
        }
      }
    };
    // LoRA (model/features/lora/adapters.py's LoRARows.apply, op for op): each of block l's targets at `site` adds scale * B (A x) to
    // its group's rows of `out` (ld wide, from its column `start`), x (N, in) the projection's input. A's product
    // goes through float_gemm_range as `ops.linear` does, B's through lora_expand_range as `ops.lora_expand` does
    // (each rounded to T), the delta is rounded times the scale, then added to the output as T: the module path's
    // `y[rows, start:stop] += delta`, bit for bit. Called by every thread, three barriers a site whatever the number
    // of targets: the groups' rows gathered, every target's A products, every target's B products added (tasks of a
    // few columns of one target, dealt round the threads).
    const auto apply_lora = [&](size_t l, int64_t site, const T* x, int64_t in, T* out, int64_t ld) {
      const auto& parts = lora.parts[l];
      int64_t b, e;
      split_range(lora.roff.back(), 1, tid, nt, b, e);
      for (size_t g = 0; g + 1 < lora.roff.size(); ++g) {
        if (!lora.at(l, site, static_cast<int64_t>(g))) continue;
        const int64_t r0 = lora.roff[g], r1 = lora.roff[g + 1];
        const int64_t* rws = lora.rows[g].template data_ptr<int64_t>();
        for (int64_t i = std::max(b, r0); i < std::min(e, r1); ++i)
          std::memcpy(lora.x + i * in, x + rws[i - r0] * in, in * sizeof(T));
      }
#pragma omp barrier
      int64_t task = 0, toff = 0;
      for (const auto& [g, part_site, start, stop, scale, A, B] : parts) {
        if (part_site != site) continue;
        const int64_t n = lora.roff[g + 1] - lora.roff[g], r = A.size(0);
        for (int64_t c = 0; c < r; c += 16, ++task) {
          if (task % nt != tid) continue;
          const int64_t c1 = std::min(r, c + 16);
          float_gemm_range<T>(lora.x + lora.roff[g] * in, n, A.template data_ptr<T>(), in, c, c1, lora.tf + toff, r);
          for (int64_t i = 0; i < n; ++i)
            for (int64_t j = c; j < c1; ++j) lora.t[toff + i * r + j] = from_f<T>(lora.tf[toff + i * r + j]);
        }
        toff += n * r;
      }
#pragma omp barrier
      task = toff = 0;
      int64_t doff = 0;
      for (const auto& [g, part_site, start, stop, scale, A, B] : parts) {
        if (part_site != site) continue;
        const int64_t n = lora.roff[g + 1] - lora.roff[g], r = A.size(0), width = stop - start;
        const int64_t* rws = lora.rows[g].template data_ptr<int64_t>();
        const float sc = static_cast<float>(scale);
        for (int64_t c = 0; c < width; c += 64, ++task) {
          if (task % nt != tid) continue;
          const int64_t c1 = std::min(width, c + 64);
          lora_expand_range<T>(lora.t + toff, n, B.template data_ptr<T>(), r, width, c, c1, lora.df + doff, width);
          for (int64_t i = 0; i < n; ++i)
            for (int64_t j = c; j < c1; ++j) {
              T* o = out + rws[i] * ld + start + j;
              *o = from_f<T>(to_f(*o) + round_to<T>(round_to<T>(lora.df[doff + i * width + j]) * sc));
            }
        }
        toff += n * r;
        doff += n * width;
      }
#pragma omp barrier
    };
    // project_out for a site with LoRA targets (`apply_lora`): the projection rounded into `sub`, the adapters' deltas
    // added, Granite's multiplier (unless post-normed, which scales after its norm), then finish_sub: the module
    // path's h + edit(scale(adapt(p(x)))) in its order
    const auto project_out_adapted = [&](const Projection& p, const T* x, int64_t site, const View& norm,
                                         size_t l, int64_t lsite) {
      project(p, x, acts, s, 16, tid, nt, [&](int64_t m, int64_t n, float y) { s.sub[m * D + n] = from_f<T>(y); });
#pragma omp barrier
      apply_lora(l, lsite, x, p.K, s.sub, D);
      if (scaled && !sw.post_norm)
        for (int64_t m = rb; m < re; ++m)
          for (int64_t n = 0; n < D; ++n) s.sub[m * D + n] = from_f<T>(to_f(s.sub[m * D + n]) * mult);
      finish_sub(norm, site);
    };
    for (size_t l = 0; l < layers.size(); ++l) {
      const auto& w = layers[l];
      const Projection &wqkv = proj[l][0], &wo = proj[l][1], &w13 = proj[l][2], &w2 = proj[l][3];
      const T* bqkv = extras.empty() || extras[l][0].numel() == 0 ? nullptr : extras[l][0].data_ptr<T>();
      const T* qn = sw.qk_norm ? extras[l][1].data_ptr<T>() : nullptr;
      const T* kn = sw.qk_norm ? extras[l][2].data_ptr<T>() : nullptr;
      char* kp = static_cast<char*>(k_pools[l].data_ptr());
      char* vp = static_cast<char*>(v_pools[l].data_ptr());
      const ScalarType pool_t = k_pools[l].scalar_type();  // T's, or a 16-bit or int8 cache under float32
      const int64_t bs = k_pools[l].size(1);
      // rope the heads [h0, h1) of every row (q and k heads; v heads pass) and store its k and v heads in the pools
      const auto rope_store = [&](int64_t m, int64_t h0, int64_t h1) {
        T* row = s.qkv + m * QKV;
        if (sw.qk_norm == 2) {  // over the whole projection (only ever called for whole rows: no few-row path)
          rms_norm_row(row, qn, row, H * E, feps);
          rms_norm_row(row + H * E, kn, row + H * E, K * E, feps);
        }
        for (int64_t head = h0; head < std::min(h1, H + K); ++head) {
          if (sw.qk_norm == 1) rms_norm_row(row + head * E, head < H ? qn : kn, row + head * E, E, feps);
          rope_head(row + head * E, s.cos + m * E, s.ssin + m * E, E);
        }
        for (int64_t head = std::max(h0, H); head < h1; ++head) {  // paged_write
          const KVSlot to = head < H + K ? kv_slot(kp, pool_t, bs, K, E, slots[m], head - H)
                                         : kv_slot(vp, pool_t, bs, K, E, slots[m], head - H - K);
          store_kv_row(to, pool_t, row + head * E, E);
        }
      };
      // attention: h + wo(attend(rope(wqkv(norm(h)))))
      const T* x = norm_for(wqkv, w[0]);
      const bool qkv_lora = lora.at(l, 0);
      const auto cols = bqkv == nullptr || qkv_lora
          ? project(wqkv, x, acts, s, few ? E : 16, tid, nt,
                    [&](int64_t m, int64_t n, float y) { s.qkv[m * QKV + n] = from_f<T>(y); })
          // Qwen2's bias: added to the projection's output as the module path adds it (rounded to T first)
          : project(wqkv, x, acts, s, few ? E : 16, tid, nt, [&](int64_t m, int64_t n, float y) {
              s.qkv[m * QKV + n] = from_f<T>(round_to<T>(y) + to_f(bqkv[n]));
            });
      if (few) {  // this thread's columns are whole heads
        for (int64_t m = 0; m < N; ++m) rope_store(m, cols.first / E, cols.second / E);
      } else {
#pragma omp barrier
        if (qkv_lora) {  // the adapters' deltas on the rounded projection, then the bias (the module path's order)
          apply_lora(l, 0, x, D, s.qkv, QKV);
          if (bqkv != nullptr)
            for (int64_t m = rb; m < re; ++m)
              for (int64_t n = 0; n < QKV; ++n) s.qkv[m * QKV + n] = from_f<T>(to_f(s.qkv[m * QKV + n]) + to_f(bqkv[n]));
        }
        for (int64_t m = rb; m < re; ++m) rope_store(m, 0, H + 2 * K);
      }
#pragma omp barrier
      paged_attention_range(q, k_pools[l], v_pools[l], rows, tables, lens, att, tb, te, tel.empty() ? nullptr : &tel[l],
                            sw.window, sw.scale);
#pragma omp barrier
      round_for(wo, s.att);
      const int64_t k = SITES_PER_BLOCK * static_cast<int64_t>(l);  // the block's first site in the tables
      if (lora.at(l, 1))
        project_out_adapted(wo, s.att, k + ATTENTION_OUTPUT, w[0], l, 1);
      else
        project_out(wo, s.att, sw.post_norm || at(k + ATTENTION_OUTPUT), k + ATTENTION_OUTPUT, w[0]);
      if (at(k + RESID_MID) || at(k + MLP_NORMALIZED)) {  // h is resid_mid now; its reads normed without the gain are mlp_normalized's
#pragma omp single
        {
          apply_site(ht, edits, k + RESID_MID);
          read_site(ht, edits, k + RESID_MID);
          read_normalized(ht, edits, k + MLP_NORMALIZED, eps);
        }
      }
      // feed-forward: h + w2(silu(w1 x) * w3 x), x = norm(h)
      const T* xf = at(k + MLP_INPUT) ? norm_edited(w13, w[1], k + MLP_INPUT) : norm_for(w13, w[1]);
      project(w13, xf, acts, s, 16, tid, nt, [&](int64_t m, int64_t n, float y) { s.gu[m * 2 * F + n] = from_f<T>(y); });
#pragma omp barrier
      if (lora.at(l, 2)) apply_lora(l, 2, xf, D, s.gu, 2 * F);
      for (int64_t m = ob; m < oe; ++m) silu_mul_row(s.gu + m * 2 * F, act + m * F, F);
      round_for(w2, act);
      if (!few && !w2.quantized) {
#pragma omp barrier
      }
      if (lora.at(l, 3))
        project_out_adapted(w2, act, k + MLP_OUTPUT, w[1], l, 3);
      else
        project_out(w2, act, sw.post_norm || at(k + MLP_OUTPUT), k + MLP_OUTPUT, w[1]);
      if (at(k + BLOCK_OUTPUT)) {
#pragma omp single
        {
          apply_site(ht, edits, k + BLOCK_OUTPUT);
          read_site(ht, edits, k + BLOCK_OUTPUT);
        }
      }
      if (!telemetry.empty()) keep_rows(ht, rows, telemetry[0], telemetry[5], static_cast<int64_t>(l), rb, re);
    }
  }
}

// h (N, D) the residual stream of the step's N rows; layers: per block [attention_norm, ffn_norm, wqkv a, b, wo a,
// b, w13 a, b, w2 a, b]; cos, ssin (N, E) `rotary_tables`; k_pools, v_pools (L, NB, bs, K, E) (E + 4 for an int8
// cache: ops.h kv_slot); the step's slots
// (N,); rows (N,) = 0..N-1, tables (N, W), lens (N,): every row attends over its block table up to its position
// (`PagedKVCache.set_step` with paged_prefill); extras: per block [bqkv, q_norm, k_norm] (each empty where the model
// has none; the list empty: none at all); window, scale, residual, post_norm, qk_norm: the `Switches`; edits: the
// step's interventions table (empty: none;
// interventions.cpp), applied at the block's sites (ops.h's `Site`) as `Block.forward` hands them to its attention context;
// telemetry: empty (off), or model/features/telemetry/record.py's [slot (N,), sink_len (Rt,), sink_mass (L, Rt, H),
// top_pos (L, Rt, H, k), top_prob (L, Rt, H, k), hidden (L, Rt, D)]: the attention telemetry of the rows with
// slot >= 0, and their residual stream after each block; lora_rows, lora: the rows under LoRA adapters and each
// block's targets (`LoRAPart`, model/features/lora/adapters.py's LoRARows.native_args; empty: none).  -> h after every block (N, D)
void step_layers(const View& h, const std::vector<std::vector<View>>& layers, double eps, const View& cos,
                 const View& ssin, const View& k_pools, const View& v_pools, const View& slots, const View& rows,
                 const View& tables, const View& lens, int64_t H, int64_t K, int64_t E, const std::vector<View>& edits,
                 const std::vector<View>& telemetry, const std::vector<std::vector<View>>& extras, int64_t window,
                 double scale, double residual, bool post_norm, int64_t qk_norm, const std::vector<View>& lora_rows,
                 const std::vector<std::vector<LoRAPart>>& lora, const Alloc& alloc) {
  LS_CHECK(telemetry.empty() || telemetry.size() == 6, "step_layers: telemetry is empty or 6 tensors");
  LS_CHECK(window >= 0 && qk_norm >= 0 && qk_norm <= 2, "step_layers: window >= 0, qk_norm 0, 1 or 2");
  const Switches sw{window, scale, static_cast<float>(residual), post_norm, qk_norm};
  LS_CHECK(h.dim() == 2 && k_pools.size(0) == static_cast<int64_t>(layers.size()), "step_layers: shapes");
  const int64_t N = h.size(0), D = h.size(1), L = layers.size();
  const auto dtype = h.scalar_type();
  LS_CHECK(dtype == kFloat || dtype == kBFloat16, "step_layers: float32 or bfloat16");
  const auto pool_t = k_pools.scalar_type();
  const bool narrow = dtype == kFloat && (pool_t == kHalf || pool_t == kBFloat16 || pool_t == kChar);
  LS_CHECK((pool_t == dtype || narrow) && v_pools.scalar_type() == pool_t && k_pools.is_contiguous() && v_pools.is_contiguous(), "step_layers: pools of the activation dtype, or 16-bit or int8 under float32");
  LS_CHECK(cos.scalar_type() == dtype && ssin.scalar_type() == dtype && cos.is_contiguous() && ssin.is_contiguous() && cos.numel() == N * E && ssin.numel() == N * E, "step_layers: rope tables");
  LS_CHECK(slots.scalar_type() == kLong && slots.is_contiguous() && slots.numel() == N, "step_layers: slots");
  LS_CHECK(rows.numel() == N && rows.scalar_type() == kLong && lens.scalar_type() == kLong && tables.scalar_type() == kLong && tables.is_contiguous() && tables.size(0) == N, "step_layers: every row attends over its table");
  LS_CHECK(E <= 1024 && H % K == 0 && k_pools.size(3) == K && k_pools.size(4) == kv_row_width(pool_t, E), "step_layers: heads");
  const int64_t n_slots = k_pools.size(1) * k_pools.size(2);
  for (int64_t n = 0; n < N; ++n) LS_CHECK(slots.data_ptr<int64_t>()[n] >= 0 && slots.data_ptr<int64_t>()[n] < n_slots, "step_layers: slot out of range");
  std::vector<std::vector<Projection>> proj(L);
  int64_t F = 0, widest_out = 0, widest_in = 0;
  bool any_k = false;  // a Q4_K or Q6_K projection somewhere: the rows' q8_K rounding too
  LS_CHECK(extras.empty() ? qk_norm == 0 : static_cast<int64_t>(extras.size()) == L, "step_layers: extras per block");
  for (int64_t l = 0; l < static_cast<int64_t>(extras.size()); ++l) {
    const auto& x = extras[l];
    LS_CHECK(x.size() == 3, "step_layers: extras [bqkv, q_norm, k_norm] per block");
    LS_CHECK(x[0].numel() == 0 || (x[0].scalar_type() == dtype && x[0].is_contiguous() && x[0].numel() == (H + 2 * K) * E), "step_layers: bqkv ((H + 2K) E,)");
    const int64_t qw = qk_norm == 1 ? E : H * E, kw = qk_norm == 1 ? E : K * E;
    LS_CHECK(qk_norm == 0 || (x[1].scalar_type() == dtype && x[2].scalar_type() == dtype && x[1].is_contiguous() && x[2].is_contiguous() && x[1].numel() == qw && x[2].numel() == kw), "step_layers: q/k norm weights");
  }
  for (int64_t l = 0; l < L; ++l) {
    const auto& w = layers[l];
    LS_CHECK(w.size() >= 10 && w.size() % 2 == 0, "step_layers: 10 tensors per block, or more with stacked parts");
    LS_CHECK(w[0].scalar_type() == dtype && w[1].scalar_type() == dtype && w[0].numel() == D && w[1].numel() == D, "step_layers: norms");
    // pairs 1 .. P - 1 after the norms' pair 0: wqkv's parts up to its (H + 2K) E rows, wo, w13's parts, w2 (last)
    const size_t P = w.size() / 2;
    size_t qkv_end = 1;
    for (int64_t rows = 0; rows < (H + 2 * K) * E && qkv_end + 3 <= P - 1; ++qkv_end) rows += projection(w[2 * qkv_end], w[2 * qkv_end + 1], dtype).N;
    proj[l].push_back(projection_of(w, 1, qkv_end, dtype));
    proj[l].push_back(projection_of(w, qkv_end, qkv_end + 1, dtype));
    proj[l].push_back(projection_of(w, qkv_end + 1, P - 1, dtype));
    proj[l].push_back(projection_of(w, P - 1, P, dtype));
    const auto& p = proj[l];
    F = p[2].N / 2;
    LS_CHECK(p[0].K == D && p[0].N == (H + 2 * K) * E && p[1].K == H * E && p[1].N == D && p[2].K == D && p[3].K == F && p[3].N == D, "step_layers: projection shapes");
    for (const auto& q : p) {
      widest_out = std::max(widest_out, q.N);
      widest_in = std::max(widest_in, q.K);
      any_k = any_k || q.k_acts;
      LS_CHECK(!q.quantized || q.K % QK == 0, "step_layers: quantized inputs in blocks of 32");
    }
  }
  // LoRA targets: per block, each in its site's columns, A (r, in) and B transposed (r, stop - start) of the
  // activation dtype
  LS_CHECK(lora.empty() || static_cast<int64_t>(lora.size()) == L, "step_layers: lora per block");
  std::vector<int64_t> roff{0};
  for (const auto& rws : lora_rows) {
    LS_CHECK(rws.scalar_type() == kLong && rws.is_contiguous(), "step_layers: lora rows int64");
    for (int64_t i = 0; i < rws.numel(); ++i) LS_CHECK(rws.data_ptr<int64_t>()[i] >= 0 && rws.data_ptr<int64_t>()[i] < N, "step_layers: lora row out of range");
    roff.push_back(roff.back() + rws.numel());
  }
  LS_CHECK(roff.back() <= N, "step_layers: a row under two adapters");
  bool any_lora = false;
  int64_t lora_t = 0, lora_d = 0;  // the most a site's targets need of the A and B products' scratch
  for (int64_t l = 0; l < static_cast<int64_t>(lora.size()); ++l)
    for (int64_t site = 0; site < 4; ++site) {
      int64_t t = 0, d = 0;
      for (const auto& [g, part_site, start, stop, sc, A, B] : lora[l]) {
        LS_CHECK(g >= 0 && g < static_cast<int64_t>(lora_rows.size()) && part_site >= 0 && part_site < 4, "step_layers: lora group, site");
        if (part_site != site) continue;
        const Projection& p = proj[l][site];
        LS_CHECK(A.dim() == 2 && B.dim() == 2 && A.scalar_type() == dtype && B.scalar_type() == dtype && A.is_contiguous() && B.is_contiguous() &&
                    A.size(1) == p.K && B.size(0) == A.size(0) && 0 <= start && start < stop && stop <= p.N && B.size(1) == stop - start,
                    "step_layers: lora A (r, in), B transposed (r, stop - start) within the site's output");
        const int64_t n = roff[g + 1] - roff[g];
        t += n * A.size(0);
        d += n * (stop - start);
        any_lora = true;
      }
      lora_t = std::max(lora_t, t);
      lora_d = std::max(lora_d, d);
    }
  LS_CHECK(h.is_contiguous(), "step_layers: h contiguous");  // (a copy: the caller's tensor stays as it was)
  const View xn = alloc(dtype, {N, D}), qkv = alloc(dtype, {N, H + 2 * K, E}), att = alloc(dtype, {N, H, E});
  const View gu = alloc(dtype, {N, 2 * F}), act = alloc(dtype, {N, F});
  View sub = alloc(dtype, {edits.empty() && !post_norm && !any_lora ? 0 : N, D});
  const View lora_x = alloc(dtype, {any_lora ? roff.back() * widest_in + lora_t : 0});
  const View lora_f = alloc(kFloat, {any_lora ? lora_t + lora_d : 0});
  LS_CHECK(telemetry.empty() || (telemetry[5].scalar_type() == dtype && telemetry[5].is_contiguous()), "step_layers: telemetry hidden");
  std::vector<Telemetry> tel;  // per layer, where the asking rows' attention goes (attention_telemetry.h)
  if (!telemetry.empty()) {
    const int64_t Rt = telemetry[1].numel();
    LS_CHECK(telemetry[2].dim() == 3 && telemetry[2].size(0) == L && telemetry[3].dim() == 4 && telemetry[3].size(0) == L &&
                telemetry[4].sizes() == telemetry[3].sizes() && telemetry[5].dim() == 3 && telemetry[5].size(0) == L &&
                telemetry[5].size(1) == Rt && telemetry[5].size(2) == D, "step_layers: telemetry buffers (L, ...)");
    View sink = telemetry[2][0], pos = telemetry[3][0], prob = telemetry[4][0];
    const Telemetry first = Telemetry::of(telemetry[0], telemetry[1], sink, pos, prob, H, N);  // checks layer 0's view
    for (int64_t l = 0; l < L; ++l) tel.push_back(first.layer(l, Rt));
  }
  const View y = alloc(kFloat, {N, widest_out});
  ActBuffers shared(N, widest_in, any_k);
  std::vector<View> kp, vp;
  for (int64_t l = 0; l < L; ++l) kp.push_back(k_pools[l]), vp.push_back(v_pools[l]);
  const auto q = qkv.narrow(1, 0, H);
  const int64_t* sl = slots.data_ptr<int64_t>();
  // the few-row path's per-thread buffers (FEW_ROWS): xn (D), act (F), rounded activations, per row and thread
  // (post-norms and a q/k norm over the whole projection need whole rows between barriers: the many-row path)
  bool mlp_input = false;  // an edit or read of the MLP's normed input: xn is shared then (norm_edited)
  for (int64_t l = 0; l < L && !edits.empty(); ++l) mlp_input = mlp_input || site_touched(edits, SITES_PER_BLOCK * l + MLP_INPUT);
  const bool few = !mlp_input && !any_lora && N <= FEW_ROWS && E % 8 == 0 && !post_norm && qk_norm != 2;
  const int64_t threads = few ? num_threads() : 0;
  const View own_t = alloc(dtype, {threads, N, D + F});
  std::vector<ActBuffers> own_acts(threads, ActBuffers(N, widest_in, any_k));
  const auto owns = [&](auto* base) {
    using T = std::remove_pointer_t<decltype(base)>;
    std::vector<Own<T>> out;
    for (int64_t t = 0; t < threads; ++t)
      out.push_back(Own<T>{base + t * N * (D + F), base + t * N * (D + F) + N * D,
                           own_acts[t].view(widest_in)});
    return out;
  };
  if (dtype == kFloat) {
    Step<float> s{N, D, H, K, E, F, h.data_ptr<float>(), xn.data_ptr<float>(), qkv.data_ptr<float>(), att.data_ptr<float>(),
                  gu.data_ptr<float>(), act.data_ptr<float>(), sub.data_ptr<float>(), cos.data_ptr<float>(), ssin.data_ptr<float>(), y.data_ptr<float>(),
                  shared.view(widest_in)};
    float* lx = lora_x.data_ptr<float>();
    float* lf = lora_f.data_ptr<float>();
    const LoRAStep<float> ls{lora_rows, lora, roff, lx, lx + roff.back() * widest_in, lf, lf + lora_t};
    run_layers(s, layers, proj, eps, kp, vp, sl, q, att, rows, tables, lens, h, sub, xn, edits, telemetry, tel, owns(own_t.data_ptr<float>()),
               extras, sw, ls);
  } else {
    Step<bf16> s{N, D, H, K, E, F, h.data_ptr<bf16>(), xn.data_ptr<bf16>(), qkv.data_ptr<bf16>(), att.data_ptr<bf16>(),
                 gu.data_ptr<bf16>(), act.data_ptr<bf16>(), sub.data_ptr<bf16>(), cos.data_ptr<bf16>(), ssin.data_ptr<bf16>(), y.data_ptr<float>(),
                 shared.view(widest_in)};
    bf16* lx = lora_x.data_ptr<bf16>();
    float* lf = lora_f.data_ptr<float>();
    const LoRAStep<bf16> ls{lora_rows, lora, roff, lx, lx + roff.back() * widest_in, lf, lf + lora_t};
    run_layers(s, layers, proj, eps, kp, vp, sl, q, att, rows, tables, lens, h, sub, xn, edits, telemetry, tel, owns(own_t.data_ptr<bf16>()),
               extras, sw, ls);
  }
}

}  // namespace ls
