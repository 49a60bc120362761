/* GGUF block formats multiplied as the file stores them: y [M, N] = x [M, K] . W^T, W's rows the file's blocks.

   Before this kernel a GGUF expert was expanded into a float buffer on every use (core/model/quant/expand.py):
   ~190 M weights written and read back per token on the 784M test model. Here each weight row's blocks are
   decoded into a K-float row buffer of the thread's own (L1/L2-resident) and dotted at once with every
   activation row: the matrix is read once, at the file's bits, and never exists expanded.
   The decoders do the float32 arithmetic of `gguf.quants.dequantize` (core/model/quant/blocks.py): every
   product there is exact in float32 (an f16 scale times a small integer, or times a 6-bit scale and then a
   small integer), so the row buffer holds the reference's weights bit for bit, and only the dot's order of
   summation differs from torch's fp32 matmul (tests/test_gguf_native.py checks both): the fp32 path.

   The int8 path (llama.cpp's way; the caller's default for bf16 activations up to a row bound, but for the
   K-quants only in the one-token call: their int16 path below is finer and faster) quantizes
   each activation row once a call, per 32 values (scale max|x| / 127, round half to even, and the scale
   times each 16's sum for the formats with an offset), decodes a weight row into its integers (bytes), a
   float scale a 16 and an offset a 16 (w = scale * u - offset: the K-quants' mins, Q4_0's and Q6_K's
   centre), and dots bytes with bytes: `vpdpbusd` (AVX-512 VNNI, two blocks a 512-bit vector), `maddubs` +
   `madd` (AVX2), or plain C giving the same integers and, with the same float order (explicit FMAs, one
   lane order), the same floats. The result is the float64 product "quantized activations . the file's
   weights" up to fp32 summation.

   Layouts per block (bytes): see core/model/quant/blocks.py. kind: 0 Q8_0, 1 Q4_0, 2 Q4_K, 3 Q5_K, 4 Q6_K,
   5 MXFP4. Inputs bf16 or fp32, outputs bf16 (round to nearest even) or fp32. Plain C the compiler
   vectorises (-O3 with the ISA's flags: AVX-512, AVX2, or baseline), intrinsics for the int8 dots and two
   nibble unpackers (F16C for the half scales where built with -mf16c); OpenMP splits output rows over torch's
   threads when built with -fopenmp. Entry points return 0, or -1 for a call they do not take.
   `mlight_gguf_moe` is one token's routed experts with SwiGLU in one call (decode at batch 1: the ~6 torch
   ops and two kernel calls an expert become one call a layer), gate/up and SiLU in float32. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SIMD 2
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD 1
#else
#define SIMD 0
#endif
#if SIMD || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef __FMA__
#define FMA(a, b, c) fmaf(a, b, c)
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif

#ifdef _OPENMP
#include <omp.h>
#define OMP(directive) _Pragma(#directive)
#define THREAD_ID() omp_get_thread_num()
#else
#define OMP(directive)
#define THREAD_ID() 0
#endif

#define L 32 /* accumulator lanes a row: one Q8_0 block, a K-quant sub-block */
#define MR 4 /* activation rows a pass over the decoded weight row */

static const int BS[6] = {32, 32, 256, 256, 256, 32};   /* values a block */
static const int TS[6] = {34, 18, 144, 176, 210, 17};   /* bytes a block */
static const float MX[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float bf16f(uint16_t x) { return bits_f((uint32_t)x << 16); }
static inline uint16_t f32bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
/* IEEE half -> float, exactly (subnormals included) */
#ifdef __F16C__
static inline float f16f(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }
#else
static inline float f16f(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) { float f = (float)m * 5.9604644775390625e-8f; uint32_t u; memcpy(&u, &f, 4); return bits_f(u | s); }
    if (e == 31) return bits_f(s | 0x7f800000 | (m << 13));
    return bits_f(s | ((e + 112) << 23) | (m << 13));
}
#endif

static inline void q8_0(const uint8_t *b, float *w) {
    float d = f16f(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) w[j] = (float)q[j] * d;
}

static inline void q4_0(const uint8_t *b, float *w) {
    float d = f16f(b);
    const uint8_t *q = b + 2;
    for (int j = 0; j < 16; j++) {
        w[j] = d * (float)((int)(q[j] & 15) - 8);
        w[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
    }
}

/* the 8 six-bit scales and mins of a Q4_K / Q5_K block as integers */
static inline void scales_k4(const uint8_t *b, int *sc, int *mn) {
    const uint8_t *s = b + 4;
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

/* the same times d and dmin */
static inline void scale_min_k4(const uint8_t *b, float *ds, float *dm) {
    float d = f16f(b), dmin = f16f(b + 2);
    int sc[8], mn[8];
    scales_k4(b, sc, mn);
    for (int j = 0; j < 8; j++) ds[j] = d * (float)sc[j], dm[j] = dmin * (float)mn[j];
}

static inline void q4_k(const uint8_t *b, float *w) {
    float ds[8], dm[8];
    scale_min_k4(b, ds, dm);
    const uint8_t *q = b + 16;
    for (int i = 0; i < 4; i++) /* 32 bytes: sub-block 2i in the low nibbles, 2i + 1 in the high */
        for (int j = 0; j < 32; j++) {
            w[64 * i + j] = ds[2 * i] * (float)(q[32 * i + j] & 15) - dm[2 * i];
            w[64 * i + 32 + j] = ds[2 * i + 1] * (float)(q[32 * i + j] >> 4) - dm[2 * i + 1];
        }
}

static inline void q5_k(const uint8_t *b, float *w) {
    float ds[8], dm[8];
    scale_min_k4(b, ds, dm);
    const uint8_t *qh = b + 16, *q = b + 48;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 32; j++) {
            int lo = (q[32 * i + j] & 15) | (((qh[j] >> (2 * i)) & 1) << 4);
            int hi = (q[32 * i + j] >> 4) | (((qh[j] >> (2 * i + 1)) & 1) << 4);
            w[64 * i + j] = ds[2 * i] * (float)lo - dm[2 * i];
            w[64 * i + 32 + j] = ds[2 * i + 1] * (float)hi - dm[2 * i + 1];
        }
}

static inline void q6_k(const uint8_t *b, float *w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16f(b + 208), ds[16];
    for (int j = 0; j < 16; j++) ds[j] = d * (float)sc[j];
    for (int h = 0; h < 2; h++) /* halves of 128 values: 64 ql bytes, 32 qh bytes */
        for (int s = 0; s < 4; s++) { /* sub-block 4h + s: nibble s / 2 of ql[64h + 32(s % 2) + j] */
            const uint8_t *l = ql + 64 * h + 32 * (s & 1), *hb = qh + 32 * h;
            float lo16 = ds[8 * h + 2 * s], hi16 = ds[8 * h + 2 * s + 1], *o = w + 128 * h + 32 * s;
            for (int j = 0; j < 32; j++) {
                int q = (((l[j] >> (4 * (s >> 1))) & 15) | (((hb[j] >> (2 * s)) & 3) << 4)) - 32;
                o[j] = (j < 16 ? lo16 : hi16) * (float)q;
            }
        }
}

/* 2^(e - 128) from its bits, as ggml (subnormal for e < 2) */
static inline float e8m0_half(uint8_t e) { return bits_f(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23); }

static inline void mxfp4(const uint8_t *b, float *w) {
    float d = e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) {
        w[j] = d * MX[b[1 + j] & 15];
        w[j + 16] = d * MX[b[1 + j] >> 4];
    }
}

/* one weight row's blocks into w [K]: a loop per kind, so that each decoder is inlined into its own */
#define ROW(f, bs, ts) for (int64_t b = 0; b < K / (bs); b++) f(row + b * (ts), w + b * (bs)); break
static void decode_row(int kind, const uint8_t *row, int64_t K, float *w) {
    switch (kind) {
    case 0: ROW(q8_0, 32, 34);
    case 1: ROW(q4_0, 32, 18);
    case 2: ROW(q4_k, 256, 144);
    case 3: ROW(q5_k, 256, 176);
    case 4: ROW(q6_k, 256, 210);
    default: ROW(mxfp4, 32, 17);
    }
}

/* out[m] = w . x[m] for MRC rows of x, ldx floats apart: MRC a constant, so the accumulators stay in registers
   (indexed by a variable row count they lived on the stack: a store and a load around every FMA) */
