/* GGUF block formats multiplied as the file stores them: y [M, N] = x [M, K] . W^T, W's rows the file's blocks.

   Before this kernel a GGUF expert was expanded into a float buffer on every use (core/model/quant/expand.py):
   ~190 M weights written and read back per token on the 784M test model. Here each weight row's blocks are
   decoded into a K-float row buffer of the thread's own (L1/L2-resident) and dotted at once with every
   activation row: the matrix is read once, at the file's bits, and never exists expanded.
   The decoders do the float32 arithmetic of `gguf.quants.dequantize` (core/model/quant/blocks.py): every
   product there is exact in float32 (an f16 scale times a small integer, or times a 6-bit scale and then a
   small integer), so the row buffer holds the reference's weights bit for bit, and only the dot's order of
   summation differs from torch's fp32 matmul (tests/test_gguf_native.py checks both): the fp32 path.

   The int8 path (llama.cpp's way; the caller's default for bf16 activations up to a row bound) quantizes
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
#else
#define OMP(directive)
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

/* the 8 six-bit scales and mins of a Q4_K / Q5_K block, times d and dmin */
static inline void scale_min_k4(const uint8_t *b, float *ds, float *dm) {
    float d = f16f(b), dmin = f16f(b + 2);
    const uint8_t *s = b + 4;
    for (int j = 0; j < 4; j++) {
        ds[j] = d * (float)(s[j] & 0x3f);
        dm[j] = dmin * (float)(s[j + 4] & 0x3f);
        ds[j + 4] = d * (float)((s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30));
        dm[j + 4] = dmin * (float)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
    }
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

static void quantize_row(const void *x, int bf, int64_t K, QRow r) {
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

/* out[m] = w . x[m] for mr (1..MR) quantized rows; simd 0: the plain-C integers */
#define TILES(f)                                                      \
    switch (mr) {                                                     \
    case 1: sgn ? f(w, K, x, 1, 1, out) : f(w, K, x, 0, 1, out); break; \
    case 2: sgn ? f(w, K, x, 1, 2, out) : f(w, K, x, 0, 2, out); break; \
    case 3: sgn ? f(w, K, x, 1, 3, out) : f(w, K, x, 0, 3, out); break; \
    default: sgn ? f(w, K, x, 1, 4, out) : f(w, K, x, 0, 4, out); break; \
    }
static void dot_rows_i8(int kind, WRow w, int64_t K, const QRow *x, int mr, int simd, float *out) {
    int sgn = SIGNED[kind];
#if SIMD
    if (simd) {
        TILES(tile_simd)
    } else
#endif
    {
        (void)simd;
        TILES(tile_scalar)
    }
    if (OFFSET[kind])
        for (int m = 0; m < mr; m++) out[m] -= offset_dot(w.o, x[m].ds, K / 16);
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

/* the int8 path of mlight_gguf_linear; scratch: M quantized rows, then a decoded row per thread */
static void linear_i8(int kind, const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint8_t *w,
                      int64_t ldw, int64_t N, void *y, int y_bf16, int64_t ldy, uint8_t *scratch, int threads,
                      int simd) {
    int64_t qb = qrow_bytes(K), wb = wrow_bytes(K);
    uint8_t *rows = scratch + M * qb;
    int serial = M * K <= (1 << 14); /* a decode step's rows: quantized before the team starts, one barrier fewer */
    for (int64_t m = 0; serial && m < M; m++)
        quantize_row(x_bf16 ? (const void *)((const uint16_t *)x + m * ldx)
                            : (const void *)((const float *)x + m * ldx),
                     x_bf16, K, qrow_at(scratch + m * qb, K));
    OMP(omp parallel num_threads(threads))
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        if (!serial) {
            OMP(omp for schedule(static))
            for (int64_t m = 0; m < M; m++)
                quantize_row(x_bf16 ? (const void *)((const uint16_t *)x + m * ldx)
                                    : (const void *)((const float *)x + m * ldx),
                             x_bf16, K, qrow_at(scratch + m * qb, K));
        }
        WRow wr = wrow_at(rows + (int64_t)t * wb, K);
        QRow xr[MR];
        float out[MR];
        OMP(omp for schedule(static))
        for (int64_t n = 0; n < N; n++) {
            decode_row_i8(kind, w + n * ldw, K, wr);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                int mr = M - m0 < MR ? (int)(M - m0) : MR;
                for (int m = 0; m < mr; m++) xr[m] = qrow_at(scratch + (m0 + m) * qb, K);
                dot_rows_i8(kind, wr, K, xr, mr, simd, out);
                for (int m = 0; m < mr; m++) put(y, y_bf16, (m0 + m) * ldy + n, out[m]);
            }
        }
    }
}

/* y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) . W^T; W's rows ldw bytes apart from w. path: 0 fp32
   (rows decoded to floats), 1 int8 activations in plain C, 2 int8 with the build's SIMD dots */
int mlight_gguf_linear(int kind, const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint8_t *w,
                       int64_t ldw, int64_t N, void *y, int y_bf16, int64_t ldy, float *scratch, int threads,
                       int path) {
    if (kind < 0 || kind > 5 || K % BS[kind] || M < 1 || threads < 1 || path < 0 || path > 2) return -1;
    if (path) {
        linear_i8(kind, x, x_bf16, ldx, M, K, w, ldw, N, y, y_bf16, ldy, (uint8_t *)scratch, threads, path == 2);
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
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
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

/* One token's routed experts, SwiGLU: out [D] = sum_e w[e] * W2_e (silu(G_e x) * U_e x). W13_e = [G_e; U_e]
   [2I, D] in blocks of kind k13, rows ldw13 bytes apart, experts e13 bytes apart from w13; W2_e [D, I] in
   kind k2 likewise. ids int64, routing weights fp32 or bf16. Phases split over the team: every expert's
   gate/up rows; SiLU (and, on the int8 paths, each expert's h quantized); the down rows (each output summed
   over the experts in the order given). path as mlight_gguf_linear's. */
int mlight_gguf_moe(int k13, int k2, const void *x, int x_bf16, int64_t D, int64_t I, int nexp, const int64_t *ids,
                    const void *wts, int w_bf16, const uint8_t *w13, int64_t e13, int64_t ldw13, const uint8_t *w2,
                    int64_t e2, int64_t ldw2, void *out, int out_bf16, float *scratch, int threads, int path) {
    if (k13 < 0 || k13 > 5 || k2 < 0 || k2 > 5 || D % BS[k13] || I % BS[k2] || nexp < 1 || threads < 1 ||
        path < 0 || path > 2)
        return -1;
    float *xf = scratch, *gu = xf + D, *rows = gu + (int64_t)nexp * 2 * I, w[64];
    if (nexp > 64) return -1;
    for (int e = 0; e < nexp; e++) w[e] = w_bf16 ? bf16f(((const uint16_t *)wts)[e]) : ((const float *)wts)[e];
    int64_t RW = D > I ? D : I, qd = qrow_bytes(D), qi = qrow_bytes(I), wb = wrow_bytes(RW);
    /* int8: x quantized, each expert's h quantized, a decoded row per thread (bytes, after gu) */
    uint8_t *xq = (uint8_t *)rows, *hq = xq + qd, *wq = hq + nexp * qi;
    int simd = path == 2;
    if (path) quantize_row(x, x_bf16, D, qrow_at(xq, D));
    else
        for (int64_t d = 0; d < D; d++) xf[d] = in_f(x, x_bf16, d);
    OMP(omp parallel num_threads(threads))
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *wr = rows + (int64_t)t * RW;
        WRow wi = wrow_at(wq + (int64_t)t * wb, RW);
        QRow xr = qrow_at(xq, D);
        OMP(omp for schedule(static))
        for (int64_t r = 0; r < nexp * 2 * I; r++) {
            int64_t e = r / (2 * I), n = r % (2 * I);
            const uint8_t *row = w13 + ids[e] * e13 + n * ldw13;
            if (path) {
                decode_row_i8(k13, row, D, wi);
                dot_rows_i8(k13, wi, D, &xr, 1, simd, gu + r);
            } else {
                decode_row(k13, row, D, wr);
                dot_rows(wr, D, xf, D, 1, gu + r);
            }
        }
        if (path) { /* an expert's SiLU and its quantization in one phase */
            OMP(omp for schedule(static))
            for (int e = 0; e < nexp; e++) {
                float *h = gu + (int64_t)e * 2 * I;
                for (int64_t i = 0; i < I; i++) h[i] = h[i] / (1.f + expf(-h[i])) * h[I + i];
                quantize_row(h, 0, I, qrow_at(hq + e * qi, I));
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
                if (path) {
                    QRow hr = qrow_at(hq + e * qi, I);
                    decode_row_i8(k2, row, I, wi);
                    dot_rows_i8(k2, wi, I, &hr, 1, simd, &v);
                } else {
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
    int64_t RW = D > I ? D : I, i8 = qrow_bytes(D) + nexp * qrow_bytes(I) + threads * wrow_bytes(RW);
    int64_t f32 = (int64_t)threads * RW * 4;
    return D + (int64_t)nexp * 2 * I + ((i8 > f32 ? i8 : f32) + 3) / 4;
}
