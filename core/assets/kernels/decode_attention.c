/* Decode attention over a KV cache, fused: one query token per request, G query heads per KV head.

   For request i, KV head h: the G queries' scores against the first len[i] cached keys of cache row
   row[i], their softmax, and the weighted sum of the values, all in fp32 registers and one small
   scratch of scores, reading K and V once each (torch's bf16 bmm over 4-row query groups reads them at
   a third of the memory bandwidth, after a copy). Inputs bf16 or fp32, math fp32, output bf16
   (rounded to nearest even) or fp32. Built by core/model/cpu/native.py with the C compiler at hand;
   VW (floats per vector) is 16 for AVX-512 builds, 8 for AVX2. Pure C with GCC/Clang vector
   extensions: no intrinsics, so one source serves every ISA the compiler targets.
   Layouts (elements): q [B, Hkv*G, D] with rows q_stride apart, out the same contiguous; cache rows k/v at row*s_row + h*s_head +
   t*D. scratch: G * sstride floats, sstride >= max len. Returns 0, or -1 for a shape it does not
   handle (the caller falls back to torch). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef VW
#define VW 16
#endif
#define PF 16 /* rows of K ahead that the score loop prefetches */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));

static inline vf load_f32(const void *p) { vf f; memcpy(&f, p, sizeof f); return f; }
static inline vf load_bf16(const void *p) {
    vh h; memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f; memcpy(&f, &u, sizeof f); return f;
}
/* fp32 -> bf16, rounded to nearest even; a NaN stays a (quiet) NaN */
static inline void store_bf16(uint16_t *p, vf f) {
    vu u; memcpy(&u, &f, sizeof u);
    vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    vu nan = (u & 0x7fffffffu) > 0x7f800000u;
    r = (r & ~nan) | (((u >> 16) | 0x40u) & nan);
    vh h = __builtin_convertvector(r, vh);
    memcpy(p, &h, sizeof h);
}

static inline float hsum(vf a) { /* a tree of shuffles: a scalar loop over lanes costs 3x more */
#if VW == 16
    a += __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    a += __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif VW == 8
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
    a += __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6);
#elif VW == 4
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1);
    a += __builtin_shufflevector(a, a, 1, 0, 3, 2);
#else
    float r = 0.f;
    for (int j = 1; j < VW; j++) r += a[j];
    return a[0] + r;
#endif
    return a[0];
}

/* every cache line of one token's row (a 64-dim bf16 row spans two) */
static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b);
}

/* where mask (all ones / zeros per lane) then a else b: C has no vector ?: (GCC's is C++ only) */
static inline vf vsel(vi mask, vf a, vf b) {
    vi ia, ib; memcpy(&ia, &a, sizeof ia); memcpy(&ib, &b, sizeof ib);
    vi r = (ia & mask) | (ib & ~mask);
    vf f; memcpy(&f, &r, sizeof f); return f;
}

/* exp(x) for x <= 0 (scores minus their max): 2^n * p(r), relative error < 2e-7; exp(-inf) = 0. */
static inline vf vexp_neg(vf x) {
    const vf lo = (vf){0} - 87.f;
    vi under = x < lo;
    x = vsel(under, lo, x);
    vf n = (x * 1.44269504089f + 12582912.f) - 12582912.f;
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf s; memcpy(&s, &e, sizeof s);
    p = p * s;
    return vsel(under, (vf){0}, p);
}

static inline float exp_neg(float x) {
    vf v = (vf){0} + x;
    return vexp_neg(v)[0];
}

/* softmax of each of the G score rows in place (length T, stride ss); returns nothing, fills inv[g] */
static void softmax_rows(float *s, int64_t G, int64_t T, int64_t ss, const float *m, float *inv) {
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * ss, mg = m[g], sum = 0.f;
        vf acc = {0};
        int64_t t = 0;
        for (; t + VW <= T; t += VW) {
            vf e = vexp_neg(load_f32(sg + t) - mg);
            memcpy(sg + t, &e, sizeof e);
            acc += e;
        }
        for (; t < T; t++) { float e = exp_neg(sg[t] - mg); sg[t] = e; sum += e; }
        inv[g] = 1.f / (sum + hsum(acc));
    }
}

/* One kernel per (G, C = D / VW, K/V loader); G and C known at compile time keep the queries and the
   accumulators in registers. */