static inline __attribute__((always_inline)) void dot_n(const float *w, int64_t K, const float *x, int64_t ldx,
                                                        const int MRC, float *out) {
    float acc[MR][L] = {{0}};
    for (int64_t k = 0; k < K; k += L) {
        const float *wk = w + k;
        for (int m = 0; m < MRC; m++) {
            const float *xk = x + m * ldx + k;
            for (int j = 0; j < L; j++) acc[m][j] += wk[j] * xk[j];
        }
    }
    for (int m = 0; m < MRC; m++) {
        float t = 0;
        for (int j = 0; j < L; j++) t += acc[m][j];
        out[m] = t;
    }
}

/* out[m] = w . x[m] for mr (1..MR) rows of x */
static void dot_rows(const float *w, int64_t K, const float *x, int64_t ldx, int mr, float *out) {
    switch (mr) {
    case 1: dot_n(w, K, x, ldx, 1, out); break;
    case 2: dot_n(w, K, x, ldx, 2, out); break;
    case 3: dot_n(w, K, x, ldx, 3, out); break;
    default: dot_n(w, K, x, ldx, 4, out); break;
    }
}

/* ---- int8 activations ------------------------------------------------------------------------------ */

/* a quantized activation row: q [K], d [K/32] the scales, ds [K/16] each 16's scale times its sum of q */
typedef struct { int8_t *q; float *d, *ds; } QRow;

static inline float in_f(const void *x, int bf, int64_t i) {
    return bf ? bf16f(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

#if SIMD == 2
/* 16 activations from x + i as floats (bf16: the bits shifted into the high half, as bf16f) */
static inline __m512 in16(const void *x, int bf, int64_t i) {
    if (!bf) return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* the scalar quantizers' integers in 16 lanes: v · id rounded half to even (nearbyintf in the default mode),
   clamped to ±lim, exact as int32 */
static inline __m512i q16(__m512 v, float id, float lim) {
    __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm512_max_ps(_mm512_min_ps(t, _mm512_set1_ps(lim)), _mm512_set1_ps(-lim));
    return _mm512_cvttps_epi32(t);
}
#endif

/* with AVX-512 the activation quantizers run in 16 lanes (one value at a time they took a tenth of a Q4_K down
   projection's time at 16 rows): the same float operations (max, one division, products, round half to even,
   clamp) and integer sums as the plain C below, so the same bytes */
static void quantize_row_c(const void *x, int bf, int64_t K, QRow r);
static void quantize_row(const void *x, int bf, int64_t K, QRow r) {
#if SIMD == 2
    for (int64_t b = 0; b < K / 32; b++) {
        __m512 v0 = in16(x, bf, 32 * b), v1 = in16(x, bf, 32 * b + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        __m512i q0 = q16(v0, id, 127.f), q1 = q16(v1, id, 127.f);
        _mm_storeu_si128((__m128i *)(r.q + 32 * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(r.q + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
        r.d[b] = d, r.ds[2 * b] = d * (float)_mm512_reduce_add_epi32(q0);
        r.ds[2 * b + 1] = d * (float)_mm512_reduce_add_epi32(q1);
    }
#else
    quantize_row_c(x, bf, K, r);
#endif
}

/* the same bytes one value at a time (the plain-C path's, and the reference the tests hold the SIMD one to) */
static void quantize_row_c(const void *x, int bf, int64_t K, QRow r) {
    for (int64_t b = 0; b < K / 32; b++) {
        float v[32], amax = 0;
        for (int j = 0; j < 32; j++) v[j] = in_f(x, bf, 32 * b + j), amax = fmaxf(amax, fabsf(v[j]));
        float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int s[2] = {0, 0};
        for (int j = 0; j < 32; j++) {
            float t = nearbyintf(v[j] * id);
            int q = t > 127.f ? 127 : t < -127.f ? -127 : (int)t;
            r.q[32 * b + j] = (int8_t)q;
            s[j >> 4] += q;
        }
        r.d[b] = d, r.ds[2 * b] = d * (float)s[0], r.ds[2 * b + 1] = d * (float)s[1];
    }
}

/* formats whose integers are signed (dotted by the sign trick), and those with an offset */
static const int SIGNED[6] = {1, 0, 0, 0, 0, 1};
static const int OFFSET[6] = {0, 1, 1, 1, 1, 0};

/* a decoded weight row: u [K] bytes, s [K/16] scales, o [K/16] offsets: w = s * u - o */
typedef struct { uint8_t *u; float *s, *o; } WRow;

static inline void i8_q8_0(const uint8_t *b, uint8_t *u, float *s, float *o) {
    (void)o;
    memcpy(u, b + 2, 32);
    s[0] = s[1] = f16f(b);
}

static inline void i8_q4_0(const uint8_t *b, uint8_t *u, float *s, float *o) {
    float d = f16f(b);
#if SIMD
    __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), f = _mm_set1_epi8(15);
    _mm_storeu_si128((__m128i *)u, _mm_and_si128(q, f));
    _mm_storeu_si128((__m128i *)(u + 16), _mm_and_si128(_mm_srli_epi16(q, 4), f));
#else
    for (int j = 0; j < 16; j++) u[j] = b[2 + j] & 15, u[j + 16] = b[2 + j] >> 4;
#endif
    s[0] = s[1] = d, o[0] = o[1] = 8.f * d;
}

static inline void i8_q4_k(const uint8_t *b, uint8_t *u, float *s, float *o) {
    float ds[8], dm[8];
    scale_min_k4(b, ds, dm);
    const uint8_t *q = b + 16;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 32; j++) u[64 * i + j] = q[32 * i + j] & 15, u[64 * i + 32 + j] = q[32 * i + j] >> 4;
    for (int j = 0; j < 8; j++) s[2 * j] = s[2 * j + 1] = ds[j], o[2 * j] = o[2 * j + 1] = dm[j];
}

static inline void i8_q5_k(const uint8_t *b, uint8_t *u, float *s, float *o) {
    float ds[8], dm[8];
    scale_min_k4(b, ds, dm);
    const uint8_t *qh = b + 16, *q = b + 48;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 32; j++) {
            u[64 * i + j] = (q[32 * i + j] & 15) | (((qh[j] >> (2 * i)) & 1) << 4);
            u[64 * i + 32 + j] = (q[32 * i + j] >> 4) | (((qh[j] >> (2 * i + 1)) & 1) << 4);
        }
    for (int j = 0; j < 8; j++) s[2 * j] = s[2 * j + 1] = ds[j], o[2 * j] = o[2 * j + 1] = dm[j];
}

static inline void i8_q6_k(const uint8_t *b, uint8_t *u, float *s, float *o) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16f(b + 208);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++) {
            const uint8_t *l = ql + 64 * h + 32 * (t & 1), *hb = qh + 32 * h;
            for (int j = 0; j < 32; j++)
                u[128 * h + 32 * t + j] = ((l[j] >> (4 * (t >> 1))) & 15) | (((hb[j] >> (2 * t)) & 3) << 4);
        }
    /* 16-value group g = 8h + 2t + (j >= 16) has scale d * sc[g], as in q6_k above */
    for (int g = 0; g < 16; g++) s[g] = d * (float)sc[g], o[g] = 32.f * s[g];
}

static inline void i8_mxfp4(const uint8_t *b, uint8_t *u, float *s, float *o) {
    (void)o;
    static const int8_t MXI[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}; /* MX as integers */
#if SIMD /* the 16-entry table in one shuffle */
    __m128i t = _mm_loadu_si128((const __m128i *)MXI), q = _mm_loadu_si128((const __m128i *)(b + 1));
    __m128i f = _mm_set1_epi8(15);
    _mm_storeu_si128((__m128i *)u, _mm_shuffle_epi8(t, _mm_and_si128(q, f)));
    _mm_storeu_si128((__m128i *)(u + 16), _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(q, 4), f)));
#else
    for (int j = 0; j < 16; j++) u[j] = (uint8_t)MXI[b[1 + j] & 15], u[j + 16] = (uint8_t)MXI[b[1 + j] >> 4];
#endif
    s[0] = s[1] = e8m0_half(b[0]);
}

#define IROW(f, bs, ts) \
    for (int64_t b = 0; b < K / (bs); b++)                                                        \
        f(row + b * (ts), r.u + b * (bs), r.s + b * (bs) / 16, r.o + b * (bs) / 16);             \
    break
static void decode_row_i8(int kind, const uint8_t *row, int64_t K, WRow r) {
    switch (kind) {
    case 0: IROW(i8_q8_0, 32, 34);
    case 1: IROW(i8_q4_0, 32, 18);
    case 2: IROW(i8_q4_k, 256, 144);
    case 3: IROW(i8_q5_k, 256, 176);
    case 4: IROW(i8_q6_k, 256, 210);
    default: IROW(i8_mxfp4, 32, 17);
    }
}

