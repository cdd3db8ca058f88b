// CPU kernels of the rollout engine's decode step, called from JAX through XLA's FFI
// (jaxrl/kernels/cpu_decode.py builds this file with the machine's C++ compiler on first use).
//
// A decode step multiplies a handful of rows (one token per KV-cache slot) by every weight and
// attends to a short cache per row: small problems on which XLA's CPU library kernels lose
// much of the machine to packing, tiling and dispatch. Two kernels take their place there:
//
//   jaxrl_decode_matmul  y[O, B] = W x[D, B], W [O, D] given as panels of 16 rows (see
//                        `panel_rows`), activations column-major, B a multiple of 16: the
//                        batch sits in the vector lanes and each weight element is read once,
//                        broadcast, and used for all B columns (the LM head)
//   jaxrl_decode_layer   one whole decoder layer for one token per row: the projections as
//                        above, RoPE, the KV-cache write in place, per-row attention over the
//                        row's own cache prefix, the MLP and the residuals (weights and the
//                        KV cache stacked over the layers, the layer an attribute)
//
// Both run on the calling XLA thread and on helper tasks from XLA's intra-op pool; work is
// handed out in chunks through atomic counters, so a helper that starts late (its thread busy
// with another operation) simply finds no work left.
// float32 only. Vectors are GCC/Clang vector extensions of 16 floats: one AVX-512 register,
// two AVX2 registers; the compiler picks the instructions for the machine (-march=native).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline i32x16 load(const int32_t* p) {
  i32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline f32x16 splat(float x) { return f32x16{} + x; }

