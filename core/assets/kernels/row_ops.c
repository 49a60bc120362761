/* A decode step's small per-row operations in one pass each, bf16 and fp32: the KV cache write, RMSNorm,
   RoPE (halves) joined with v into the attention payload, the softmax router and the residual add; and the loop
   that runs a batch-1 decode step's bound kernel calls (mlight_run_calls).

   In a decode step these run on a few hundred rows between the big GEMMs; as torch ops each is 4-7
   kernels with a fresh tensor apiece and a cold start on lines the experts' weights have just evicted
   (a B = 256 step of the 784M Mixtral: the cache write 7.8 ms, the norms 4.8-6.5, RoPE with its joins
   3-5, against 1-2 ms of arithmetic and bytes). Each function here reproduces the torch expression it
   replaces rounding for rounding: every bf16 op of the reference is an fp32 op rounded to nearest even,
   in the same order, so RoPE and the cache write are bit for bit torch's, and RMSNorm differs only where
   its fp32 sum of squares is added in another order (rarely; one bf16 step in the normed row, at most two
   after the weight's product).
   The fp32 forms (an AVX2 CPU's math over bf16 checkpoints) do the same without the roundings to bf16, and
   the cache write narrows fp32 rows to a bf16 cache as torch's .to() does. Built by core/model/cpu/row_ops.py
   with the C compiler at hand, like decode_attention.c (GCC/Clang vector extensions, no intrinsics, VW
   floats per vector for the ISA the build targets), and with -ffp-contract=off: a product and a sum that
   torch rounds apart must not become one fused multiply-add. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef VW
#define VW 16
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));

static inline vf load_bf16(const uint16_t *p) {
    vh h; memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f; memcpy(&f, &u, sizeof f); return f;
}
/* fp32 -> bf16, round to nearest even (torch's rounding); a NaN stays a (quiet) NaN */
static inline vf round_bf16(vf f) {
    vu u; memcpy(&u, &f, sizeof u);
    vu r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    vu nan = (u & 0x7fffffffu) > 0x7f800000u;
    r = (r & ~nan) | ((u | 0x400000u) & 0xffff0000u & nan);
    vf o; memcpy(&o, &r, sizeof o); return o;
}
static inline void store_bf16(uint16_t *p, vf f) { /* f already rounded: its high halves */
    vu u; memcpy(&u, &f, sizeof u);
    vh h = __builtin_convertvector(u >> 16, vh);
    memcpy(p, &h, sizeof h);
}
static inline float bf16f(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float rbf(float f) { vf v = (vf){0} + f; return round_bf16(v)[0]; }
static inline uint16_t tobf(float rounded) { uint32_t u; memcpy(&u, &rounded, 4); return (uint16_t)(u >> 16); }

/* ---- the KV cache write ------------------------------------------------------------------------------
   Row r = b * heads + h of the new tokens is at ks/vs + b * src_stride + h * row_bytes (bytes: the QKV
   payload's slices, no copy) and goes to row at[r] of k/v. The cache rows are scattered over the whole
   cache and cold (torch's index_copy_ waited on each line in turn: 0.5-1 ms a layer at B = 256, 3-5x the
   same call on cached lines); prefetching the destinations PW rows ahead keeps that many misses in flight.
   The rows are split over the threads in equal runs, each core keeping its own misses in flight (one core
   took 0.9 ms a layer at B = 256 on two Zen 4 cores while the other waited). */
#define PW 16
static inline void prefetch_write(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 1);
}

/* rows [r0, r1) of the call: prefetch row r, write row r - PW */
static void kv_write_run(char *k, char *v, const char *ks, const char *vs, const int64_t *at, int64_t r0, int64_t r1,
                         int64_t heads, int64_t src_stride, int64_t row_bytes) {
    for (int64_t r = r0; r < r1 + PW; r++) {
        if (r < r1) {
            prefetch_write(k + at[r] * row_bytes, row_bytes);
            prefetch_write(v + at[r] * row_bytes, row_bytes);
        }
        if (r - PW >= r0) {
            const int64_t w = r - PW, src = (w / heads) * src_stride + (w % heads) * row_bytes;
            memcpy(k + at[w] * row_bytes, ks + src, row_bytes);
            memcpy(v + at[w] * row_bytes, vs + src, row_bytes);
        }
    }
}