/* Σ o[h] · ds[h]: the offsets' share, in 16 independent lanes (vectorised by the compiler) summed in a fixed
   order; one function for every path, so all give the same float */
static __attribute__((noinline)) float offset_dot(const float *o, const float *ds, int64_t n) {
    float t[16] = {0};
    int64_t h = 0;
    for (; h + 16 <= n; h += 16)
        for (int j = 0; j < 16; j++) t[j] = FMA(o[h + j], ds[h + j], t[j]);
    for (int j = 0; h + j < n; j++) t[j] = FMA(o[h + j], ds[h + j], t[j]);
    for (int j = 0; j < 8; j++) t[j] += t[j + 8];
    for (int j = 0; j < 4; j++) t[j] += t[j + 4];
    return (t[0] + t[2]) + (t[1] + t[3]);
}

/* out[m] = Σ_b Σ_lane (s · d_m,b) · (integer dot of 4 bytes), for MRC rows of x: 16 float lanes, lane
   8 (b % 2) + i holding bytes 4i..4i + 3 of 32-block b (a 512-bit vector: two blocks), summed at the end as
   lane i + lane i + 8, then (c0 + c4 + c2 + c6) + (c1 + c5 + c3 + c7): one order for every path */
static inline __attribute__((always_inline)) void tile_scalar(WRow w, int64_t K, const QRow *x, const int sgn,
                                                              const int MRC, float *out) {
    float acc[MR][16] = {{0}};
    for (int64_t b = 0; b < K / 32; b++)
        for (int m = 0; m < MRC; m++) {
            float d = x[m].d[b], *a = acc[m] + 8 * (b & 1);
            for (int i = 0; i < 8; i++) {
                int t = 0;
                for (int j = 0; j < 4; j++) {
                    int64_t k = 32 * b + 4 * i + j;
                    t += (sgn ? (int)(int8_t)w.u[k] : (int)w.u[k]) * (int)x[m].q[k];
                }
                a[i] = FMA((float)t, w.s[2 * b + (i >> 2)] * d, a[i]);
            }
        }
    for (int m = 0; m < MRC; m++) {
        float c[8];
        for (int i = 0; i < 8; i++) c[i] = acc[m][i] + acc[m][i + 8];
        float e0 = c[0] + c[4], e1 = c[1] + c[5], e2 = c[2] + c[6], e3 = c[3] + c[7];
        out[m] = (e0 + e2) + (e1 + e3);
    }
}

#if SIMD
/* 8 int32 lanes, lane i the dot of bytes 4i..4i + 3: u unsigned, x signed */
static inline __m256i dot32(__m256i u, __m256i x) {
#if SIMD == 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)); /* no pair exceeds 2·128·127 */
#endif
}

static inline float hsum8(__m256 v) {
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 e = _mm_add_ps(c, _mm_movehl_ps(c, c)); /* e0 + e2, e1 + e3 */
    return _mm_cvtss_f32(_mm_add_ss(e, _mm_movehdup_ps(e)));
}

#if SIMD == 2
static inline __attribute__((always_inline)) void tile_simd(WRow w, int64_t K, const QRow *x, const int sgn,
                                                            const int MRC, float *out) {
    __m512 acc[MR];
    for (int m = 0; m < MRC; m++) acc[m] = _mm512_setzero_ps();
    const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i oct = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    int64_t b = 0;
    for (; b + 2 <= K / 32; b += 2) {
        __m512i v = _mm512_loadu_si512(w.u + 32 * b), a = sgn ? _mm512_abs_epi8(v) : v;
        __mmask64 neg = sgn ? _mm512_movepi8_mask(v) : 0;
        __m512 s = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_loadu_ps(w.s + 2 * b)));
        for (int m = 0; m < MRC; m++) {
            __m512i q = _mm512_loadu_si512(x[m].q + 32 * b);
            if (sgn) q = _mm512_mask_sub_epi8(q, neg, _mm512_setzero_si512(), q);
            __m512 d = _mm512_permutexvar_ps(
                oct, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(x[m].d + b)))));
            __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a, q));
            acc[m] = _mm512_fmadd_ps(f, _mm512_mul_ps(s, d), acc[m]);
        }
    }
    for (int m = 0; m < MRC; m++) {
        __m256 lo = _mm512_castps512_ps256(acc[m]), hi = _mm512_extractf32x8_ps(acc[m], 1);
        if (b < K / 32) { /* an odd block count: the last block is even, the low lanes' */
            __m256i v = _mm256_loadu_si256((const __m256i *)(w.u + 32 * b)), a = sgn ? _mm256_abs_epi8(v) : v;
            const __m256i half = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
            __m256 s = _mm256_permutevar8x32_ps(
                _mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(w.s + 2 * b)))), half);
            __m256i q = _mm256_loadu_si256((const __m256i *)(x[m].q + 32 * b));
            if (sgn) q = _mm256_sign_epi8(q, v);
            lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(a, q)), _mm256_mul_ps(s, _mm256_set1_ps(x[m].d[b])), lo);
        }
        out[m] = hsum8(_mm256_add_ps(lo, hi));
    }
}
#else
static inline __attribute__((always_inline)) void tile_simd(WRow w, int64_t K, const QRow *x, const int sgn,
                                                            const int MRC, float *out) {
    const __m256i half = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
    __m256 acc[MR][2];
    for (int m = 0; m < MRC; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w.u + 32 * b)), a = sgn ? _mm256_abs_epi8(v) : v;
        __m256 s = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(w.s + 2 * b)))), half);
        for (int m = 0; m < MRC; m++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(x[m].q + 32 * b));
            if (sgn) q = _mm256_sign_epi8(q, v);
            __m256 f = _mm256_cvtepi32_ps(dot32(a, q));
            acc[m][b & 1] = _mm256_fmadd_ps(f, _mm256_mul_ps(s, _mm256_set1_ps(x[m].d[b])), acc[m][b & 1]);
        }
    }
    for (int m = 0; m < MRC; m++) out[m] = hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));
}
#endif
#endif

#if SIMD == 2
/* out[r * MR + m] = w_r . x[m] for two decoded weight rows and MRC (1..MR) activation rows: tile_simd's integers,
   floats and order, with each activation load and scale serving both weight rows and each weight load every row.
   Signed weights (sgn) take the activations as unsigned bytes q + 128 (see flip_row) against the weights' own
   signed bytes, each lane starting from -128 · its Σ w: the int32 sums of |w| · (q · sign w) without a sign fix
   per activation row */
static inline __attribute__((always_inline)) void tile2_simd(const WRow *w, int64_t K, const QRow *x, const int sgn,
                                                             const int MRC, float *out) {
    __m512 acc[2][MR];
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < MRC; m++) acc[r][m] = _mm512_setzero_ps();
    const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i oct = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i k128 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    int64_t b = 0;
    for (; b + 2 <= K / 32; b += 2) {
        __m512i v[2], c[2];
        __m512 s[2];
        for (int r = 0; r < 2; r++) {
            v[r] = _mm512_loadu_si512(w[r].u + 32 * b);
            c[r] = sgn ? _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, k128, v[r])) : zero;
            s[r] = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_loadu_ps(w[r].s + 2 * b)));
        }
        for (int m = 0; m < MRC; m++) {
            __m512i q = _mm512_loadu_si512(x[m].q + 32 * b);
            __m512 d = _mm512_permutexvar_ps(
                oct, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(x[m].d + b)))));
            for (int r = 0; r < 2; r++) {
                __m512i t = sgn ? _mm512_dpbusd_epi32(c[r], q, v[r]) : _mm512_dpbusd_epi32(zero, v[r], q);
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(s[r], d), acc[r][m]);
            }
        }
    }
    const __m256i half = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < MRC; m++) {
            __m256 lo = _mm512_castps512_ps256(acc[r][m]), hi = _mm512_extractf32x8_ps(acc[r][m], 1);
            if (b < K / 32) { /* an odd block count: the last block is even, the low lanes' */
                __m256i v = _mm256_loadu_si256((const __m256i *)(w[r].u + 32 * b));
                __m256i q = _mm256_loadu_si256((const __m256i *)(x[m].q + 32 * b)), t;
                if (sgn) {
                    __m256i c = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), v);
                    t = _mm256_dpbusd_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), c), q, v);
                } else t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), v, q);
                __m256 s = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(w[r].s + 2 * b)))), half);
                lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(s, _mm256_set1_ps(x[m].d[b])), lo);
            }
            out[r * MR + m] = hsum8(_mm256_add_ps(lo, hi));
        }
}

