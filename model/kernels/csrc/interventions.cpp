// Interventions on the residual stream (model/interventions.py, model/edits.py): each op row gets its entry,
// x -= (x . u) u (the dot product in float64), then x = x * keep + put, in float32 and rounded once to the
// activation dtype, exactly as model/edits.py's `apply_reference` defines it. Rows no op names are not touched.
//
// The table (one forward's, `StepEdits`): ops (Q, 4) int64 [row, u, keep, put] (rows of bank (V, D) float32,
// -1: absent). step_layers (step_layers.cpp) calls `apply_site` and then `read_site` at a block's sites
// (k = SITES_PER_BLOCK layer + site, ops.h's `Site`), with the whole table as its trailing argument
// [site_ptr, ops, bank, read_ptr (S L + 1), read_rows, read_out, clamp_ptr (S L + 1), clamp_ops, clamp_params,
// W_enc^T 0, b_enc 0, W_enc^T 1, ...]: the rest are the site's feature clamps, applied after its entries
// (`apply_clamps`), and the encoders of the TopK and GroupMax dictionaries among them. mlp_normalized has no
// entries: `read_normalized` reads it from resid_mid.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace ls {

// One pass per op row, serially: a site's work is a few rows of D values, far less than a parallel region costs to
// open (and decode opens three sites per block).
template <typename T>
static void apply_impl(T* x, int64_t D, const int64_t* ops, int64_t Q, const float* bank) {
  for (int64_t q = 0; q < Q; ++q) {
    const int64_t* op = ops + 4 * q;
    T* row = x + op[0] * D;
    const float* uv = op[1] >= 0 ? bank + op[1] * D : nullptr;
    const float* kv = op[2] >= 0 ? bank + op[2] * D : nullptr;
    const float* pv = op[3] >= 0 ? bank + op[3] * D : nullptr;
    double dot = 0.0;
    if (uv)
      for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(to_f(row[d])) * static_cast<double>(uv[d]);
    for (int64_t d = 0; d < D; ++d) {  // float32 throughout, rounded to the row's dtype once
      float y = to_f(row[d]);
      if (uv) y = static_cast<float>(static_cast<double>(y) - dot * static_cast<double>(uv[d]));
      if (kv) y = y * kv[d];
      if (pv) y = y + pv[d];
      row[d] = from_f<T>(y);
    }
  }
}