inline float hmax(f32x16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

inline float hsum(f32x16 v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// e^x for x <= 0 (softmax weights, SiLU): x = k ln2 + r with |r| <= ln2 / 2, e^r by its
// Taylor series to r^7 / 7! (remainder below 1e-8 relative), times 2^k put into the exponent
// bits. x < -87 (including -inf, the masked scores) gives exactly 0.
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 round = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  f32x16 xc = x < -87.0f ? splat(-87.0f) : x;
  f32x16 k = (xc * 1.44269504088896341f + round) - round;
  f32x16 r = xc - k * 0.693145751953125f;  // ln 2, high part (exact product with k)
  r = r - k * 1.42860682030941723e-6f;     // ln 2, low part
  f32x16 p = splat(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  i32x16 bits = (__builtin_convertvector(k, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? f32x16{} : p * scale;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// Waits while `busy()`: pauses first, then yields the core (a waiter must not keep the
// thread it waits for off the CPU when the pool has more threads than the machine has cores).
template <typename Busy>
inline void spin_while(Busy busy) {
  for (int spins = 0; busy(); ++spins) {
    if (spins < 2048) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
}

// Work split into phases run in order, each a number of chunks: the calling thread and the
// helpers claim chunks through atomic counters, and a phase starts when the previous one is
// complete. The caller never waits for a helper that has not claimed work (one that starts
// late finds the phases done), and a helper never waits on its own thread: XLA's pool runs a
// task inline, on the scheduling thread, when that thread's queue is full, and such a helper
// returns at once (it would otherwise wait for the caller it is blocking). So a busy pool
// cannot cause a deadlock.
class Phases {
 public:
  void add(int64_t chunks, std::function<void(int64_t)> fn) {
    phases_.push_back({chunks, std::move(fn)});
  }

  // The caller's part: every phase in order.
  void run() {
    for (size_t p = 0; p < phases_.size(); ++p) {
      claim(p);
      Phase& phase = phases_[p];
      spin_while([&] { return phase.done.load(std::memory_order_acquire) < phase.chunks; });
      current_.store(static_cast<int64_t>(p + 1), std::memory_order_release);
    }
  }

  // A helper's part: join whichever phase is open until the last one is complete.
  void help() {
    if (std::this_thread::get_id() == caller_) return;  // run inline by Schedule: see above
    const int64_t last = static_cast<int64_t>(phases_.size());
    int64_t p = current_.load(std::memory_order_acquire);
    while (p < last) {
      claim(static_cast<size_t>(p));
      int64_t now = p;
      spin_while([&] { return (now = current_.load(std::memory_order_acquire)) == p; });
      p = now;
    }
  }

 private:
  struct Phase {
    Phase(int64_t n, std::function<void(int64_t)> f) : chunks(n), fn(std::move(f)) {}
    Phase(Phase&& o) noexcept : chunks(o.chunks), fn(std::move(o.fn)) {}
    int64_t chunks;
    std::function<void(int64_t)> fn;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };

  void claim(size_t p) {
    Phase& phase = phases_[p];
    for (;;) {
      const int64_t c = phase.next.fetch_add(1, std::memory_order_relaxed);
      if (c >= phase.chunks) return;
      phase.fn(c);
      phase.done.fetch_add(1, std::memory_order_release);
    }
  }

  std::vector<Phase> phases_;
  std::atomic<int64_t> current_{0};
  const std::thread::id caller_ = std::this_thread::get_id();  // built on the caller's thread
};

// Runs `phases` on this thread and on helpers from XLA's pool. Each helper holds `owner` (the
// phases and the buffers their chunks use), not the caller's frame: one that starts after the
// call returned finds every phase complete and touches nothing else.
// At most one helper per further core: the pool may have more threads than the machine has
// cores (one per device with --xla_force_host_platform_device_count), and a waiting helper on
// an oversubscribed core only slows the threads doing the work.
template <typename Owner>
void run_phases(ffi::ThreadPool& pool, const std::shared_ptr<Owner>& owner, Phases& phases) {
  const int64_t cores = std::max<int64_t>(std::thread::hardware_concurrency(), 1);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), cores) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([owner, &phases]() { phases.help(); });
  }
  phases.run();
}

// ---------------------------------------------------------------------------------------------
// Matmul: y[O, B] = W x[D, B], W [O, D] stored as panels of 16 rows, w[ceil(O / 16), D, 16]
// (w[p, d, r] = W[16 p + r, d], rows past O zero): a panel is one contiguous stream in which
// each step of d is one cache line of 16 weights, one per output row.

constexpr int64_t kPanel = 16;
// Software prefetch distance in floats (2 KiB ahead in the weight stream; 1-16 KiB measured,
// 2 best): the hardware prefetchers alone leave much of the 2-core float32 peak unused on
// D = 512 weights (standalone measurement, the [32000, 512] LM head of model M times 16
// columns: 4.3 ms with 8 row-major [O, D] rows per pass, 3.8 ms on panels without the
// prefetch, 2.8 ms with it).
constexpr int64_t kPrefetch = 512;

// Rows [0, rows) of y[., bp] (rows <= 16) from one panel p [d_in, 16], plus bias: per column
// tile, 16 accumulators; each weight is read once per tile and broadcast against the tile.
inline void panel_rows(const float* __restrict p, const float* __restrict bias,
                       const float* __restrict x, float* __restrict y, int64_t rows,
                       int64_t d_in, int64_t bp) {
  for (int64_t t = 0; t < bp; t += kLanes) {
    f32x16 acc[kPanel];
    for (int r = 0; r < kPanel; ++r) acc[r] = f32x16{};
    for (int64_t d = 0; d < d_in; ++d) {
      __builtin_prefetch(p + d * kPanel + kPrefetch, 0, 0);
      const f32x16 xv = load(x + d * bp + t);
#pragma GCC unroll 16
      for (int r = 0; r < kPanel; ++r) acc[r] += p[d * kPanel + r] * xv;
    }
    for (int64_t r = 0; r < rows; ++r) {
      store(y + r * bp + t, bias == nullptr ? acc[r] : acc[r] + bias[r]);
    }
  }
}

// y rows [r0, r1) of W x (+ b), r0 a multiple of 16: W as panels [., d_in, 16], x [d_in, bp],
// y [., bp] (rows past r1 are not written).
inline void project(const float* w, const float* bias, const float* x, float* y, int64_t r0,
                    int64_t r1, int64_t d_in, int64_t bp) {
  for (int64_t o = r0; o < r1; o += kPanel) {
    panel_rows(w + o * d_in, bias == nullptr ? nullptr : bias + o, x, y + o * bp,
               std::min(kPanel, r1 - o), d_in, bp);
  }
}

// Work per task: about this many weight elements times 16 columns.
constexpr int64_t kTaskElements = 1 << 17;

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), xd = x.dimensions(), yd = y->dimensions();
  if (wd.size() != 3 || wd[2] != kPanel || xd.size() != 2 || yd.size() != 2 ||
      wd[1] != xd[0] || wd[1] <= 0 || xd[1] <= 0 || xd[1] % kLanes != 0 ||
      yd[0] > wd[0] * kPanel || yd[1] != xd[1]) {
    return ffi::Error::InvalidArgument(
        "jaxrl_decode_matmul takes panels w [P, D, 16] and x [D, B] (B a multiple of 16) "
        "into y [O, B], O <= 16 P");
  }
  const int64_t rows = yd[0], d_in = wd[1], b = xd[1];
  const float* wp = w.typed_data();
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t task_rows =
      kPanel * std::max<int64_t>(1, kTaskElements / (kPanel * d_in * (b / kLanes)));
  const int64_t tasks = (rows + task_rows - 1) / task_rows;
  auto phases = std::make_shared<Phases>();
  phases->add(tasks, [=](int64_t task) {
    const int64_t r0 = task * task_rows;
    project(wp, nullptr, xp, yp, r0, std::min(rows, r0 + task_rows), d_in, b);
  });
  run_phases(pool, phases, *phases);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Decode attention: query head n = k * G + g of row b attends to the cache entries c of row b's
// kv head k with valid[b, c] != 0, c <= query_index[b] and, with a window W > 0,
// query_index[b] - c < W. Rows without such an entry get zeros.

struct AttentionArgs {
  const float* q;        // [B, N, H]
  const float* k;        // [B, K, H, C]
  const float* v;        // [B, K, C, H]
  const int32_t* valid;  // [B, C]
  const int32_t* index;  // [B]
  float* out;            // column-major [N * H, Bp]: out[(n * H + h) * bp + b]
  int64_t bp;
  int64_t kv_heads, group, head_dim, cache;
  int64_t window;
  float scale;
};

// Writes 16 output features starting at feature e of one row.
inline void put(const AttentionArgs& a, float* out, int64_t e, f32x16 v) {
  for (int i = 0; i < kLanes; ++i) out[(e + i) * a.bp] = v[i];
}

// Scores of G query heads (G <= 8) over key tiles [lo, hi): s[g * width + (c - lo)].
template <int G>
void scores(const AttentionArgs& a, const float* q, const float* k, int64_t lo, int64_t hi,
            float* s, int64_t width) {
  for (int64_t c0 = lo; c0 < hi; c0 += kLanes) {
    f32x16 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = f32x16{};
    for (int64_t h = 0; h < a.head_dim; ++h) {
      const f32x16 kv = load(k + h * a.cache + c0);
      for (int g = 0; g < G; ++g) acc[g] += q[g * a.head_dim + h] * kv;
    }
    for (int g = 0; g < G; ++g) store(s + g * width + (c0 - lo), acc[g] * a.scale);
  }
}

// out[g, :] = sum_c p[g, c] v[c, :] over c in [lo, hi), for G <= 8 query heads.
template <int G>
void weighted_values(const AttentionArgs& a, const float* p, const float* v, int64_t lo,
                     int64_t hi, int64_t width, float* out) {
  for (int64_t t = 0; t < a.head_dim; t += kLanes) {
    f32x16 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = f32x16{};
    for (int64_t c = lo; c < hi; ++c) {
      const f32x16 vv = load(v + c * a.head_dim + t);
      for (int g = 0; g < G; ++g) acc[g] += p[g * width + (c - lo)] * vv;
    }
    for (int g = 0; g < G; ++g) put(a, out, g * a.head_dim + t, acc[g]);
  }
}

template <int G>
void attend_group(const AttentionArgs& a, int64_t b, int64_t kh, int64_t g0,
                  std::vector<float>& buffer) {
  const int64_t query = a.index[b];
  int64_t lo = 0;
  if (a.window > 0) lo = std::max<int64_t>(0, query - a.window + 1);
  lo = lo / kLanes * kLanes;
  const int64_t hi = std::min<int64_t>(a.cache, (query + kLanes) / kLanes * kLanes);
  const int64_t n0 = kh * a.group + g0;
  float* out = a.out + b + n0 * a.head_dim * a.bp;
  if (query < 0 || hi <= lo) {
    for (int64_t e = 0; e < G * a.head_dim; e += kLanes) put(a, out, e, f32x16{});
    return;
  }
  const int64_t width = hi - lo;
  buffer.resize(G * width);
  float* s = buffer.data();
  const float* q = a.q + (b * a.kv_heads * a.group + n0) * a.head_dim;
  const float* k = a.k + (b * a.kv_heads + kh) * a.head_dim * a.cache;
  const float* v = a.v + (b * a.kv_heads + kh) * a.cache * a.head_dim;
  scores<G>(a, q, k, lo, hi, s, width);
  // Mask, then softmax per query head.
  const int32_t* valid = a.valid + b * a.cache;
  i32x16 iota;
  for (int i = 0; i < kLanes; ++i) iota[i] = i;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t c0 = lo; c0 < hi; c0 += kLanes) {
    const i32x16 c = iota + static_cast<int32_t>(c0);
    i32x16 ok = (load(valid + c0) != 0) & (c <= static_cast<int32_t>(query));
    if (a.window > 0) ok &= (static_cast<int32_t>(query) - c) < static_cast<int32_t>(a.window);
    for (int g = 0; g < G; ++g) {
      float* sg = s + g * width + (c0 - lo);
      store(sg, ok ? load(sg) : splat(neg_inf));
    }
  }
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * width;
    f32x16 m = splat(neg_inf);
    for (int64_t i = 0; i < width; i += kLanes) m = m > load(sg + i) ? m : load(sg + i);
    const float top = hmax(m);
    if (top == neg_inf) {  // no key: weights 0, output 0
      std::fill(sg, sg + width, 0.0f);
      continue;
    }
    f32x16 total{};
    for (int64_t i = 0; i < width; i += kLanes) {
      const f32x16 e = exp_nonpositive(load(sg + i) - top);
      store(sg + i, e);
      total += e;
    }
    const float inv = 1.0f / hsum(total);
    for (int64_t i = 0; i < width; i += kLanes) store(sg + i, load(sg + i) * inv);
  }
  weighted_values<G>(a, s, v, lo, hi, width, out);
}