#define KERNEL(NAME, GG, CC, LOADKV, KVT)                                                                   \
static void NAME(const void *q, int q_bf16, int64_t q_stride, const KVT *k, const KVT *v, const int64_t *row,                \
                 const int64_t *len, int64_t i0, int64_t i1, int64_t Hkv, int64_t G_, int64_t D_,          \
                 int64_t s_row, int64_t s_head, float scale, void *out, int out_bf16, float *s,            \
                 int64_t ss) {                                                                             \
    const int64_t G = GG ? GG : G_, C = CC ? CC : D_ / VW, D = C * VW;                                     \
    for (int64_t i = i0; i < i1; i++) {                                                                    \
        const int64_t T = len[i];                                                                          \
        for (int64_t h = 0; h < Hkv; h++) {                                                                \
            const int64_t qo = i * q_stride + h * G * D, oo = (i * Hkv + h) * G * D;                       \
            const KVT *kh = k + row[i] * s_row + h * s_head, *vh = v + row[i] * s_row + h * s_head;        \
            int64_t ni = h + 1 < Hkv ? i : i + 1, nh = h + 1 < Hkv ? h + 1 : 0;                            \
            const KVT *kn = ni < i1 ? k + row[ni] * s_row + nh * s_head : kh;                              \
            const int64_t Tn = ni < i1 ? len[ni] : 0;                                                      \
            vf qv[GG ? GG : 16][CC ? CC : 16], acc[GG ? GG : 16][CC ? CC : 16];                            \
            float m[GG ? GG : 16], inv[GG ? GG : 16];                                             \
            for (int64_t g = 0; g < G; g++) {                                                              \
                for (int64_t c = 0; c < C; c++) {                                                          \
                    if (q_bf16) {                                                                          \
                        qv[g][c] = load_bf16((const uint16_t *)q + qo + g * D + c * VW) * scale;           \
                    } else {                                                                               \
                        qv[g][c] = load_f32((const float *)q + qo + g * D + c * VW) * scale;               \
                    }                                                                                      \
                    acc[g][c] = (vf){0};                                                                   \
                }                                                                                          \
                m[g] = -INFINITY;                                                                          \
            }                                                                                              \
            if (T == 0) { for (int64_t g = 0; g < G; g++) inv[g] = 0.f; goto store_##NAME; }               \
            for (int64_t t = 0; t < T; t++) {                                                              \
                const KVT *kt = kh + t * D;                                                                \
                prefetch_row(kt + PF * D, D * sizeof(KVT));                                                \
                prefetch_row(vh + t * D, D * sizeof(KVT)); /* V's row, for the second pass */              \
                vf kc[CC ? CC : 16];                                                                       \
                for (int64_t c = 0; c < C; c++) kc[c] = LOADKV(kt + c * VW);                               \
                for (int64_t g = 0; g < G; g++) {                                                          \
                    vf a = qv[g][0] * kc[0];                                                               \
                    for (int64_t c = 1; c < C; c++) a += qv[g][c] * kc[c];                                 \
                    float x = hsum(a);                                                                     \
                    s[g * ss + t] = x;                                                                     \
                    m[g] = x > m[g] ? x : m[g];                                                            \
                }                                                                                          \
            }                                                                                              \
            softmax_rows(s, G, T, ss, m, inv);                                                             \
            for (int64_t t = 0; t < T; t++) {                                                              \
                const KVT *vt = vh + t * D;                                                                \
                if (t < Tn) prefetch_row(kn + t * D, D * sizeof(KVT)); /* the next head's keys */          \
                vf vc[CC ? CC : 16];                                                                       \
                for (int64_t c = 0; c < C; c++) vc[c] = LOADKV(vt + c * VW);                               \
                for (int64_t g = 0; g < G; g++) {                                                          \
                    const float p = s[g * ss + t];                                                         \
                    for (int64_t c = 0; c < C; c++) acc[g][c] += p * vc[c];                                \
                }                                                                                          \
            }                                                                                              \
        store_##NAME:                                                                                      \
            for (int64_t g = 0; g < G; g++)                                                                \
                for (int64_t c = 0; c < C; c++) {                                                          \
                    vf r = acc[g][c] * inv[g];                                                             \
                    if (out_bf16) {                                                                        \
                        store_bf16((uint16_t *)out + oo + g * D + c * VW, r);                              \
                    } else {                                                                               \
                        memcpy((float *)out + oo + g * D + c * VW, &r, sizeof r);                          \
                    }                                                                                      \
                }                                                                                          \
        }                                                                                                  \
    }                                                                                                      \
}

#define LD_BF16(p) load_bf16(p)
#define LD_F32(p) load_f32(p)
#define BOTH(G, D)                                                                                         \
    KERNEL(k_bf16_##G##_##D, G, (D / VW), LD_BF16, uint16_t)                                               \
    KERNEL(k_f32_##G##_##D, G, (D / VW), LD_F32, float)

BOTH(4, 64) BOTH(8, 64) BOTH(4, 128) BOTH(8, 128) /* the common GQA shapes; others take k_*_any */
KERNEL(k_bf16_any, 0, 0, LD_BF16, uint16_t)
KERNEL(k_f32_any, 0, 0, LD_F32, float)

/* Any G <= 16 and D <= 256 (a head size that is no multiple of VW: the tests' tiny models), in scalar
   loops the compiler vectorises where it can. */
#define SCALAR(NAME, KVT, CVT)                                                                             \
static void NAME(const void *q, int q_bf16, int64_t q_stride, const KVT *k, const KVT *v, const int64_t *row, \
                 const int64_t *len, int64_t i0, int64_t i1, int64_t Hkv, int64_t G, int64_t D,            \
                 int64_t s_row, int64_t s_head, float scale, void *out, int out_bf16, float *s,            \
                 int64_t ss) {                                                                             \
    for (int64_t i = i0; i < i1; i++) {                                                                    \
        const int64_t T = len[i];                                                                          \
        for (int64_t h = 0; h < Hkv; h++) {                                                                \
            const int64_t qo = i * q_stride + h * G * D, oo = (i * Hkv + h) * G * D;                       \
            const KVT *kh = k + row[i] * s_row + h * s_head, *vh = v + row[i] * s_row + h * s_head;        \
            float qf[16][256], acc[256], m[16], inv[16];                                                   \
            for (int64_t g = 0; g < G; g++) {                                                              \
                for (int64_t d = 0; d < D; d++)                                                            \
                    qf[g][d] = scale * (q_bf16 ? bf16f(((const uint16_t *)q)[qo + g * D + d])              \
                                               : ((const float *)q)[qo + g * D + d]);                      \
                m[g] = -INFINITY;                                                                          \
            }                                                                                              \
            for (int64_t t = 0; t < T; t++)                                                                \
                for (int64_t g = 0; g < G; g++) {                                                          \
                    float a = 0.f;                                                                         \
                    for (int64_t d = 0; d < D; d++) a += qf[g][d] * CVT(kh[t * D + d]);                    \
                    s[g * ss + t] = a;                                                                     \
                    m[g] = a > m[g] ? a : m[g];                                                            \
                }                                                                                          \
            softmax_rows(s, G, T, ss, m, inv);                                                             \
            for (int64_t g = 0; g < G; g++) {                                                              \
                for (int64_t d = 0; d < D; d++) acc[d] = 0.f;                                              \
                for (int64_t t = 0; t < T; t++)                                                            \
                    for (int64_t d = 0; d < D; d++) acc[d] += s[g * ss + t] * CVT(vh[t * D + d]);          \
                for (int64_t d = 0; d < D; d++) {                                                          \
                    float r = T ? acc[d] * inv[g] : 0.f;                                                   \
                    if (out_bf16) ((uint16_t *)out)[oo + g * D + d] = f32bf(r);                            \
                    else ((float *)out)[oo + g * D + d] = r;                                               \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}

static inline float bf16f(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float f32f(float x) { return x; }
static inline uint16_t f32bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
SCALAR(k_bf16_scalar, uint16_t, bf16f)
SCALAR(k_f32_scalar, float, f32f)

typedef void (*kernel_fn)(const void *, int, int64_t, const void *, const void *, const int64_t *, const int64_t *,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, void *, int,
                          float *, int64_t);

#define PICK(G, D)                                                                                         \
    if (Gq == G && Dq == D) return kv_bf16 ? (kernel_fn)k_bf16_##G##_##D : (kernel_fn)k_f32_##G##_##D;

static kernel_fn pick(int64_t Gq, int64_t Dq, int kv_bf16) {
    PICK(4, 64) PICK(8, 64) PICK(4, 128) PICK(8, 128)
    if (Gq <= 16 && Dq % VW == 0 && Dq / VW <= 16) return kv_bf16 ? (kernel_fn)k_bf16_any : (kernel_fn)k_f32_any;
    if (Gq <= 16 && Dq <= 256) return kv_bf16 ? (kernel_fn)k_bf16_scalar : (kernel_fn)k_f32_scalar;
    return 0;
}

int mlight_decode_attention_vw(void) { return VW; }

int mlight_decode_attention(const void *q, int q_bf16, int64_t q_stride, const void *k, const void *v, int kv_bf16,
                            const int64_t *row, const int64_t *len, int64_t i0, int64_t i1, int64_t Hkv,
                            int64_t G, int64_t D, int64_t s_row, int64_t s_head, float scale, void *out,
                            int out_bf16, float *scratch, int64_t sstride) {
    kernel_fn f = pick(G, D, kv_bf16);
    if (!f) return -1;
    f(q, q_bf16, q_stride, k, v, row, len, i0, i1, Hkv, G, D, s_row, s_head, scale, out, out_bf16, scratch, sstride);
    return 0;
}

/* The same call split over an OpenMP team (built with -fopenmp, which links the libgomp torch has
   loaded: its threads, not more of them): part j takes requests [bounds[j], bounds[j+1]) and scratch
   + j * G * sstride. */
int mlight_decode_attention_parts(const void *q, int q_bf16, int64_t q_stride, const void *k, const void *v,
                                  int kv_bf16, const int64_t *row, const int64_t *len, const int64_t *bounds,
                                  int parts, int64_t Hkv, int64_t G, int64_t D, int64_t s_row, int64_t s_head,
                                  float scale, void *out, int out_bf16, float *scratch, int64_t sstride) {
    kernel_fn f = pick(G, D, kv_bf16);
    if (!f) return -1;
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1) num_threads(parts)
#endif
    for (int j = 0; j < parts; j++)
        if (bounds[j] < bounds[j + 1])
            f(q, q_bf16, q_stride, k, v, row, len, bounds[j], bounds[j + 1], Hkv, G, D, s_row, s_head, scale, out,
              out_bf16, scratch + (int64_t)j * G * sstride, sstride);
    return 0;
}

int mlight_decode_attention_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