/* out [2][MR]: two weight rows against mr (1..MR) activation rows, their offsets' share subtracted */
static void dot_pair_i8(int kind, const WRow *w, int64_t K, const QRow *x, int mr, float *out) {
    int sgn = SIGNED[kind];
    switch (mr) {
    case 1: sgn ? tile2_simd(w, K, x, 1, 1, out) : tile2_simd(w, K, x, 0, 1, out); break;
    case 2: sgn ? tile2_simd(w, K, x, 1, 2, out) : tile2_simd(w, K, x, 0, 2, out); break;
    case 3: sgn ? tile2_simd(w, K, x, 1, 3, out) : tile2_simd(w, K, x, 0, 3, out); break;
    default: sgn ? tile2_simd(w, K, x, 1, 4, out) : tile2_simd(w, K, x, 0, 4, out); break;
    }
    if (OFFSET[kind])
        for (int r = 0; r < 2; r++)
            for (int m = 0; m < mr; m++) out[r * MR + m] -= offset_dot(w[r].o, x[m].ds, K / 16);
}

/* an activation row's int8 values as the unsigned bytes q + 128 that tile2_simd takes for signed weights */
static void flip_row(QRow r, int64_t K) {
    const __m512i k128 = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k + 64 <= K; k += 64)
        _mm512_storeu_si512(r.q + k, _mm512_xor_si512(_mm512_loadu_si512(r.q + k), k128));
    for (int64_t k = K & ~(int64_t)63; k < K; k++) r.q[k] = (int8_t)((uint8_t)r.q[k] ^ 0x80);
}
#endif

/* out[m] = w . x[m] for mr (1..MR) quantized rows, tile f specialised on the flag and the row count */
#define TILES(f, flag)                                                         \
    switch (mr) {                                                              \
    case 1: flag ? f(w, K, x, 1, 1, out) : f(w, K, x, 0, 1, out); break;     \
    case 2: flag ? f(w, K, x, 1, 2, out) : f(w, K, x, 0, 2, out); break;     \
    case 3: flag ? f(w, K, x, 1, 3, out) : f(w, K, x, 0, 3, out); break;     \
    default: flag ? f(w, K, x, 1, 4, out) : f(w, K, x, 0, 4, out); break;    \
    }
/* simd 0: the plain-C integers */
static void dot_rows_i8(int kind, WRow w, int64_t K, const QRow *x, int mr, int simd, float *out) {
    int sgn = SIGNED[kind];
#if SIMD
    if (simd) {
        TILES(tile_simd, sgn)
    } else
#endif
    {
        (void)simd;
        TILES(tile_scalar, sgn)
    }
    if (OFFSET[kind])
        for (int m = 0; m < mr; m++) out[m] -= offset_dot(w.o, x[m].ds, K / 16);
}

/* ---- K-quants on int16 activations, one scale a 256 --------------------------------------------------
   With a scale a 32 every sub-block's integer dot becomes a float (a scale product and an FMA a sub-block
   and row): at 8+ rows that float work costs what the fp32 path's FMAs do. With one activation scale a
   super-block the whole super-block's dot can stay an integer, but one int8 scale over 256 values (llama.cpp's
   Q8_K) is coarse: on the test models it took the logits' median error from 1.3 % to 2.6-2.8 % of their
   spread, past the bound (2.1 % with Q8_K on the experts' matrices only; at one token it ran no faster than
   this path's in-place kernel, core/assets/kernels/gguf_token.c, so it was removed). So the activations are int16 per 256 (scale max|x| / 16383: about 14 bits, finer than int8
   per 32) and the weights decode to int16 with their integer sub-scales folded in (sc · u; Q6_K's
   sc · (u - 32)): one vpdpwssd (AVX-512 VNNI) or madd + add (AVX2) a 32 or 16 values, exact in int32 across
   the super-block (Q6_K: |w| <= 4096, 32 products a lane <= 2^31 - 2^17), and the mins of Q4_K / Q5_K as
   int32 sums of each 32 activations times the integer mins. Per 256 values and row there remain 8 int32
   lanes turned into floats and one FMA (Q6_K) or two. Lane i holds values 2i, 2i + 1 of every 16 (the
   512-bit vectors' halves added as integers, exactly), the mins' sub-block i; the lanes are summed at the
   end as hsum8 does. The SIMD path unpacks the int16 weights in registers (k16_tile, k16_wide below), the
   plain C decodes a row into a buffer (decode_row_k, ktile_scalar): the same integers and floats. */

#define Q16 16383.f /* the activations' integer range: Q6_K's 32 products a lane stay in int32 */

/* a quantized activation row: q [K], bs [K/32] each 32's sum of q, d [K/256] the scales */
typedef struct { int16_t *q; int32_t *bs; float *d; } KQRow;
/* a decoded weight row: w [K] integers with their sub-scales (Q4_K, Q5_K: sc · u; Q6_K: sc · (u - 32)), mn
   [K/32] each sub-block's integer min (Q6_K: none), d and dm [K/256] the super-block's d and dmin: the weight
   is d · w - dm · mn */
typedef struct { int16_t *w; int32_t *mn; float *d, *dm; } KWRow;

static void quantize_row_k_c(const void *x, int bf, int64_t K, KQRow r);
static void quantize_row_k(const void *x, int bf, int64_t K, KQRow r) {
#if SIMD == 2
    for (int64_t b = 0; b < K / 256; b++) {
        __m512 v[16], m = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++) v[i] = in16(x, bf, 256 * b + 16 * i), m = _mm512_max_ps(m, _mm512_abs_ps(v[i]));
        float amax = _mm512_reduce_max_ps(m);
        float d = amax / Q16, id = d != 0.f ? 1.f / d : 0.f;
        for (int g = 0; g < 8; g++) {
            __m512i q0 = q16(v[2 * g], id, Q16), q1 = q16(v[2 * g + 1], id, Q16);
            _mm256_storeu_si256((__m256i *)(r.q + 256 * b + 32 * g), _mm512_cvtepi32_epi16(q0));
            _mm256_storeu_si256((__m256i *)(r.q + 256 * b + 32 * g + 16), _mm512_cvtepi32_epi16(q1));
            r.bs[8 * b + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
        r.d[b] = d;
    }
#else
    quantize_row_k_c(x, bf, K, r);
#endif
}

static void quantize_row_k_c(const void *x, int bf, int64_t K, KQRow r) {
    for (int64_t b = 0; b < K / 256; b++) {
        float amax = 0;
        for (int j = 0; j < 256; j++) amax = fmaxf(amax, fabsf(in_f(x, bf, 256 * b + j)));
        float d = amax / Q16, id = d != 0.f ? 1.f / d : 0.f;
        for (int g = 0; g < 8; g++) {
            int s = 0;
            for (int j = 0; j < 32; j++) {
                int64_t k = 256 * b + 32 * g + j;
                float t = nearbyintf(in_f(x, bf, k) * id);
                int q = t > Q16 ? (int)Q16 : t < -Q16 ? -(int)Q16 : (int)t;
                r.q[k] = (int16_t)q;
                s += q;
            }
            r.bs[8 * b + g] = s;
        }
        r.d[b] = d;
    }
}

/* Q4_K / Q5_K: each 32-value sub-block's quants times its 6-bit scale, and its 6-bit min, as integers */
static inline void k_scaled(const uint8_t *u, const int *sc, const int *m, int16_t *w, int32_t *mn) {
    for (int j = 0; j < 8; j++) {
        for (int t = 0; t < 32; t++) w[32 * j + t] = (int16_t)(sc[j] * u[32 * j + t]);
        mn[j] = m[j];
    }
}

static inline void k_q4_k(const uint8_t *b, int16_t *w, int32_t *mn, float *d, float *dm) {
    uint8_t u[256];
    int sc[8], m[8];
    scales_k4(b, sc, m);
    const uint8_t *q = b + 16;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 32; j++) u[64 * i + j] = q[32 * i + j] & 15, u[64 * i + 32 + j] = q[32 * i + j] >> 4;
    k_scaled(u, sc, m, w, mn);
    *d = f16f(b), *dm = f16f(b + 2);
}

static inline void k_q5_k(const uint8_t *b, int16_t *w, int32_t *mn, float *d, float *dm) {
    uint8_t u[256];
    float s[16], o[16];
    int sc[8], m[8];
    i8_q5_k(b, u, s, o);
    scales_k4(b, sc, m);
    k_scaled(u, sc, m, w, mn);
    *d = f16f(b), *dm = f16f(b + 2);
}