void attend(const AttentionArgs& a, int64_t b, int64_t kh, std::vector<float>& buffer) {
  for (int64_t g0 = 0; g0 < a.group; g0 += 8) {
    switch (std::min<int64_t>(8, a.group - g0)) {
      case 1: attend_group<1>(a, b, kh, g0, buffer); break;
      case 2: attend_group<2>(a, b, kh, g0, buffer); break;
      case 3: attend_group<3>(a, b, kh, g0, buffer); break;
      case 4: attend_group<4>(a, b, kh, g0, buffer); break;
      case 5: attend_group<5>(a, b, kh, g0, buffer); break;
      case 6: attend_group<6>(a, b, kh, g0, buffer); break;
      case 7: attend_group<7>(a, b, kh, g0, buffer); break;
      default: attend_group<8>(a, b, kh, g0, buffer); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One decoder layer for one token per row (the math of jaxrl.models.transformer._block):
//
//   h = rmsnorm(x) * ln_attn;  q, k, v = W_q h + b_q, W_k h + b_k, W_v h + b_v
//   q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm    (qk_norm only, per head)
//   q, k = rope(q), rope(k);  cache[b, :, write_index[b]] = k, v
//   x = x + W_o attention(q, cache) + b_o
//   h = rmsnorm(x) * ln_mlp;  x = x + W_down (silu(W_gate h + b_gate) * (W_up h + b_up)) + b_down
//
// Activations are column-major, [features, Bp] (Bp: rows padded to a multiple of 16), so the
// projections are `project` over weight panels. The layer runs as `Phases`.


// out = rmsnorm(x) * w over the features of column-major x [d, bp].
inline void rms_norm_columns(const float* x, const float* w, float eps, int64_t d, int64_t bp,
                             float* out) {
  for (int64_t t = 0; t < bp; t += kLanes) {
    f32x16 ss{};
    for (int64_t i = 0; i < d; ++i) {
      const f32x16 v = load(x + i * bp + t);
      ss += v * v;
    }
    f32x16 inv{};
    for (int l = 0; l < kLanes; ++l) inv[l] = 1.0f / std::sqrt(ss[l] / d + eps);
    for (int64_t i = 0; i < d; ++i) store(out + i * bp + t, load(x + i * bp + t) * inv * w[i]);
  }
}

// One head of one row: gather from column-major y[(head * H + h) * bp + b], optional rmsnorm,
// then rope with the row's cos/sin [H]: x cos + rotate_half(x) sin.
inline void head_rope(const float* y, int64_t head, int64_t b, int64_t bp, int64_t hd,
                      const float* norm, float eps, const float* cos, const float* sin,
                      float* out) {
  float v[1024];
  for (int64_t h = 0; h < hd; ++h) v[h] = y[(head * hd + h) * bp + b];
  if (norm != nullptr) {
    float ss = 0.0f;
    for (int64_t h = 0; h < hd; ++h) ss += v[h] * v[h];
    const float inv = 1.0f / std::sqrt(ss / hd + eps);
    for (int64_t h = 0; h < hd; ++h) v[h] = v[h] * inv * norm[h];
  }
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < hd; ++h) {
    const float rotated = h < half ? -v[h + half] : v[h - half];
    out[h] = v[h] * cos[h] + rotated * sin[h];
  }
}

// silu(g) u = g sigmoid(g) u, with e = e^{-|g|} in (0, 1]: sigmoid(g) = 1 / (1 + e) for
// g >= 0, e / (1 + e) below.
inline f32x16 silu_times(f32x16 g, f32x16 u) {
  const f32x16 e = exp_nonpositive(g < 0.0f ? g : -g);
  const f32x16 sigmoid = (g >= 0.0f ? splat(1.0f) : e) / (1.0f + e);
  return g * sigmoid * u;
}

// Weights and buffers of LayerImpl, by argument position.
using F32 = ffi::Buffer<ffi::F32>;

// One layer's slice of a stacked [L, ...] argument.
inline const float* layer_slice(const F32& a, int64_t layer) {
  return a.typed_data() + layer * (a.element_count() / a.dimensions()[0]);
}

ffi::Error LayerImpl(ffi::ThreadPool pool, F32 x, F32 cos, F32 sin, ffi::Buffer<ffi::S32> index,
                     ffi::Buffer<ffi::S32> valid, F32 ln_attn, F32 w_q, F32 b_q, F32 w_k,
                     F32 b_k, F32 w_v, F32 b_v, F32 q_norm, F32 k_norm, F32 w_o, F32 b_o,
                     F32 ln_mlp, F32 w_gate, F32 b_gate, F32 w_up, F32 b_up, F32 w_down,
                     F32 b_down, F32 k_cache_in, F32 v_cache_in, ffi::ResultBuffer<ffi::F32> x_out,
                     ffi::ResultBuffer<ffi::F32> k_cache, ffi::ResultBuffer<ffi::F32> v_cache,
                     int64_t layer, float eps, int64_t window, float scale, bool qk_norm) {
  const auto bad_shapes = ffi::Error::InvalidArgument(
      "jaxrl_decode_layer: inconsistent shapes, or caches not updated in place");
  if (x.dimensions().size() != 2 || k_cache->dimensions().size() != 5 ||
      b_q.dimensions().size() != 2 || b_gate.dimensions().size() != 2 ||
      ln_attn.dimensions().size() != 2) {
    return bad_shapes;
  }
  const int64_t d = x.dimensions()[0], bp = x.dimensions()[1];
  // The caches are stacked over the layers: [L, B, K, H, C] and [L, B, K, C, H].
  const int64_t batch = k_cache->dimensions()[1], kv_heads = k_cache->dimensions()[2];
  const int64_t hd = k_cache->dimensions()[3], cache = k_cache->dimensions()[4];
  const int64_t kh = kv_heads * hd, nh = b_q.dimensions()[1], f = b_gate.dimensions()[1];
  const int64_t layers = ln_attn.dimensions()[0];
  if (hd <= 0 || kv_heads <= 0 || batch <= 0 || nh <= 0) return bad_shapes;
  const int64_t heads = nh / hd;
  auto dims_are = [](auto dims, std::initializer_list<int64_t> want) {
    return dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin());
  };
  // Stacked panels [L, ceil(rows / 16), d_in, 16] of each projection.
  auto panels_of = [&](const F32& w, int64_t rows, int64_t d_in) {
    return dims_are(w.dimensions(), {layers, (rows + kPanel - 1) / kPanel, d_in, kPanel});
  };
  auto vector_of = [&](const F32& v, int64_t n) { return dims_are(v.dimensions(), {layers, n}); };
  if (bp % kLanes != 0 || batch > bp || hd % kLanes != 0 || hd > 1024 || cache % kLanes != 0 ||
      k_cache->dimensions()[0] != layers ||
      layer < 0 || layer >= layers || nh % hd != 0 || heads % kv_heads != 0 ||
      !panels_of(w_q, nh, d) || !panels_of(w_k, kh, d) || !panels_of(w_v, kh, d) ||
      !panels_of(w_o, d, nh) || !panels_of(w_gate, f, d) || !panels_of(w_up, f, d) ||
      !panels_of(w_down, d, f) || !vector_of(ln_attn, d) || !vector_of(ln_mlp, d) ||
      !vector_of(b_q, nh) || !vector_of(b_k, kh) || !vector_of(b_v, kh) ||
      !vector_of(b_o, d) || !vector_of(b_gate, f) || !vector_of(b_up, f) ||
      !vector_of(b_down, d) || !vector_of(q_norm, hd) || !vector_of(k_norm, hd) ||
      !dims_are(cos.dimensions(), {batch, hd}) || !dims_are(sin.dimensions(), {batch, hd}) ||
      !dims_are(index.dimensions(), {batch}) || !dims_are(valid.dimensions(), {batch, cache}) ||
      !dims_are(v_cache->dimensions(), {layers, batch, kv_heads, cache, hd}) ||
      !dims_are(x_out->dimensions(), {d, bp}) ||
      k_cache_in.typed_data() != k_cache->typed_data() ||
      v_cache_in.typed_data() != v_cache->typed_data()) {
    return bad_shapes;
  }
  const float *wq = layer_slice(w_q, layer), *wk = layer_slice(w_k, layer),
              *wv = layer_slice(w_v, layer), *wo = layer_slice(w_o, layer),
              *wgate = layer_slice(w_gate, layer), *wup = layer_slice(w_up, layer),
              *wdown = layer_slice(w_down, layer);
  const float *bq = layer_slice(b_q, layer), *bk = layer_slice(b_k, layer),
              *bv = layer_slice(b_v, layer), *bo = layer_slice(b_o, layer),
              *bgate = layer_slice(b_gate, layer), *bup = layer_slice(b_up, layer),
              *bdown = layer_slice(b_down, layer);
  const float *ln1 = layer_slice(ln_attn, layer), *ln2 = layer_slice(ln_mlp, layer),
              *qn = qk_norm ? layer_slice(q_norm, layer) : nullptr,
              *kn = qk_norm ? layer_slice(k_norm, layer) : nullptr;
  struct Job {
    Phases phases;
    std::vector<float> h, qkv, q_rows, attn, gate, up;
  };
  auto job = std::make_shared<Job>();
  job->h.resize(std::max(d, f) * bp);
  const int64_t qkv_rows = nh + 2 * kh;
  job->qkv.resize(qkv_rows * bp);
  job->q_rows.resize(batch * nh);
  job->attn.assign(nh * bp, 0.0f);
  job->gate.resize(f * bp);
  job->up.resize(f * bp);
  Job* j = job.get();
  const float* xp = x.typed_data();
  float* out = x_out->typed_data();
  const int64_t block = 64;  // rows per chunk of a projection (a multiple of the panel)

  j->phases.add(1, [=](int64_t) { rms_norm_columns(xp, ln1, eps, d, bp, j->h.data()); });
  // Rows [0, nh) of qkv are q, [nh, nh + kh) k, [nh + kh, nh + 2 kh) v: a chunk may straddle
  // two of them, at a multiple of 16 (nh and kh are multiples of hd).
  j->phases.add((qkv_rows + block - 1) / block, [=](int64_t c) {
    const float* ws[3] = {wq, wk, wv};
    const float* bs[3] = {bq, bk, bv};
    const int64_t starts[4] = {0, nh, nh + kh, qkv_rows};
    const int64_t r0 = c * block, r1 = std::min(qkv_rows, r0 + block);
    for (int m = 0; m < 3; ++m) {
      const int64_t lo = std::max(r0, starts[m]), hi = std::min(r1, starts[m + 1]);
      if (lo >= hi) continue;
      project(ws[m], bs[m], j->h.data(), j->qkv.data() + starts[m] * bp, lo - starts[m],
              hi - starts[m], d, bp);
    }
  });
  const int32_t* write_index = index.typed_data();
  const int64_t layer_cells = batch * kv_heads * hd * cache;  // one layer's slice of a cache
  float* kc = k_cache->typed_data() + layer * layer_cells;
  float* vc = v_cache->typed_data() + layer * layer_cells;
  j->phases.add(batch, [=](int64_t b) {
    const float* cb = cos.typed_data() + b * hd;
    const float* sb = sin.typed_data() + b * hd;
    for (int64_t n = 0; n < heads; ++n) {
      head_rope(j->qkv.data(), n, b, bp, hd, qn, eps, cb, sb, j->q_rows.data() + (b * heads + n) * hd);
    }
    const int64_t w = write_index[b];
    if (w < 0 || w >= cache) return;  // outside the cache: dropped (as XLA's scatter does)
    float rotated[1024];
    for (int64_t k = 0; k < kv_heads; ++k) {
      head_rope(j->qkv.data() + nh * bp, k, b, bp, hd, kn, eps, cb, sb, rotated);
      float* kdst = kc + ((b * kv_heads + k) * hd) * cache + w;
      float* vdst = vc + ((b * kv_heads + k) * cache + w) * hd;
      const float* vsrc = j->qkv.data() + (nh + kh + k * hd) * bp + b;
      for (int64_t h = 0; h < hd; ++h) {
        kdst[h * cache] = rotated[h];
        vdst[h] = vsrc[h * bp];
      }
    }
  });
  const AttentionArgs args{j->q_rows.data(), kc, vc, valid.typed_data(), write_index,
                           j->attn.data(), bp, kv_heads, heads / kv_heads, hd, cache,
                           window, scale};
  j->phases.add(batch * kv_heads, [=](int64_t t) {
    thread_local std::vector<float> buffer;
    attend(args, t / kv_heads, t % kv_heads, buffer);
  });
  j->phases.add((d + block - 1) / block, [=](int64_t c) {
    const int64_t r0 = c * block, r1 = std::min(d, r0 + block);
    project(wo, bo, j->attn.data(), out, r0, r1, nh, bp);
    for (int64_t i = r0 * bp; i < r1 * bp; ++i) out[i] += xp[i];
  });
  j->phases.add(1, [=](int64_t) { rms_norm_columns(out, ln2, eps, d, bp, j->h.data()); });
  j->phases.add((f + block - 1) / block, [=](int64_t c) {
    const int64_t r0 = c * block, r1 = std::min(f, r0 + block);
    project(wgate, bgate, j->h.data(), j->gate.data(), r0, r1, d, bp);
    project(wup, bup, j->h.data(), j->up.data(), r0, r1, d, bp);
    float* g = j->gate.data();
    const float* u = j->up.data();
    for (int64_t i = r0 * bp; i < r1 * bp; i += kLanes) store(g + i, silu_times(load(g + i), load(u + i)));
  });
  j->phases.add((d + block - 1) / block, [=](int64_t c) {
    const int64_t r0 = c * block, r1 = std::min(d, r0 + block);
    float* y = j->h.data();  // h is consumed: this chunk's rows of W_down act go here
    project(wdown, bdown, j->gate.data(), y, r0, r1, f, bp);
    for (int64_t i = r0 * bp; i < r1 * bp; ++i) out[i] += y[i];
  });
  run_phases(pool, job, job->phases);
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlDecodeMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlDecodeLayer, LayerImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32>()                     // x [D, Bp]
                                  .Arg<F32>()                     // cos [B, H]
                                  .Arg<F32>()                     // sin [B, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // write_index [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // valid [B, C]
                                  .Arg<F32>()                     // ln_attn [L, D]
                                  .Arg<F32>()                     // w_q panels [L, ., D, 16]
                                  .Arg<F32>()                     // b_q [L, N*H]
                                  .Arg<F32>()                     // w_k panels [L, ., D, 16]
                                  .Arg<F32>()                     // b_k [L, K*H]
                                  .Arg<F32>()                     // w_v panels [L, ., D, 16]
                                  .Arg<F32>()                     // b_v [L, K*H]
                                  .Arg<F32>()                     // q_norm [L, H]
                                  .Arg<F32>()                     // k_norm [L, H]
                                  .Arg<F32>()                     // w_o panels [L, ., N*H, 16]
                                  .Arg<F32>()                     // b_o [L, D]
                                  .Arg<F32>()                     // ln_mlp [L, D]
                                  .Arg<F32>()                     // w_gate panels [L, ., D, 16]
                                  .Arg<F32>()                     // b_gate [L, F]
                                  .Arg<F32>()                     // w_up panels [L, ., D, 16]
                                  .Arg<F32>()                     // b_up [L, F]
                                  .Arg<F32>()                     // w_down panels [L, ., F, 16]
                                  .Arg<F32>()                     // b_down [L, D]
                                  .Arg<F32>()                     // k_cache [L, B, K, H, C]
                                  .Arg<F32>()                     // v_cache [L, B, K, C, H]
                                  .Ret<F32>()                     // x [D, Bp]
                                  .Ret<F32>()                     // k_cache (aliased)
                                  .Ret<F32>()                     // v_cache (aliased)
                                  .Attr<int64_t>("layer")
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<bool>("qk_norm"));