void mlight_kv_write(char *k, char *v, const char *ks, const char *vs, const int64_t *at, int64_t n, int64_t heads,
                     int64_t src_stride, int64_t row_bytes, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 64)
    for (int j = 0; j < threads; j++)
        kv_write_run(k, v, ks, vs, at, n * j / threads, n * (j + 1) / threads, heads, src_stride, row_bytes);
}

/* The same from fp32 rows (the math of an AVX2 CPU) into a bf16 cache, each value rounded to nearest even. */
static void kv_write_narrow_run(uint16_t *k, uint16_t *v, const char *ks, const char *vs, const int64_t *at,
                                int64_t r0, int64_t r1, int64_t heads, int64_t src_stride, int64_t hd) {
    const int64_t row_bytes = 2 * hd;
    for (int64_t r = r0; r < r1 + PW; r++) {
        if (r < r1) {
            prefetch_write((const char *)(k + at[r] * hd), row_bytes);
            prefetch_write((const char *)(v + at[r] * hd), row_bytes);
        }
        if (r - PW >= r0) {
            const int64_t w = r - PW, src = (w / heads) * src_stride + (w % heads) * 4 * hd;
            const float *kr = (const float *)(ks + src), *vr = (const float *)(vs + src);
            uint16_t *kd = k + at[w] * hd, *vd = v + at[w] * hd;
            int64_t d = 0;
            for (; d + VW <= hd; d += VW) {
                vf a, b;
                memcpy(&a, kr + d, sizeof a);
                memcpy(&b, vr + d, sizeof b);
                store_bf16(kd + d, round_bf16(a));
                store_bf16(vd + d, round_bf16(b));
            }
            for (; d < hd; d++) {
                kd[d] = tobf(rbf(kr[d]));
                vd[d] = tobf(rbf(vr[d]));
            }
        }
    }
}

void mlight_kv_write_narrow(uint16_t *k, uint16_t *v, const char *ks, const char *vs, const int64_t *at, int64_t n,
                            int64_t heads, int64_t src_stride, int64_t hd, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 64)
    for (int j = 0; j < threads; j++)
        kv_write_narrow_run(k, v, ks, vs, at, n * j / threads, n * (j + 1) / threads, heads, src_stride, hd);
}

/* ---- RMSNorm ------------------------------------------------------------------------------------------
   core.model.layers.rms_norm: x32 = float(x); y = bf16(x32 * rsqrt(mean(x32²) + eps)); out = bf16(w * y).
   Rows of x and out are ldx / ldo elements apart. */
void mlight_rms_norm(const uint16_t *x, int64_t T, int64_t D, int64_t ldx, const uint16_t *w, float eps,
                     uint16_t *out, int64_t ldo, int threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T * D >= 32768)
#endif
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * ldx;
        uint16_t *o = out + t * ldo;
        const int64_t Dv = D - D % VW;
        vf acc = {0};
        for (int64_t d = 0; d < Dv; d += VW) {
            vf a = load_bf16(xr + d);
            acc += a * a;
        }
        float ss = 0.f;
        for (int j = 0; j < VW; j++) ss += acc[j];
        for (int64_t d = Dv; d < D; d++) ss += bf16f(xr[d]) * bf16f(xr[d]);
        const float r = 1.f / sqrtf(ss / (float)D + eps);
        for (int64_t d = 0; d < Dv; d += VW) {
            vf y = round_bf16(load_bf16(xr + d) * r);
            store_bf16(o + d, round_bf16(load_bf16(w + d) * y));
        }
        for (int64_t d = Dv; d < D; d++) o[d] = tobf(rbf(bf16f(w[d]) * rbf(bf16f(xr[d]) * r)));
    }
}

/* fp32: y = x * rsqrt(mean(x²) + eps); out = w * y (the same expression, nothing to round). */
void mlight_rms_norm_f32(const float *x, int64_t T, int64_t D, int64_t ldx, const float *w, float eps, float *out,
                         int64_t ldo, int threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T * D >= 32768)
#endif
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *o = out + t * ldo;
        const int64_t Dv = D - D % VW;
        vf acc = {0};
        for (int64_t d = 0; d < Dv; d += VW) {
            vf a;
            memcpy(&a, xr + d, sizeof a);
            acc += a * a;
        }
        float ss = 0.f;
        for (int j = 0; j < VW; j++) ss += acc[j];
        for (int64_t d = Dv; d < D; d++) ss += xr[d] * xr[d];
        const float r = 1.f / sqrtf(ss / (float)D + eps);
        for (int64_t d = 0; d < D; d++) o[d] = w[d] * (xr[d] * r);
    }
}