static inline void k_q6_k(const uint8_t *b, int16_t *w, int32_t *mn, float *d, float *dm) {
    uint8_t u[256];
    float s[16], o[16];
    i8_q6_k(b, u, s, o);
    const int8_t *c = (const int8_t *)(b + 192);
    for (int g = 0; g < 16; g++)
        for (int t = 0; t < 16; t++) w[16 * g + t] = (int16_t)(c[g] * ((int)u[16 * g + t] - 32));
    for (int j = 0; j < 8; j++) mn[j] = 0;
    *d = f16f(b + 208), *dm = 0.f;
}

#define KROW(f)                                                                                        \
    for (int64_t b = 0; b < K / 256; b++) f(row + b * TS[kind], r.w + 256 * b, r.mn + 8 * b, r.d + b, r.dm + b); \
    break
static void decode_row_k(int kind, const uint8_t *row, int64_t K, KWRow r) {
    switch (kind) {
    case 2: KROW(k_q4_k);
    case 3: KROW(k_q5_k);
    default: KROW(k_q6_k);
    }
}

static inline float hsum8_c(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* out[m] = w . x[m] for MRC rows; mins: Q4_K, Q5_K */
static inline __attribute__((always_inline)) void ktile_scalar(KWRow w, int64_t K, const KQRow *x, const int mins,
                                                               const int MRC, float *out) {
    float acc[MR][8] = {{0}};
    for (int64_t b = 0; b < K / 256; b++)
        for (int m = 0; m < MRC; m++) {
            const int16_t *wb = w.w + 256 * b, *q = x[m].q + 256 * b;
            int32_t s[8] = {0};
            for (int k = 0; k < 256; k++) s[(k >> 1) & 7] += wb[k] * q[k];
            float dx = x[m].d[b], sd = w.d[b] * dx, sm = w.dm[b] * dx;
            for (int i = 0; i < 8; i++) {
                acc[m][i] = FMA((float)s[i], sd, acc[m][i]);
                if (mins) acc[m][i] = FMA(-(float)(w.mn[8 * b + i] * x[m].bs[8 * b + i]), sm, acc[m][i]);
            }
        }
    for (int m = 0; m < MRC; m++) out[m] = hsum8_c(acc[m]);
}

#if SIMD
static inline __attribute__((always_inline)) void ktile_simd(KWRow w, int64_t K, const KQRow *x, const int mins,
                                                             const int MRC, float *out) {
    __m256 acc[MR];
    for (int m = 0; m < MRC; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 256; b++) {
        __m256i s[MR];
#if SIMD == 2
        __m512i t[MR];
        for (int m = 0; m < MRC; m++) t[m] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            int64_t k = 256 * b + 32 * j;
            __m512i v = _mm512_loadu_si512(w.w + k);
            for (int m = 0; m < MRC; m++) t[m] = _mm512_dpwssd_epi32(t[m], v, _mm512_loadu_si512(x[m].q + k));
        }
        for (int m = 0; m < MRC; m++)
            s[m] = _mm256_add_epi32(_mm512_castsi512_si256(t[m]), _mm512_extracti64x4_epi64(t[m], 1));
#else
        for (int m = 0; m < MRC; m++) s[m] = _mm256_setzero_si256();
        for (int j = 0; j < 16; j++) {
            int64_t k = 256 * b + 16 * j;
            __m256i v = _mm256_loadu_si256((const __m256i *)(w.w + k));
            for (int m = 0; m < MRC; m++)
                s[m] = _mm256_add_epi32(s[m], _mm256_madd_epi16(v, _mm256_loadu_si256((const __m256i *)(x[m].q + k))));
        }
#endif
        __m256i mn = _mm256_loadu_si256((const __m256i *)(w.mn + 8 * b));
        for (int m = 0; m < MRC; m++) {
            float dx = x[m].d[b];
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m]), _mm256_set1_ps(w.d[b] * dx), acc[m]);
            if (mins) {
                __m256i o = _mm256_mullo_epi32(mn, _mm256_loadu_si256((const __m256i *)(x[m].bs + 8 * b)));
                acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(w.dm[b] * dx), acc[m]);
            }
        }
    }
    for (int m = 0; m < MRC; m++) out[m] = hsum8(acc[m]);
}
#endif

static void dot_rows_k(int kind, KWRow w, int64_t K, const KQRow *x, int mr, int simd, float *out) {
    int mins = kind != 4;
#if SIMD
    if (simd) {
        TILES(ktile_simd, mins)
        return;
    }
#endif
    (void)simd;
    TILES(ktile_scalar, mins)
}

#if SIMD == 2
#define QMR 4  /* activation rows a k16_tile keeps in registers */
#define QW 64 /* rows one pass over a weight row takes (k16_wide's float lanes on the stack) */
#endif

/* a Q4_K / Q5_K block's 8 six-bit scales (bytes 0-7) and 8 mins (bytes 8-15), as ggml unpacks them */
static inline void sm_k4(const uint8_t *b, uint8_t *sm) {
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    uint32_t mins = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mins;
    u[0] &= 0x3f3f3f3f;
    memcpy(sm, u, 16);
}

#if SIMD == 2
/* the bytes of values 32j..32j + 31 of a super-block (unsigned: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) */
static inline __attribute__((always_inline)) __m256i u32_k(int kind, const uint8_t *blk, int j) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (kind == 4) { /* ql's nibble t / 2 of bytes 64h + 32(t % 2), qh's bits 2t, 2t + 1 of bytes 32h */
        int h = j >> 2, t = j & 3;
        __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (t & 1)));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        l = _mm256_and_si256(_mm256_srl_epi16(l, _mm_cvtsi32_si128(4 * (t >> 1))), m4);
        hb = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
        return _mm256_or_si256(l, _mm256_slli_epi16(hb, 4));
    }
    const uint8_t *q = blk + (kind == 2 ? 16 : 48) + 32 * (j >> 1);
    __m256i l = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)q), _mm_cvtsi32_si128(4 * (j & 1))), m4);
    if (kind == 2) return l;
    __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 16)); /* Q5_K: bit j of qh's bytes */
    hb = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
    return _mm256_or_si256(l, _mm256_slli_epi16(hb, 4));
}

/* 8 int32 lanes: a 512-bit vector's halves added */
static inline __m256i fold8(__m512i t) {
    return _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
}
#define IV __m512i /* the integer vector the dots accumulate in */
#define IV_ZERO _mm512_setzero_si512()
#endif

/* ---- the int16 path's arithmetic with the weights unpacked in registers ----------------------------------
   The same integers and floats as decode_row_k + ktile_simd (int16 activations a 256, the weights int16 with
   their sub-scales folded in, lane i holding values 2i, 2i + 1 of every 16), without the decoded row: each
   32 values' bytes (u32_k) widened to int16 and multiplied by their sub-scale in registers, once per tile of
   rows (or, past a tile's registers, once per super-block for all the rows, all of them in one pass, two weight rows
   at once: 1.03-1.16x one at 8-64 rows, each activation load serving both). AVX-512 VNNI
   only: with AVX2's 16 registers (int16 a 16 values, the weights spilled past a tile) it ran 0.6-0.9x the
   decoded row for Q4_K, where it runs 1.15-1.35x at one row and about 1.0x at 8-64 on VNNI. */
#if SIMD == 2
/* a super-block's sub-scales as int16 (Q4_K, Q5_K: 8; Q6_K: 16), its 8 integer mins as int32, d and dmin */
static inline __attribute__((always_inline)) void k16_scales(int kind, const uint8_t *blk, int16_t *sc, __m256i *mn,
                                                             float *d, float *dm) {
    if (kind == 4) {
        _mm256_storeu_si256((__m256i *)sc, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))));
        *mn = _mm256_setzero_si256(), *d = f16f(blk + 208), *dm = 0.f;
    } else {
        uint8_t sm[16];
        sm_k4(blk, sm);
        _mm_storeu_si128((__m128i *)sc, _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sm)));
        *mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8)));
        *d = f16f(blk), *dm = f16f(blk + 2);
    }
}

static inline __attribute__((always_inline)) __m256 k16_lanes(int kind, __m256i s, const int32_t *bs, __m256i mn,
                                                              float d, float dm, float dx, __m256 acc) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * dx), acc);
    if (kind == 4) return acc;
    __m256i o = _mm256_mullo_epi32(mn, _mm256_loadu_si256((const __m256i *)bs));
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(dm * dx), acc);
}