// Feature clamps (model/features/sae/steer.py): x += (v - f_F(x)) s(x) d_F, after the site's entries. clamp_ops
// (Qc, 4) int64 [row, w_F, d_F, b_dec (-1: not applied to the input)], bank rows; params (Qc, 7) float64
// [activation (0 relu, 1 jumprelu, 2 gated, 3 topk, 4 groupmax), b_enc_F, threshold_F or b_mag_F or k, exp(r_mag_F)
// or the encoder's index, v, normalization (0 none, 1 constant_norm_rescale, 2 layer_norm), F]. The value
// f_F is computed in float64, rounded once to the row's dtype, as FeatureClamp.apply. TopK and GroupMax decide F's
// value against the other features: whether F is selected is read from the row's encode in float32 (the encoders
// W_enc^T (F, D) and b_enc (F,) float32 of `enc`, each feature's dot summed over D in order), its value from the
// float64 dot. The features are counted until F is known to be out (k of them above it), which for the usual clamp
// (F not among the row's own top k) is a small share of the encode.
template <typename T>
static void clamp_impl(T* x, int64_t D, const int64_t* ops, int64_t Q, const double* params, const float* bank,
                       const std::vector<View>& enc) {
  std::vector<double> xn(D);
  std::vector<float> xf(D);
  for (int64_t q = 0; q < Q; ++q) {
    const int64_t* op = ops + 4 * q;
    const double* p = params + 7 * q;
    T* row = x + op[0] * D;
    const float* w = bank + op[1] * D;
    const float* dF = bank + op[2] * D;
    const float* bd = op[3] >= 0 ? bank + op[3] * D : nullptr;
    const int kind = static_cast<int>(p[0]), norm = static_cast<int>(p[5]);
    double mu = 0.0, c = 1.0, s = 1.0;  // normalize(x) = (x - mu) c; the output rescaling s
    if (norm == 1) {
      double ss = 0.0;
      for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(to_f(row[d])) * static_cast<double>(to_f(row[d]));
      c = std::sqrt(static_cast<double>(D)) / std::sqrt(ss);
      s = 1.0 / c;
    } else if (norm == 2) {
      for (int64_t d = 0; d < D; ++d) mu += static_cast<double>(to_f(row[d]));
      mu /= static_cast<double>(D);
      double var = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        const double e = static_cast<double>(to_f(row[d])) - mu;
        var += e * e;
      }
      const double sd = std::sqrt(var / static_cast<double>(D - 1));  // unbiased, as torch.std
      c = 1.0 / (sd + 1e-5);
      s = sd;
    }
    double a = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      xn[d] = (static_cast<double>(to_f(row[d])) - mu) * c;
      if (bd) xn[d] -= static_cast<double>(bd[d]);
      a += xn[d] * static_cast<double>(w[d]);
    }
    const double pre_F = a + p[1];
    double f = 0.0;
    if (kind == 0) {
      f = pre_F > 0.0 ? pre_F : 0.0;
    } else if (kind == 1) {
      f = pre_F > p[2] && pre_F > 0.0 ? pre_F : 0.0;
    } else if (kind == 2) {
      if (pre_F > 0.0) f = std::max(a * p[3] + p[2], 0.0);
    } else {  // topk (k = p[2]), groupmax (k groups): F's pre-activation against its rivals', in float32
      const int64_t e = static_cast<int64_t>(p[3]), F = static_cast<int64_t>(p[6]), k = static_cast<int64_t>(p[2]);
      const float* W = enc[2 * e].data_ptr<float>();  // (Fn, D)
      const float* b = enc[2 * e + 1].data_ptr<float>();
      const int64_t Fn = enc[2 * e + 1].numel(), G = Fn / k;
      const int64_t lo = kind == 3 ? 0 : F / G * G, hi = kind == 3 ? Fn : lo + G;  // the rivals
      const int64_t out = kind == 3 ? k : 1;  // F is out once this many rivals are above it
      for (int64_t d = 0; d < D; ++d) xf[d] = static_cast<float>(xn[d]);
      // a feature's pre-activation: 8 lanes of fused multiply-adds over D in order, then their sum and the tail's
      // (one order whatever else the step holds; one chain of scalar adds would wait on each add's latency)
      const auto pre_of = [&](int64_t j) {
        const float* wr = W + j * D;
        __m256 acc = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(load8(xf.data() + d), load8(wr + d), acc);
        float sum = hsum(acc);
        for (; d < D; ++d) sum += xf[d] * wr[d];
        return sum + b[j];
      };
      const float mine = pre_of(F);
      int64_t above = 0;
      for (int64_t j = lo; j < hi && above < out; ++j) above += j != F && pre_of(j) > mine;
      f = above < out && pre_F > 0.0 ? pre_F : 0.0;
    }
    const double delta = (p[4] - f) * s;
    for (int64_t d = 0; d < D; ++d)
      row[d] = from_f<T>(static_cast<float>(static_cast<double>(to_f(row[d])) + delta * static_cast<double>(dF[d])));
  }
}

void apply_clamps(const View& x, const View& ops, const View& params, const View& bank,
                  const std::vector<View>& encoders) {
  LS_CHECK(x.dim() == 2 && x.is_contiguous(), "apply_clamps: x (N, D) contiguous");
  LS_CHECK(ops.dim() == 2 && ops.size(1) == 4 && ops.scalar_type() == kLong && ops.is_contiguous(),
           "apply_clamps: ops (Qc, 4) int64");
  LS_CHECK(params.dim() == 2 && params.size(1) == 7 && params.size(0) == ops.size(0) &&
               params.scalar_type() == kDouble && params.is_contiguous(),
           "apply_clamps: params (Qc, 7) float64");
  LS_CHECK(encoders.size() % 2 == 0, "apply_clamps: encoders in pairs (W_enc^T (F, D), b_enc (F,))");
  for (size_t e = 0; e < encoders.size(); e += 2)
    LS_CHECK(encoders[e].scalar_type() == kFloat && encoders[e].is_contiguous() && encoders[e].dim() == 2 &&
                 encoders[e].size(1) == x.size(1) && encoders[e + 1].scalar_type() == kFloat &&
                 encoders[e + 1].numel() == encoders[e].size(0),
             "apply_clamps: an encoder is W_enc^T (F, D) and b_enc (F,) float32, contiguous");
  LS_CHECK(bank.scalar_type() == kFloat && bank.is_contiguous() && (bank.numel() == 0 || bank.size(1) == x.size(1)),
           "apply_clamps: bank (V, D) float32");
  const int64_t Q = ops.size(0), D = x.size(1);
  if (Q == 0) return;
  if (x.scalar_type() == kFloat)
    clamp_impl<float>(x.data_ptr<float>(), D, ops.data_ptr<int64_t>(), Q, params.data_ptr<double>(),
                      bank.data_ptr<float>(), encoders);
  else if (x.scalar_type() == kBFloat16)
    clamp_impl<bf16>(x.data_ptr<bf16>(), D, ops.data_ptr<int64_t>(), Q, params.data_ptr<double>(),
                     bank.data_ptr<float>(), encoders);
  else
    LS_CHECK(false, "apply_clamps: float32 or bfloat16");
}