/* ---- RoPE (halves) joined with v ---------------------------------------------------------------------
   core.model.gqa.pre's fast path: for each token t the first `heads` heads of qkv (hd each) rotated by
   its cos/sin rows (hd each: the two halves' tables side by side) as core.model.rope.Rope.apply does it,
   x·cos + cat(-x[half:], x[:half])·sin with each product and the sum rounded to bf16, then the next
   `rest` elements (v) copied: out[t] = [rope(q, k heads) | v]. qkv rows ld_in apart, out rows ld_out. */
void mlight_rope_join(const uint16_t *qkv, int64_t T, int64_t ld_in, int64_t heads, int64_t hd,
                      const uint16_t *cos, const uint16_t *sin, int64_t ld_cs, int64_t rest, uint16_t *out,
                      int64_t ld_out, int threads) {
    const int64_t half = hd / 2;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T * heads * hd >= 32768)
#endif
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos + t * ld_cs, *s = sin + t * ld_cs;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *x = qkv + t * ld_in + h * hd;
            uint16_t *o = out + t * ld_out + h * hd;
            int64_t i = 0;
            if (half % VW == 0) {
                for (; i < half; i += VW) { /* first half: x·cos - x[i + half]·sin; second: x·cos + x[i - half]·sin */
                    vf x1 = load_bf16(x + i), x2 = load_bf16(x + i + half);
                    vf lo = round_bf16(round_bf16(x1 * load_bf16(c + i)) + round_bf16(-x2 * load_bf16(s + i)));
                    vf hi = round_bf16(round_bf16(x2 * load_bf16(c + i + half)) + round_bf16(x1 * load_bf16(s + i + half)));
                    store_bf16(o + i, lo);
                    store_bf16(o + i + half, hi);
                }
            }
            for (; i < half; i++) {
                const float x1 = bf16f(x[i]), x2 = bf16f(x[i + half]);
                o[i] = tobf(rbf(rbf(x1 * bf16f(c[i])) + rbf(-x2 * bf16f(s[i]))));
                o[i + half] = tobf(rbf(rbf(x2 * bf16f(c[i + half])) + rbf(x1 * bf16f(s[i + half]))));
            }
        }
        memcpy(out + t * ld_out + heads * hd, qkv + t * ld_in + heads * hd, 2 * rest);
    }
}

/* fp32: the same join, each product and the sum rounded to fp32 (no fused multiply-add: see the top). */
void mlight_rope_join_f32(const float *qkv, int64_t T, int64_t ld_in, int64_t heads, int64_t hd, const float *cos,
                          const float *sin, int64_t ld_cs, int64_t rest, float *out, int64_t ld_out, int threads) {
    const int64_t half = hd / 2;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T * heads * hd >= 32768)
#endif
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * ld_cs, *s = sin + t * ld_cs;
        for (int64_t h = 0; h < heads; h++) {
            const float *x = qkv + t * ld_in + h * hd;
            float *o = out + t * ld_out + h * hd;
            for (int64_t i = 0; i < half; i++) {
                const float lo_a = x[i] * c[i], lo_b = -x[i + half] * s[i];
                const float hi_a = x[i + half] * c[i + half], hi_b = x[i] * s[i + half];
                o[i] = lo_a + lo_b;
                o[i + half] = hi_a + hi_b;
            }
        }
        memcpy(out + t * ld_out + heads * hd, qkv + t * ld_in + heads * hd, 4 * rest);
    }
}

/* ---- the softmax router -------------------------------------------------------------------------------
   core.model.routing for the "softmax" kind: logits = F.linear(h, W) (in h's dtype: rounded to bf16 for bf16),
   p = softmax(float(logits)), the k largest p (ties to the lower id: torch's order), weights = p / Σ of the k
   when `norm`, times `scale` unless 1, rounded to h's dtype. The logit's sum runs in another order than
   oneDNN's, so a bf16 logit can land one step apart where its fp32 sum sits on a rounding boundary, and the
   softmax's exp is libm's: the weights agree with torch's to a unit of their last place and the ids wherever
   two probabilities are not within that of each other (tests/test_cpu_row_ops.py). h [T, D] rows ldh apart and
   W [E, D] contiguous, both bf16 (bf 1) or both fp32; weights [T, k] out in their dtype, ids [T, k] int64.
   Returns -1 for more than ROUTE_MAX experts. */