#define KN 8 /* weight vectors a super-block: 32 int16 each */
static inline __attribute__((always_inline)) __m512i k16_w(int kind, const uint8_t *blk, const int16_t *sc, int j) {
    __m512i w = _mm512_cvtepu8_epi16(u32_k(kind, blk, j)), s;
    if (kind == 4) {
        w = _mm512_sub_epi16(w, _mm512_set1_epi16(32));
        s = _mm512_inserti64x4(_mm512_set1_epi16(sc[2 * j]), _mm256_set1_epi16(sc[2 * j + 1]), 1);
    } else s = _mm512_set1_epi16(sc[j]);
    return _mm512_mullo_epi16(w, s);
}
static inline __attribute__((always_inline)) __m512i k16_dot(__m512i t, __m512i w, const int16_t *q) {
    return _mm512_dpwssd_epi32(t, w, _mm512_loadu_si512(q));
}

/* out[m] = w . x[m] for MRC rows of int16 activations, the weight row's blocks read in place */
static inline __attribute__((always_inline)) void k16_tile(int kind, const uint8_t *row, int64_t K, const KQRow *x,
                                                           const int MRC, float *out) {
    __m256 acc[QMR];
    for (int m = 0; m < MRC; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *blk = row + b * TS[kind];
        int16_t sc[16];
        __m256i mn;
        float d, dm;
        k16_scales(kind, blk, sc, &mn, &d, &dm);
        IV t[QMR];
        for (int m = 0; m < MRC; m++) t[m] = IV_ZERO;
        for (int j = 0; j < KN; j++) {
            IV w = k16_w(kind, blk, sc, j);
            for (int m = 0; m < MRC; m++) t[m] = k16_dot(t[m], w, x[m].q + 256 * b + (256 / KN) * j);
        }
        for (int m = 0; m < MRC; m++)
            acc[m] = k16_lanes(kind, fold8(t[m]), x[m].bs + 8 * b, mn, d, dm, x[m].d[b], acc[m]);
    }
    for (int m = 0; m < MRC; m++) out[m] = hsum8(acc[m]);
}

/* the same for mr (1..QW) rows, each super-block unpacked once for all of them, and NR (1, 2) weight rows ldw
   bytes apart at once (each activation load serving both): out [NR][QW] */
static inline __attribute__((always_inline)) void k16_wide(int kind, const uint8_t *row, int64_t ldw, const int NR,
                                                           int64_t K, const KQRow *x, int mr, float *out) {
    __m256 acc[2][QW];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < mr; m++) acc[r][m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 256; b++) {
        int16_t sc[2][16];
        __m256i mn[2];
        float d[2], dm[2];
        IV w[2][KN];
        for (int r = 0; r < NR; r++) {
            const uint8_t *blk = row + r * ldw + b * TS[kind];
            k16_scales(kind, blk, sc[r], mn + r, d + r, dm + r);
            for (int j = 0; j < KN; j++) w[r][j] = k16_w(kind, blk, sc[r], j);
        }
        for (int m = 0; m < mr; m++) {
            IV t[2] = {IV_ZERO, IV_ZERO};
            for (int j = 0; j < KN; j++) {
                IV q = _mm512_loadu_si512(x[m].q + 256 * b + (256 / KN) * j);
                for (int r = 0; r < NR; r++) t[r] = _mm512_dpwssd_epi32(t[r], w[r][j], q);
            }
            for (int r = 0; r < NR; r++)
                acc[r][m] = k16_lanes(kind, fold8(t[r]), x[m].bs + 8 * b, mn[r], d[r], dm[r], x[m].d[b], acc[r][m]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < mr; m++) out[r * QW + m] = hsum8(acc[r][m]);
}

/* two weight rows ldw bytes apart against mr (1..QW) rows, as k16_wide's NR = 2 computes them, with the two rows'
   8 float lanes side by side in one 512-bit vector (row 0 low, row 1 high): each lane's integers, products and
   FMAs are k16_lanes' own, in half the instructions (the per-super-block float work, not the dots, bounded it
   from 8 rows); out [2][QW] */
static inline __attribute__((always_inline)) void k16_pair(int kind, const uint8_t *row, int64_t ldw, int64_t K,
                                                           const KQRow *x, int mr, float *out) {
    __m512 acc[QW];
    for (int m = 0; m < mr; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 256; b++) {
        int16_t sc[2][16];
        __m256i mn[2];
        float d[2], dm[2];
        IV w[2][KN];
        for (int r = 0; r < 2; r++) {
            const uint8_t *blk = row + r * ldw + b * TS[kind];
            k16_scales(kind, blk, sc[r], mn + r, d + r, dm + r);
            for (int j = 0; j < KN; j++) w[r][j] = k16_w(kind, blk, sc[r], j);
        }
        const __m512 dd = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d[0])), _mm256_set1_ps(d[1]), 1);
        const __m512 ddm = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(dm[0])), _mm256_set1_ps(dm[1]), 1);
        const __m512i mn2 = _mm512_inserti64x4(_mm512_castsi256_si512(mn[0]), mn[1], 1);
        for (int m = 0; m < mr; m++) {
            /* four chains of dots (integer sums: the order is free), not two of the dot's latency each */
            IV t0 = IV_ZERO, t1 = IV_ZERO, u0 = IV_ZERO, u1 = IV_ZERO;
            const int16_t *q = x[m].q + 256 * b;
            for (int j = 0; j < KN; j += 2) {
                IV v = _mm512_loadu_si512(q + (256 / KN) * j), v2 = _mm512_loadu_si512(q + (256 / KN) * (j + 1));
                t0 = _mm512_dpwssd_epi32(t0, w[0][j], v);
                t1 = _mm512_dpwssd_epi32(t1, w[1][j], v);
                u0 = _mm512_dpwssd_epi32(u0, w[0][j + 1], v2);
                u1 = _mm512_dpwssd_epi32(u1, w[1][j + 1], v2);
            }
            t0 = _mm512_add_epi32(t0, u0), t1 = _mm512_add_epi32(t1, u1);
            /* [row 0's lanes 0-7 + 8-15 | row 1's]: fold8 of each */
            __m512i s = _mm512_add_epi32(_mm512_shuffle_i64x2(t0, t1, 0x44), _mm512_shuffle_i64x2(t0, t1, 0xee));
            __m512 dx = _mm512_set1_ps(x[m].d[b]);
            __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dd, dx), acc[m]);
            if (kind != 4) {
                __m512i bs = _mm512_broadcast_i32x8(_mm256_loadu_si256((const __m256i *)(x[m].bs + 8 * b)));
                a = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(mn2, bs)), _mm512_mul_ps(ddm, dx), a);
            }
            acc[m] = a;
        }
    }
    for (int m = 0; m < mr; m++) {
        out[m] = hsum8(_mm512_castps512_ps256(acc[m]));
        out[QW + m] = hsum8(_mm512_extractf32x8_ps(acc[m], 1));
    }
}

#define K16_ROWS(k)                                                                                     \
    switch (mr) {                                                                                      \
    case 1: k16_tile(k, row, K, x, 1, out); break;                                                     \
    case 2: k16_tile(k, row, K, x, 2, out); break;                                                     \
    case 3: k16_tile(k, row, K, x, 3, out); break;                                                     \
    case 4: k16_tile(k, row, K, x, 4, out); break;                                                     \
    default: k16_wide(k, row, 0, 1, K, x, mr, out); break;                                             \
    }
/* two weight rows (ldw bytes apart) against mr rows: out [2][QW] */
static void dot_pair_k16(int kind, const uint8_t *row, int64_t ldw, int64_t K, const KQRow *x, int mr, float *out) {
    switch (kind) {
    case 2: k16_pair(2, row, ldw, K, x, mr, out); break;
    case 3: k16_pair(3, row, ldw, K, x, mr, out); break;
    default: k16_pair(4, row, ldw, K, x, mr, out); break;
    }
}

/* out[m] = w . x[m] for mr (1..QW) int16 activation rows, w the weight row's blocks: up to 4 rows a tile in
   registers, more all at once */
static void dot_rows_k16(int kind, const uint8_t *row, int64_t K, const KQRow *x, int mr, float *out) {
    switch (kind) {
    case 2: K16_ROWS(2) break;
    case 3: K16_ROWS(3) break;
    default: K16_ROWS(4) break;
    }
}
#endif