void apply_edits(const View& x, const View& ops, const View& bank) {
  LS_CHECK(x.dim() == 2 && x.is_contiguous(), "apply_edits: x (N, D) contiguous");
  LS_CHECK(ops.dim() == 2 && ops.size(1) == 4 && ops.scalar_type() == kLong && ops.is_contiguous(),
              "apply_edits: ops (Q, 4) int64");
  LS_CHECK(bank.scalar_type() == kFloat && bank.is_contiguous() &&
                  (bank.numel() == 0 || bank.size(1) == x.size(1)),
              "apply_edits: bank (V, D) float32");
  const int64_t Q = ops.size(0), D = x.size(1);
  if (Q == 0) return;
  if (x.scalar_type() == kFloat)
    apply_impl<float>(x.data_ptr<float>(), D, ops.data_ptr<int64_t>(), Q, bank.data_ptr<float>());
  else if (x.scalar_type() == kBFloat16)
    apply_impl<bf16>(x.data_ptr<bf16>(), D, ops.data_ptr<int64_t>(), Q, bank.data_ptr<float>());
  else
    LS_CHECK(false, "apply_edits: float32 or bfloat16");
}

bool site_touched(const std::vector<View>& edits, int64_t site) {
  if (edits.empty()) return false;
  for (size_t i : {size_t(0), size_t(3), size_t(6)}) {  // site_ptr, read_ptr, clamp_ptr (where the table has clamps)
    if (i >= edits.size()) break;
    const int64_t* ptr = edits[i].data_ptr<int64_t>();
    if (ptr[site] < ptr[site + 1]) return true;
  }
  return false;
}

void apply_site(const View& x, const std::vector<View>& edits, int64_t site) {
  if (edits.empty()) return;
  const int64_t* ptr = edits[0].data_ptr<int64_t>();
  const int64_t a = ptr[site], b = ptr[site + 1];
  if (a < b) apply_edits(x, edits[1].narrow(0, a, b - a), edits[2]);
  if (edits.size() < 9) return;
  const int64_t* cptr = edits[6].data_ptr<int64_t>();
  const int64_t ca = cptr[site], cb = cptr[site + 1];
  if (ca < cb)
    apply_clamps(x, edits[7].narrow(0, ca, cb - ca), edits[8].narrow(0, ca, cb - ca), edits[2],
                 std::vector<View>(edits.begin() + 9, edits.end()));
}

// The reads at `site`: entries [a, b) of read_rows and read_out (a == b: none).
struct SiteReads {
  int64_t a = 0, b = 0;
  const int64_t* rows = nullptr;
  float* out = nullptr;
};

static SiteReads reads_at(const std::vector<View>& edits, int64_t site) {
  if (edits.empty()) return {};
  const int64_t* ptr = edits[3].data_ptr<int64_t>();
  return {ptr[site], ptr[site + 1], edits[4].data_ptr<int64_t>(), edits[5].data_ptr<float>()};
}

void read_site(const View& h, const std::vector<View>& edits, int64_t site) {
  const auto [a, b, rows, out] = reads_at(edits, site);
  if (a == b) return;
  const int64_t D = h.size(1);
  for (int64_t i = a; i < b; ++i) {
    if (h.scalar_type() == kFloat) {
      const float* src = h.data_ptr<float>() + rows[i] * D;
      std::copy(src, src + D, out + i * D);
    } else {
      const bf16* src = h.data_ptr<bf16>() + rows[i] * D;
      for (int64_t d = 0; d < D; ++d) out[i * D + d] = to_f(src[d]);
    }
  }
}

template <typename T>
static void read_normalized_impl(const T* h, int64_t D, const int64_t* rows, int64_t a, int64_t b, float* out,
                                 float eps) {
  const std::vector<T> ones(D, from_f<T>(1.f));
  std::vector<T> row(D);
  for (int64_t i = a; i < b; ++i) {
    rms_norm_row(h + rows[i] * D, ones.data(), row.data(), D, eps);  // times 1: the normalized row as the norm rounds it
    for (int64_t d = 0; d < D; ++d) out[i * D + d] = to_f(row[d]);
  }
}

void read_normalized(const View& h, const std::vector<View>& edits, int64_t site, double eps) {
  const auto [a, b, rows, out] = reads_at(edits, site);
  if (a == b) return;
  if (h.scalar_type() == kFloat)
    read_normalized_impl<float>(h.data_ptr<float>(), h.size(1), rows, a, b, out, static_cast<float>(eps));
  else
    read_normalized_impl<bf16>(h.data_ptr<bf16>(), h.size(1), rows, a, b, out, static_cast<float>(eps));
}

}  // namespace ls