#define ROUTE_MAX 512
int mlight_softmax_route(const void *h, int bf, int64_t T, int64_t D, int64_t ldh, const void *W, int64_t E, int k,
                         int norm, float scale, void *wout, int64_t *iout) {
    if (E > ROUTE_MAX || k < 1 || k > E) return -1;
    const int64_t Dv = D - D % VW;
    for (int64_t t = 0; t < T; t++) {
        float p[ROUTE_MAX], top = -INFINITY, sum = 0.f;
        for (int64_t e = 0; e < E; e++) {
            vf acc = {0};
            float l = 0.f;
            if (bf) {
                const uint16_t *x = (const uint16_t *)h + t * ldh, *w = (const uint16_t *)W + e * D;
                for (int64_t d = 0; d < Dv; d += VW) acc += load_bf16(x + d) * load_bf16(w + d);
                for (int j = 0; j < VW; j++) l += acc[j];
                for (int64_t d = Dv; d < D; d++) l += bf16f(x[d]) * bf16f(w[d]);
                l = rbf(l);
            } else {
                const float *x = (const float *)h + t * ldh, *w = (const float *)W + e * D;
                for (int64_t d = 0; d < Dv; d += VW) {
                    vf a, b;
                    memcpy(&a, x + d, sizeof a), memcpy(&b, w + d, sizeof b);
                    acc += a * b;
                }
                for (int j = 0; j < VW; j++) l += acc[j];
                for (int64_t d = Dv; d < D; d++) l += x[d] * w[d];
            }
            p[e] = l, top = l > top ? l : top;
        }
        for (int64_t e = 0; e < E; e++) p[e] = expf(p[e] - top), sum += p[e];
        for (int64_t e = 0; e < E; e++) p[e] = p[e] / sum;
        int64_t *ids = iout + t * k;
        float chosen[ROUTE_MAX], total = 0.f;
        for (int j = 0; j < k; j++) { /* the j-th largest: the first id holding it among those not yet taken */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= ids[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            ids[j] = best, chosen[j] = p[best], total += p[best];
        }
        for (int j = 0; j < k; j++) {
            float v = norm ? chosen[j] / total : chosen[j];
            if (scale != 1.f) v = v * scale;
            if (bf) ((uint16_t *)wout)[t * k + j] = tobf(rbf(v));
            else ((float *)wout)[t * k + j] = v;
        }
    }
    return 0;
}

/* x += y over n bf16 values: torch's x.add_(y), an fp32 sum rounded to nearest even */
void mlight_add_bf16(uint16_t *x, const uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) store_bf16(x + i, round_bf16(load_bf16(x + i) + load_bf16(y + i)));
    for (; i < n; i++) x[i] = tobf(rbf(bf16f(x[i]) + bf16f(y[i])));
}

/* ---- a decode step's bound calls from one loop ----------------------------------------------------------
   core/runtime/one_stream binds a batch-1 step's ~100 kernel calls once. Made from Python, each cost 1.3 us of
   ctypes' argument conversion: the 784M Mixtral's Q4_K_M step at one Zen 5 thread took 5.4 ms that way, 5.2 from
   here. Here they run in order from C: a call is a kernel's address, its signature's
   index in SIGS (its arguments' C types, P pointer, I int64, C int, F float, then > and the return: v void, C
   int) and its arguments as int64 (a float as a double's bits); argument `live`, where >= 0, is read through its
   pointer at call time (the step's longest length); after a call with `end` >= 0 the clock goes to ends[end + 1]
   (ends[0]: the start); `phase` is the caller's. Returns 0, or 1 + the index of the first call a kernel refused. */
typedef struct { int64_t sig, fn, live, end, phase, a[24]; } Call;
static const char SIGS[] = "PIIIPFPIC>v PIIIIPPIIPIC>v PPPPPIIIIC>v PCIIIPICCFPP>C PCIPPCPPIIIIIIIFPCPI>C "
                           "PCIPPCPPPCIIIIIFPCPI>C CPCIIIPIIPCIPCC>C CCPCIIIICPPCPIIPIIPCIPCC>C PIIIPIPPIPC>v "
                           "PIIPPCIIIPIPIPPC>C PPI>v";
const char *mlight_call_sigs(void) { return SIGS; }

static inline double as_double(int64_t v) { double d; memcpy(&d, &v, 8); return d; }