static int64_t kwrow_bytes(int64_t K) { return (2 * K + 4 * (K / 32) + 8 * (K / 256) + 63) & ~(int64_t)63; }
static int64_t kqrow_bytes(int64_t K) { return (2 * K + 4 * (K / 32) + 4 * (K / 256) + 63) & ~(int64_t)63; }
static KWRow kwrow_at(uint8_t *p, int64_t K) {
    int32_t *mn = (int32_t *)(p + 2 * K);
    float *d = (float *)(mn + K / 32);
    KWRow r = {(int16_t *)p, mn, d, d + K / 256};
    return r;
}
static KQRow kqrow_at(uint8_t *p, int64_t K) {
    int32_t *bs = (int32_t *)(p + 2 * K);
    KQRow r = {(int16_t *)p, bs, (float *)(bs + K / 32)};
    return r;
}

/* bytes of a decoded weight row of K and of a quantized activation row of K, 64-byte multiples */
static int64_t wrow_bytes(int64_t K) { return (K + 2 * 4 * (K / 16) + 63) & ~(int64_t)63; }
static int64_t qrow_bytes(int64_t K) { return (K + 4 * (K / 32) + 4 * (K / 16) + 63) & ~(int64_t)63; }
static WRow wrow_at(uint8_t *p, int64_t K) { WRow r = {p, (float *)(p + K), (float *)(p + K) + K / 16}; return r; }
static QRow qrow_at(uint8_t *p, int64_t K) {
    QRow r = {(int8_t *)p, (float *)(p + K), (float *)(p + K) + K / 32};
    return r;
}

int mlight_gguf_simd(void) { return SIMD; }

int mlight_gguf_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* floats of scratch a call needs: x as fp32 (when bf16) and a decoded row per thread */
int64_t mlight_gguf_scratch(int64_t M, int64_t K, int threads) { return M * K + (int64_t)threads * K; }

static inline void put(void *y, int bf, int64_t i, float v) {
    if (bf) ((uint16_t *)y)[i] = f32bf(v);
    else ((float *)y)[i] = v;
}

/* activation row m of x quantized into scratch: per 32 values, or per 256 (k256) */
static void quantize_at(const void *x, int bf, int64_t ldx, int64_t m, int64_t K, uint8_t *p, int k256, int simd) {
    const void *r = bf ? (const void *)((const uint16_t *)x + m * ldx) : (const void *)((const float *)x + m * ldx);
    if (k256) (simd ? quantize_row_k : quantize_row_k_c)(r, bf, K, kqrow_at(p, K));
    else (simd ? quantize_row : quantize_row_c)(r, bf, K, qrow_at(p, K));
}

/* the int8 paths of mlight_gguf_linear; scratch: M quantized rows, then a decoded row per thread */
static void linear_i8(int kind, const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint8_t *w,
                      int64_t ldw, int64_t N, void *y, int y_bf16, int64_t ldy, uint8_t *scratch, int threads,
                      int simd, int k256) {
    int64_t qb = k256 ? kqrow_bytes(K) : qrow_bytes(K), wb = k256 ? kwrow_bytes(K) : wrow_bytes(K);
    uint8_t *rows = scratch + M * qb;
    int serial = M * K <= (1 << 14); /* a decode step's rows: quantized before the team starts, one barrier fewer */
    for (int64_t m = 0; serial && m < M; m++) quantize_at(x, x_bf16, ldx, m, K, scratch + m * qb, k256, simd);
    OMP(omp parallel num_threads(threads))
    {
        int t = THREAD_ID();
        if (!serial) {
            OMP(omp for schedule(static))
            for (int64_t m = 0; m < M; m++) quantize_at(x, x_bf16, ldx, m, K, scratch + m * qb, k256, simd);
        }
        uint8_t *own = rows + (int64_t)t * wb;
        WRow wr = wrow_at(own, K);
        KWRow kr = kwrow_at(own, K);
        QRow xr[MR];
        KQRow kx[MR];
        float out[MR];
#if SIMD == 2
        if (k256 && simd) { /* the weight rows read in place, QW activation rows a pass */
            KQRow kw[QW];
            float ow[2 * QW];
            OMP(omp for schedule(static))
            for (int64_t n2 = 0; n2 < (N + 1) / 2; n2++) /* weight rows in pairs where more than a tile of rows */
                for (int64_t m0 = 0; m0 < M; m0 += QW) {
                    int64_t n = 2 * n2;
                    int mr = M - m0 < QW ? (int)(M - m0) : QW, nr = N - n < 2 ? 1 : 2;
                    for (int m = 0; m < mr; m++) kw[m] = kqrow_at(scratch + (m0 + m) * qb, K);
                    if (mr > 4 && nr == 2) dot_pair_k16(kind, w + n * ldw, ldw, K, kw, mr, ow);
                    else
                        for (int r = 0; r < nr; r++) dot_rows_k16(kind, w + (n + r) * ldw, K, kw, mr, ow + r * QW);
                    for (int r = 0; r < nr; r++)
                        for (int m = 0; m < mr; m++) put(y, y_bf16, (m0 + m) * ldy + n + r, ow[r * QW + m]);
                }
        } else if (!k256 && simd && M > 1) { /* two decoded weight rows against MR activation rows a tile */
            WRow wp[2] = {wrow_at(rows + 2 * (int64_t)t * wb, K), wrow_at(rows + (2 * (int64_t)t + 1) * wb, K)};
            float op[2 * MR];
            if (SIGNED[kind]) {
                OMP(omp for schedule(static))
                for (int64_t m = 0; m < M; m++) flip_row(qrow_at(scratch + m * qb, K), K);
            }
            OMP(omp for schedule(static))
            for (int64_t n2 = 0; n2 < (N + 1) / 2; n2++) {
                int64_t n = 2 * n2;
                int nr = N - n < 2 ? 1 : 2;
                for (int r = 0; r < nr; r++) decode_row_i8(kind, w + (n + r) * ldw, K, wp[r]);
                if (nr == 1) wp[1] = wp[0]; /* an odd last row: computed twice, written once */
                for (int64_t m0 = 0; m0 < M; m0 += MR) {
                    int mr = M - m0 < MR ? (int)(M - m0) : MR;
                    for (int m = 0; m < mr; m++) xr[m] = qrow_at(scratch + (m0 + m) * qb, K);
                    dot_pair_i8(kind, wp, K, xr, mr, op);
                    for (int r = 0; r < nr; r++)
                        for (int m = 0; m < mr; m++) put(y, y_bf16, (m0 + m) * ldy + n + r, op[r * MR + m]);
                }
                wp[1] = wrow_at(rows + (2 * (int64_t)t + 1) * wb, K);
            }
        } else
#endif
        OMP(omp for schedule(static))
        for (int64_t n = 0; n < N; n++) {
            if (k256) decode_row_k(kind, w + n * ldw, K, kr);
            else decode_row_i8(kind, w + n * ldw, K, wr);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                int mr = M - m0 < MR ? (int)(M - m0) : MR;
                if (k256) {
                    for (int m = 0; m < mr; m++) kx[m] = kqrow_at(scratch + (m0 + m) * qb, K);
                    dot_rows_k(kind, kr, K, kx, mr, simd, out);
                } else {
                    for (int m = 0; m < mr; m++) xr[m] = qrow_at(scratch + (m0 + m) * qb, K);
                    dot_rows_i8(kind, wr, K, xr, mr, simd, out);
                }
                for (int m = 0; m < mr; m++) put(y, y_bf16, (m0 + m) * ldy + n, out[m]);
            }
        }
    }
}

/* y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) . W^T; W's rows ldw bytes apart from w. path: 0 fp32
   (rows decoded to floats), 1 int8 activations in plain C, 2 int8 with the build's SIMD dots; 3 and 4 the
   same with activations quantized per 256 (Q4_K, Q5_K, Q6_K only) */
int mlight_gguf_linear(int kind, const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint8_t *w,
                       int64_t ldw, int64_t N, void *y, int y_bf16, int64_t ldy, float *scratch, int threads,
                       int path) {
    if (kind < 0 || kind > 5 || K % BS[kind] || M < 1 || threads < 1 || path < 0 || path > 4) return -1;
    if (path > 2 && (kind < 2 || kind > 4)) return -1;
    if (path) {
        linear_i8(kind, x, x_bf16, ldx, M, K, w, ldw, N, y, y_bf16, ldy, (uint8_t *)scratch, threads, path % 2 == 0,
                  path > 2);
        return 0;
    }
    const float *xf = (const float *)x;
    int64_t lx = ldx;
    if (x_bf16) {
        float *t = scratch;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) t[m * K + k] = bf16f(((const uint16_t *)x)[m * ldx + k]);
        xf = t, lx = K;
    }
    float *rows = scratch + M * K;
    OMP(omp parallel num_threads(threads))
    {
        int t = THREAD_ID();
        float *wr = rows + (int64_t)t * K, out[MR];
        OMP(omp for schedule(static))
        for (int64_t n = 0; n < N; n++) {
            decode_row(kind, w + n * ldw, K, wr);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                int mr = M - m0 < MR ? (int)(M - m0) : MR;
                dot_rows(wr, K, xf + m0 * lx, lx, mr, out);
                for (int m = 0; m < mr; m++) put(y, y_bf16, (m0 + m) * ldy + n, out[m]);
            }
        }
    }
    return 0;
}

