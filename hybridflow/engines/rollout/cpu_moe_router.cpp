/* The routed layers' routing after the router's product, as torch computes it on CPU (cpu_moe_router.py).

   moe.py's route_logits on bf16 or fp32 logits [R, E]: softmax over the E experts in fp32, the k largest
   probabilities (torch.topk, sorted), optionally divided by their sum, in the logits' dtype (bf16: rounded).
   Reproduced operation by operation:
     - softmax: torch's last-dimension kernel on 16-float vectors (AVX-512): the maximum, exp(x - max) with the vector
       exp torch calls (Sleef's, passed in), their sum (in order below 16 experts, else 16 lanes then a fixed tree
       of lane pairs), one reciprocal, then a product per probability;
     - top-k: torch's CPU selection over (probability, index) pairs, with the same standard-library algorithms and
       comparison (partial_sort where 64 k <= E, else nth_element, then the first k - 1 sorted), so that equal
       probabilities come out in torch's order;
     - the k weights' sum in order, one division each, rounding to nearest even.
   cpu_moe_router.py checks the result against torch's on random and tied logits before the decoder uses it. */
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

typedef uint16_t bf16;
typedef __m512 (*vector_exp)(__m512);

static inline float to_f32(bf16 v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 to_bf16(float f) { /* round to nearest even; NaN: torch's vectorised conversion gives 0xffff */
    if (f != f) return 0xffff;
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return (bf16)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline float to_f32(float v) { return v; }
static inline void store(float v, bf16 *out) { *out = to_bf16(v); }
static inline void store(float v, float *out) { *out = v; }

static inline float lane_sum(__m512 v) { /* torch's reduction of one 16-lane vector */
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
    return _mm512_cvtss_f32(v);
}

/* p [E] = softmax of the logits l [E] (bf16 or fp32) */
template <typename T>
static void softmax(const T *l, long E, float *p, vector_exp exp16) {
    float m = to_f32(l[0]);
    for (long e = 1; e < E; e++) {
        const float v = to_f32(l[e]);
        m = v > m || v != v ? v : m;
    }
    for (long e0 = 0; e0 < E; e0 += 16) {
        const long n = E - e0 < 16 ? E - e0 : 16;
        const __mmask16 mask = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        float x[16] = {0};
        for (long i = 0; i < n; i++) x[i] = to_f32(l[e0 + i]);
        _mm512_mask_storeu_ps(p + e0, mask, exp16(_mm512_sub_ps(_mm512_loadu_ps(x), _mm512_set1_ps(m))));
    }
    float sum;
    if (E < 16) {
        sum = p[0];
        for (long e = 1; e < E; e++) sum = sum + p[e];
    } else {
        __m512 acc = _mm512_loadu_ps(p);
        long d = 16;
        for (; d < E - E % 16; d += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + d));
        if (d < E) { /* the last E mod 16: added into their lanes only */
            const __mmask16 mask = (__mmask16)((1u << (E - d)) - 1);
            acc = _mm512_mask_add_ps(acc, mask, acc, _mm512_maskz_loadu_ps(mask, p + d));
        }
        sum = lane_sum(acc);
    }
    const float inverse = 1.0f / sum;
    for (long e = 0; e < E; e++) p[e] = p[e] * inverse;
}

typedef std::pair<float, int64_t> scored;

static bool before(const scored &x, const scored &y) { /* NaN first, then larger first */
    return (x.first != x.first && y.first == y.first) || x.first > y.first;
}

/* weights [R, k] and experts [R, k] of router logits [R, E] (weights in the logits' dtype); scratch:
   route_scratch_bytes(E) bytes. */
template <typename T>
static void route(long R, long E, long k, int normalize, const T *logits, void *exp16, T *weights, int64_t *experts,
                  void *scratch) {
    scored *pairs = (scored *)scratch;
    float *probs = (float *)(pairs + E);
    for (long r = 0; r < R; r++) {
        softmax(logits + r * E, E, probs, (vector_exp)exp16);
        for (long e = 0; e < E; e++) pairs[e] = scored(probs[e], e);
        if (k * 64 <= E) {
            std::partial_sort(pairs, pairs + k, pairs + E, before);
        } else {
            std::nth_element(pairs, pairs + k - 1, pairs + E, before);
            std::sort(pairs, pairs + k - 1, before);
        }
        float sum = 0.0f;
        for (long j = 0; j < k; j++) sum = sum + pairs[j].first;
        for (long j = 0; j < k; j++) {
            store(normalize ? pairs[j].first / sum : pairs[j].first, weights + r * k + j);
            experts[r * k + j] = pairs[j].second;
        }
    }
}

extern "C" void route_bf16(long R, long E, long k, int normalize, const bf16 *logits, void *exp16, bf16 *weights,
                           int64_t *experts, void *scratch) {
    route(R, E, k, normalize, logits, exp16, weights, experts, scratch);
}

extern "C" void route_f32(long R, long E, long k, int normalize, const float *logits, void *exp16, float *weights,
                          int64_t *experts, void *scratch) {
    route(R, E, k, normalize, logits, exp16, weights, experts, scratch);
}

/* The scratch route_bf16 needs per call, in bytes, for E experts. */
extern "C" long route_scratch_bytes(long E) { return E * (long)(sizeof(scored) + sizeof(float)); }