#if defined(_OPENMP)
static double now(void) { return omp_get_wtime(); }
#elif defined(TIME_UTC) /* C11's clock, where the C library has it (not every MinGW's) */
static double now(void) {
    struct timespec t;
    timespec_get(&t, TIME_UTC);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#else
static double now(void) { return 0.0; } /* no wall clock: every phase reads the step's start */
#endif

#define P(i) ((void *)(intptr_t)a[i])
#define I(i) a[i]
#define C(i) ((int)a[i])
#define F(i) ((float)as_double(a[i]))
typedef void *p_;
typedef int64_t i_;
int mlight_run_calls(const Call *calls, int64_t n, double *ends) {
    ends[0] = now();
    for (int64_t j = 0; j < n; j++) {
        const Call *c = calls + j;
        int64_t a[24];
        memcpy(a, c->a, sizeof a);
        if (c->live >= 0) a[c->live] = *(const int64_t *)(intptr_t)a[c->live];
        int r = 0;
        switch (c->sig) {
        case 0: ((void (*)(p_, i_, i_, i_, p_, float, p_, i_, int))c->fn)(P(0), I(1), I(2), I(3), P(4), F(5), P(6), I(7), C(8)); break;
        case 1: ((void (*)(p_, i_, i_, i_, i_, p_, p_, i_, i_, p_, i_, int))c->fn)(P(0), I(1), I(2), I(3), I(4), P(5), P(6), I(7), I(8), P(9), I(10), C(11)); break;
        case 2: ((void (*)(p_, p_, p_, p_, p_, i_, i_, i_, i_, int))c->fn)(P(0), P(1), P(2), P(3), P(4), I(5), I(6), I(7), I(8), C(9)); break;
        case 3: r = ((int (*)(p_, int, i_, i_, i_, p_, i_, int, int, float, p_, p_))c->fn)(P(0), C(1), I(2), I(3), I(4), P(5), I(6), C(7), C(8), F(9), P(10), P(11)); break;
        case 4: r = ((int (*)(p_, int, i_, p_, p_, int, p_, p_, i_, i_, i_, i_, i_, i_, i_, float, p_, int, p_, i_))c->fn)(
                P(0), C(1), I(2), P(3), P(4), C(5), P(6), P(7), I(8), I(9), I(10), I(11), I(12), I(13), I(14), F(15), P(16), C(17), P(18), I(19)); break;
        case 5: r = ((int (*)(p_, int, i_, p_, p_, int, p_, p_, p_, int, i_, i_, i_, i_, i_, float, p_, int, p_, i_))c->fn)(
                P(0), C(1), I(2), P(3), P(4), C(5), P(6), P(7), P(8), C(9), I(10), I(11), I(12), I(13), I(14), F(15), P(16), C(17), P(18), I(19)); break;
        case 6: r = ((int (*)(int, p_, int, i_, i_, i_, p_, i_, i_, p_, int, i_, p_, int, int))c->fn)(
                C(0), P(1), C(2), I(3), I(4), I(5), P(6), I(7), I(8), P(9), C(10), I(11), P(12), C(13), C(14)); break;
        case 7: r = ((int (*)(int, int, p_, int, i_, i_, i_, i_, int, p_, p_, int, p_, i_, i_, p_, i_, i_, p_, int, i_, p_, int, int))c->fn)(
                C(0), C(1), P(2), C(3), I(4), I(5), I(6), I(7), C(8), P(9), P(10), C(11), P(12), I(13), I(14), P(15), I(16), I(17), P(18), C(19), I(20), P(21), C(22), C(23)); break;
        case 8: ((void (*)(p_, i_, i_, i_, p_, i_, p_, p_, i_, p_, int))c->fn)(P(0), I(1), I(2), I(3), P(4), I(5), P(6), P(7), I(8), P(9), C(10)); break;
        case 9: r = ((int (*)(p_, i_, i_, p_, p_, int, i_, i_, i_, p_, i_, p_, i_, p_, p_, int))c->fn)(
                P(0), I(1), I(2), P(3), P(4), C(5), I(6), I(7), I(8), P(9), I(10), P(11), I(12), P(13), P(14), C(15)); break;
        case 10: ((void (*)(p_, p_, i_))c->fn)(P(0), P(1), I(2)); break;
        default: r = -1;
        }
        if (r) return (int)j + 1;
        if (c->end >= 0) ends[c->end + 1] = now();
    }
    return 0;
}
#undef P
#undef I
#undef C
#undef F

int mlight_row_ops_vw(void) { return VW; }

int mlight_row_ops_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