/* W's rows as numbers: out [N, K] (rows ldo apart) fp32, or bf16 rounded to nearest even (torch's cast), the
   fp32 path's decoded rows (`gguf.quants.dequantize`'s floats bit for bit); scratch: K floats a thread. For a
   caller that multiplies many rows by a dense GEMM: torch ops expanding the blocks took as long as the GEMM */
int mlight_gguf_dequantize(int kind, const uint8_t *w, int64_t ldw, int64_t N, int64_t K, void *out, int out_bf16,
                           int64_t ldo, float *scratch, int threads) {
    if (kind < 0 || kind > 5 || K % BS[kind] || threads < 1) return -1;
    OMP(omp parallel num_threads(threads))
    {
        int t = THREAD_ID();
        float *wr = scratch + (int64_t)t * K;
        OMP(omp for schedule(static))
        for (int64_t n = 0; n < N; n++) {
            if (!out_bf16) {
                decode_row(kind, w + n * ldw, K, (float *)out + n * ldo);
                continue;
            }
            decode_row(kind, w + n * ldw, K, wr);
            uint16_t *o = (uint16_t *)out + n * ldo;
            for (int64_t k = 0; k < K; k++) o[k] = f32bf(wr[k]);
        }
    }
    return 0;
}

/* the fused call's integer path per matrix: the K-quants' int16 a 256, else int8 a 32 */
static int is_k(int kind) { return kind >= 2 && kind <= 4; }
static int64_t xrow_bytes(int kind, int64_t K) { return is_k(kind) ? kqrow_bytes(K) : qrow_bytes(K); }
static void quantize_for(int kind, const void *x, int bf, int64_t K, uint8_t *p) {
    if (is_k(kind)) quantize_row_k(x, bf, K, kqrow_at(p, K));
    else quantize_row(x, bf, K, qrow_at(p, K));
}
/* weight row `row` (K values) . the activation row quantized at xp; own: the thread's decode buffer (RW) */
static float dot_one(int kind, const uint8_t *row, int64_t K, uint8_t *xp, uint8_t *own, int64_t RW, int simd) {
    float v;
    if (is_k(kind)) {
        KQRow xr = kqrow_at(xp, K);
#if SIMD == 2
        if (simd) {
            dot_rows_k16(kind, row, K, &xr, 1, &v);
            return v;
        }
#endif
        KWRow wr = kwrow_at(own, RW);
        decode_row_k(kind, row, K, wr);
        dot_rows_k(kind, wr, K, &xr, 1, simd, &v);
    } else {
        QRow xr = qrow_at(xp, K);
        WRow wr = wrow_at(own, RW);
        decode_row_i8(kind, row, K, wr);
        dot_rows_i8(kind, wr, K, &xr, 1, simd, &v);
    }
    return v;
}

/* One token's routed experts, SwiGLU: out [D] = sum_e w[e] * W2_e (silu(G_e x) * U_e x). W13_e = [G_e; U_e]
   [2I, D] in blocks of kind k13, rows ldw13 bytes apart, experts e13 bytes apart from w13; W2_e [D, I] in
   kind k2 likewise. ids int64, routing weights fp32 or bf16. Phases split over the team: every expert's
   gate/up rows; SiLU (and, on the integer paths, each expert's h quantized); the down rows (each output summed
   over the experts in the order given). path as mlight_gguf_linear's 0-2, the K-quants' matrices on int16. */
int mlight_gguf_moe(int k13, int k2, const void *x, int x_bf16, int64_t D, int64_t I, int nexp, const int64_t *ids,
                    const void *wts, int w_bf16, const uint8_t *w13, int64_t e13, int64_t ldw13, const uint8_t *w2,
                    int64_t e2, int64_t ldw2, void *out, int out_bf16, float *scratch, int threads, int path) {
    if (k13 < 0 || k13 > 5 || k2 < 0 || k2 > 5 || D % BS[k13] || I % BS[k2] || nexp < 1 || threads < 1 ||
        path < 0 || path > 2)
        return -1;
    float *xf = scratch, *gu = xf + D, *rows = gu + (int64_t)nexp * 2 * I, w[64];
    if (nexp > 64) return -1;
    for (int e = 0; e < nexp; e++) w[e] = w_bf16 ? bf16f(((const uint16_t *)wts)[e]) : ((const float *)wts)[e];
    int64_t RW = D > I ? D : I, qd = xrow_bytes(k13, D), qi = xrow_bytes(k2, I);
    int64_t wb = wrow_bytes(RW) > kwrow_bytes(RW) ? wrow_bytes(RW) : kwrow_bytes(RW);
    /* integer paths: x quantized, each expert's h quantized, a decoded row per thread (bytes, after gu) */
    uint8_t *xq = (uint8_t *)rows, *hq = xq + qd, *wq = hq + nexp * qi;
    int simd = path == 2;
    if (path) quantize_for(k13, x, x_bf16, D, xq);
    else
        for (int64_t d = 0; d < D; d++) xf[d] = in_f(x, x_bf16, d);
    OMP(omp parallel num_threads(threads))
    {
        int t = THREAD_ID();
        float *wr = rows + (int64_t)t * RW;
        uint8_t *own = wq + (int64_t)t * wb;
        OMP(omp for schedule(static))
        for (int64_t r = 0; r < nexp * 2 * I; r++) {
            int64_t e = r / (2 * I), n = r % (2 * I);
            const uint8_t *row = w13 + ids[e] * e13 + n * ldw13;
            if (path) gu[r] = dot_one(k13, row, D, xq, own, RW, simd);
            else {
                decode_row(k13, row, D, wr);
                dot_rows(wr, D, xf, D, 1, gu + r);
            }
        }
        if (path) { /* an expert's SiLU and its quantization in one phase */
            OMP(omp for schedule(static))
            for (int e = 0; e < nexp; e++) {
                float *h = gu + (int64_t)e * 2 * I;
                for (int64_t i = 0; i < I; i++) h[i] = h[i] / (1.f + expf(-h[i])) * h[I + i];
                quantize_for(k2, h, 0, I, hq + e * qi);
            }
        } else {
            OMP(omp for schedule(static))
            for (int64_t r = 0; r < nexp * I; r++) {
                float *h = gu + (r / I) * 2 * I + r % I, g = h[0];
                h[0] = g / (1.f + expf(-g)) * h[I];
            }
        }
        OMP(omp for schedule(static))
        for (int64_t d = 0; d < D; d++) {
            float y = 0, v;
            for (int e = 0; e < nexp; e++) {
                const uint8_t *row = w2 + ids[e] * e2 + d * ldw2;
                if (path) v = dot_one(k2, row, I, hq + e * qi, own, RW, simd);
                else {
                    decode_row(k2, row, I, wr);
                    dot_rows(wr, I, gu + (int64_t)e * 2 * I, I, 1, &v);
                }
                y += w[e] * v;
            }
            put(out, out_bf16, d, y);
        }
    }
    return 0;
}

/* floats of scratch a mlight_gguf_moe call needs (either path) */
int64_t mlight_gguf_moe_scratch(int64_t D, int64_t I, int nexp, int threads) {
    int64_t RW = D > I ? D : I, qd = qrow_bytes(D) > kqrow_bytes(D) ? qrow_bytes(D) : kqrow_bytes(D);
    int64_t qi = qrow_bytes(I) > kqrow_bytes(I) ? qrow_bytes(I) : kqrow_bytes(I);
    int64_t wb = wrow_bytes(RW) > kwrow_bytes(RW) ? wrow_bytes(RW) : kwrow_bytes(RW);
    int64_t i8 = qd + nexp * qi + threads * wb;
    int64_t f32 = (int64_t)threads * RW * 4;
    return D + (int64_t)nexp * 2 * I + ((i8 > f32 ? i8 : f32) + 3) / 4;
}
