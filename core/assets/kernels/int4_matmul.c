/* int4 weight-only matmul for a few rows (decode), bound by memory bandwidth rather than by unpacking.

   W [N, K] in mlight's int4 layout (core/model/quant/formats.py): q uint8 [N, K/2] (even k in the low
   nibble), sz bf16 [N, K/g, 2] (scale, zero) per group of g inputs, W = (q - 8) * scale + zero. It is
   read as stored: no repacking at load, the quantized cache's bytes are the kernel's.

   torch's int4 CPU kernel turns every weight into a float and multiplies it (~36 G weights/s a Zen 5
   core: compute-bound). Here the activations are quantized instead, once per call, and the weights stay
   integers: each 8 consecutive inputs (a "lane") get their own scale a, and two int8 digits,
   x ~ a * (x1 + x2 / 256), so the activation keeps ~15 bits, finer than bf16's 8. A lane's dot with the
   nibbles is then integer products (AVX512_VNNI vpdpbusd: 64 a instruction; AVX2 / AVX-512 without VNNI:
   vpmaddubsw + vpmaddwd), summed in int32, and only then scaled in fp32:
       y[n] = sum over lanes L of  scale(L) * a(L)/256 * (256 * q.x1 + q.x2 - 8 * 256 * sum x1 - 8 * sum x2)
                                 + zero(L) * sum of the lane's own inputs (exact).
   A chunk is VW lanes (one vector of int32 per lane sum): its q bytes are one vector load, the low
   nibbles (even k) and the high ones (odd k) two vectors; the activation digits are stored in the same
   order ("prep"), so no shuffles happen per weight. Lanes past K are zero in the prep and masked in
   the loads, so K needs only be a multiple of 32 (the smallest int4 group).

   Built by core/model/cpu/int4.py with the C compiler at hand: AVX-512 (+VNNI where the CPU has it),
   AVX2, or portable C (VW 4) that the compiler vectorises as it can; OpenMP splits output rows over
   torch's own threads when built with -fopenmp. Inputs bf16 or fp32, outputs bf16 (round to nearest
   even) or fp32, math int32 / fp32. Entry points return 0, or -1 for a call they do not take. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#undef VW /* the builder's -DVW says the same; the ISA macros decide here */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VW 16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
#else
#define VW 4
#endif
#define CH (8 * VW) /* inputs per chunk */
/* bytes of weights ahead that the row loops prefetch (into L1): with the hardware's prefetcher alone one
   core streamed ~21 GB/s through this kernel, where a plain read loop takes ~42; 8 KB ahead ~28, and two
   cores 39 -> 46-61 GB/s (Zen 5, 2 vCPUs, 63 MB of weights, K = 3840; K = 7168 stays lower, ~34) */
#ifndef PF
#define PF 8192
#endif
#ifndef PFL
#define PFL 3
#endif

#ifdef _OPENMP
#define OMP(directive) _Pragma(#directive)
#else
#define OMP(directive)
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t chunks(int64_t K) { return (K + CH - 1) / CH; }

/* ---- prep: activation rows as digits in the kernel's order -----------------------------------------
   One block of CB(dg) bytes per (chunk c, row m), at prep + (c * M + m) * CB(dg), so that one pointer and
   fixed displacements reach every row's operands of a chunk: x1 low | x1 high | x2 low | x2 high (CH/2 int8
   each) | a [VW] f32 — or, with one digit (dg = 1), x1 low | x1 high | a. Byte 4j+i of a "low" part holds input c*CH + 8j + 2i (the partner of the low nibbles), of a
   "high" part input c*CH + 8j + 2i + 1. After the blocks, per row, two arrays of nl = chunks * VW floats:
   first per lane, then (fold_groups) per group of g inputs, -8 * the sum of the digits' values (xq) and the
   sum of the inputs themselves (x). The weights' -8 and zero are applied per group, once a row, from these:
       y[n] = sum over lanes L of scale(L) * a(L) * (256 * q.x1 + q.x2)
            + sum over groups G of scale(G) * (-8 * sum xq) + zero(G) * sum x          (group_dot)
   which keeps a chunk's work per row to its dot products and one fp32 multiply-add, and the bytes of
   activations a weight row reads to 2.5 per input (from 3.5 with per-lane offsets and sums).
   Digits: two (x ~ a * (256 x1 + x2), ~15 bits) for fp32 inputs; one (x ~ a * x1, 8 bits a lane: bf16's
   own precision at the lane's largest input) for bf16 inputs — half the dot products, which bound a
   call at many tokens, and 1.5 prepped bytes an input. */
#define CB(dg) ((dg) * CH + 4 * VW)
#define X1 0
#define X2 CH
#define SA(dg) ((dg) * CH)
static inline int64_t lanes(int64_t K) { return chunks(K) * VW; }
static inline int64_t prep_bytes(int64_t M, int64_t K) { return chunks(K) * CB(2) * M + M * 2 * lanes(K) * 4; }
/* row m's sums: -8 * sum xq at [0, nl), sum x at [nl, 2 nl) (per lane, then per group); where two digits'
   blocks would end, whatever the digits */
static inline float *sums(uint8_t *prep, int64_t M, int64_t K, int64_t m) {
    return (float *)(prep + chunks(K) * CB(2) * M) + m * 2 * lanes(K);
}

static inline float bf16f(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* chunks [c0, c1) of a row whose inputs v (fp32, K of them) are given */
#if VW == 16 || VW == 8
#if VW == 16
typedef __m512 vps;
typedef __m512i vpi;
#define V(op) _mm512_##op
#define GATHER(valid, idx, p) _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, idx, p, 4)
#define LANES_VALID(n) ((__mmask16)((n) >= 16 ? 0xffff : (1u << (n)) - 1))
#define GT0(a) _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ)
#define DIV_WHERE(m, a, b) _mm512_maskz_div_ps(m, a, b)
#define STORE(p, v) _mm512_storeu_si512((void *)(p), v)
#define STOREF(p, v) _mm512_storeu_ps(p, v)
#define ABS(v) _mm512_abs_ps(v)
#define LANE_IDX _mm512_set_epi32(120, 112, 104, 96, 88, 80, 72, 64, 56, 48, 40, 32, 24, 16, 8, 0)
#else
typedef __m256 vps;
typedef __m256i vpi;
#define V(op) _mm256_##op
#define GATHER(valid, idx, p) _mm256_mask_i32gather_ps(_mm256_setzero_ps(), p, idx, valid, 4)
#define LANES_VALID(n) _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0)))
#define GT0(a) _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GT_OQ)
#define DIV_WHERE(m, a, b) _mm256_and_ps(m, _mm256_div_ps(a, b))
#define STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define STOREF(p, v) _mm256_storeu_ps(p, v)
#define ABS(v) _mm256_andnot_ps(_mm256_set1_ps(-0.f), v)
#define LANE_IDX _mm256_set_epi32(56, 48, 40, 32, 24, 16, 8, 0)
#endif
/* four digits (lane-wise int32, in [-127, 127]) as one lane's four bytes, first in the low byte */
#if VW == 16
#define OR(a, b) _mm512_or_si512(a, b)
#define AND(a, b) _mm512_and_si512(a, b)
#else
#define OR(a, b) _mm256_or_si256(a, b)
#define AND(a, b) _mm256_and_si256(a, b)
#endif
static inline vpi bytes4(vpi a, vpi b, vpi c, vpi d) {
    const vpi ff = V(set1_epi32)(0xff);
    return OR(OR(AND(a, ff), V(slli_epi32)(AND(b, ff), 8)), OR(V(slli_epi32)(AND(c, ff), 16), V(slli_epi32)(d, 24)));
}

static void prep_chunks(const float *v, int64_t K, uint8_t *prep, int64_t M, int64_t m, int64_t c0, int64_t c1,
                        int dg) {
    const vpi lane = LANE_IDX, lo = V(set1_epi32)(-127), hi = V(set1_epi32)(127);
    float *sq = sums(prep, M, K, m), *sx = sq + lanes(K);
    for (int64_t c = c0; c < c1; c++) {
        const float *p = v + c * CH;
        int64_t left = (K - c * CH) / 8; /* lanes with inputs */
        vps x[8], amax = V(setzero_ps)(), sum = V(setzero_ps)();
        for (int t = 0; t < 8; t++) { /* x[t], lane j: input 8j + t of the chunk */
            x[t] = GATHER(LANES_VALID(left), V(add_epi32)(lane, V(set1_epi32)(t)), p);
            amax = V(max_ps)(amax, ABS(x[t]));
            sum = V(add_ps)(sum, x[t]);
        }
        vps inv = DIV_WHERE(GT0(amax), V(set1_ps)(127.f), amax); /* 0 where all zero, or NaN / inf (a says so) */
        vpi d1[8], d2[8], s1 = V(sub_epi32)(lo, lo), s2 = s1;
        for (int t = 0; t < 8; t++) {
            vps u = V(mul_ps)(x[t], inv);
            d1[t] = V(cvtps_epi32)(u); /* round to nearest */
            d2[t] = V(cvtps_epi32)(V(mul_ps)(V(sub_ps)(u, V(cvtepi32_ps)(d1[t])), V(set1_ps)(256.f)));
            d2[t] = V(max_epi32)(lo, V(min_epi32)(hi, d2[t]));
            s1 = V(add_epi32)(s1, d1[t]);
            s2 = V(add_epi32)(s2, d2[t]);
        }
        uint8_t *b = prep + (c * M + m) * CB(dg);
        vps a = V(mul_ps)(amax, V(set1_ps)(dg == 2 ? 1.f / (127.f * 256.f) : 1.f / 127.f));
        STORE(b + X1, bytes4(d1[0], d1[2], d1[4], d1[6]));
        STORE(b + X1 + CH / 2, bytes4(d1[1], d1[3], d1[5], d1[7]));
        if (dg == 2) {
            STORE(b + X2, bytes4(d2[0], d2[2], d2[4], d2[6]));
            STORE(b + X2 + CH / 2, bytes4(d2[1], d2[3], d2[5], d2[7]));
        }
        STOREF((float *)(b + SA(dg)), a);
        vpi d = dg == 2 ? V(add_epi32)(V(slli_epi32)(s1, 8), s2) : s1;
        STOREF(sq + c * VW, V(mul_ps)(V(mul_ps)(a, V(set1_ps)(-8.f)), V(cvtepi32_ps)(d)));
        STOREF(sx + c * VW, sum);
    }
}
#else
static void prep_chunks(const float *v, int64_t K, uint8_t *prep, int64_t M, int64_t m, int64_t c0, int64_t c1,
                        int dg) {
    float *sq = sums(prep, M, K, m), *sx = sq + lanes(K);
    for (int64_t L = c0 * VW; L < c1 * VW; L++) {
        int64_t c = L / VW, j = L % VW, k0 = 8 * L;
        uint8_t *b = prep + (c * M + m) * CB(dg);
        int8_t *lo1 = (int8_t *)b + X1 + 4 * j, *hi1 = lo1 + CH / 2, *lo2 = (int8_t *)b + X2 + 4 * j, *hi2 = lo2 + CH / 2;
        float *a = (float *)(b + SA(dg));
        float amax = 0.f, sum = 0.f;
        if (k0 < K)
            for (int i = 0; i < 8; i++) { float t = fabsf(v[k0 + i]); amax = t > amax ? t : amax; sum += v[k0 + i]; }
        float inv = amax > 0.f && amax < INFINITY ? 127.f / amax : 0.f; /* NaN / inf inputs: a says so */
        int32_t s1 = 0, s2 = 0;
        for (int i = 0; i < 8; i++) {
            float t = k0 < K ? v[k0 + i] * inv : 0.f, d1 = rintf(t), d2 = rintf((t - d1) * 256.f);
            d2 = d2 > 127.f ? 127.f : d2 < -127.f ? -127.f : d2;
            *((i & 1 ? hi1 : lo1) + i / 2) = (int8_t)d1;
            if (dg == 2) *((i & 1 ? hi2 : lo2) + i / 2) = (int8_t)d2;
            s1 += (int32_t)d1, s2 += (int32_t)d2;
        }
        a[j] = dg == 2 ? amax / (127.f * 256.f) : amax / 127.f;
        sq[L] = a[j] * -8.f * (float)(dg == 2 ? 256 * s1 + s2 : s1);
        sx[L] = sum;
    }
}
#endif

/* row m's lane sums into group sums (g / 8 lanes a group), in place: group G's at index G */
static void fold_groups(uint8_t *prep, int64_t M, int64_t K, int64_t g, int64_t m) {
    float *sq = sums(prep, M, K, m), *sx = sq + lanes(K);
    int64_t per = g / 8;
    for (int64_t G = 0; G < K / g; G++) {
        float tq = 0.f, tx = 0.f;
        for (int64_t i = 0; i < per; i++) tq += sq[G * per + i], tx += sx[G * per + i];
        sq[G] = tq, sx[G] = tx;
    }
}

/* the per-group terms of one weight row against one prepped row: sum over groups of scale * sq + zero * sx
   (AVX-512: into a row's vector of sums, before its one reduction) */
#if VW == 16
static inline __m512 group_acc(__m512 acc, const uint16_t *sz, int64_t ng, const float *sq, const float *sx) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t G = 0; G < ng; G += 16) { /* a dword per group: scale in the low half, zero in the high */
        __mmask16 k = (__mmask16)(ng - G >= 16 ? 0xffff : (1u << (ng - G)) - 1);
        __m512i w = _mm512_maskz_loadu_epi32(k, sz + 2 * G);
        acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), _mm512_maskz_loadu_ps(k, sq + G), acc);
        acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, top)), _mm512_maskz_loadu_ps(k, sx + G), acc);
    }
    return acc;
}
#else
static inline float group_dot(const uint16_t *sz, int64_t ng, const float *sq, const float *sx) {
    float t = 0.f;
    for (int64_t G = 0; G < ng; G++) t += bf16f(sz[2 * G]) * sq[G] + bf16f(sz[2 * G + 1]) * sx[G];
    return t;
}
#endif

/* row m of x (fp32 or bf16, rows ldx elements apart) inputs [k0, k0 + n) into buf */
static inline void load_row(const void *x, int x_bf16, int64_t off, int64_t n, float *buf) {
    if (x_bf16) { const uint16_t *p = (const uint16_t *)x + off; for (int64_t i = 0; i < n; i++) buf[i] = bf16f(p[i]); }
    else memcpy(buf, (const float *)x + off, n * sizeof(float));
}

/* ---- a tile: nr weight rows (nr = 1 or NR) against mr (<= MR) prepped rows --------------------------
   out[r * MR + m] = W[r] . x[m] without the per-group terms (tile adds them). A weight chunk is loaded
   and unpacked once for the tile's mr rows and a row's prepped chunk once for its nr weight rows, so that
   at many tokens a chunk's weights cost their unpacking once per MR rows and the activations' loads once
   per NR weight rows. */
#ifndef NR
#define NR 2
#endif
#ifndef MR
#define MR 8
#endif
#if VW == 16
#ifdef __AVX512VNNI__
#define DOT(acc, lo, xl, hi, xh) _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xl), hi, xh)
#else
#define DOT(acc, lo, xl, hi, xh) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_add_epi16( \
        _mm512_maddubs_epi16(lo, xl), _mm512_maddubs_epi16(hi, xh)), _mm512_set1_epi16(1)))
#endif
/* one chunk of the tile: the nibbles of 128 weights a row (wmask: a tail's bytes), lanes' scales from the
   words at sz (smask: the chunk's groups), against the chunk's prepped blocks of mr rows at b */
static inline __attribute__((always_inline)) void tile_chunk(const uint8_t *q, int64_t ldq, const uint16_t *sz,
                                                             int64_t ldsz, int nr, __mmask64 wmask, __mmask32 smask,
                                                             __m512i idx_s, const uint8_t *b, int mr, int dg,
                                                             __m512 acc[NR][MR]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i lo[NR], hi[NR];
    __m512 S[NR];
    for (int r = 0; r < NR; r++) {
        if (r >= nr) break;
        __m512i w = _mm512_maskz_loadu_epi8(wmask, q + r * ldq);
        lo[r] = _mm512_and_si512(w, m4), hi[r] = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
        S[r] = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx_s,
                                                                  _mm512_maskz_loadu_epi16(smask, sz + r * ldsz)));
    }
    for (int m = 0; m < MR; m++) {
        if (m >= mr) break;
        const uint8_t *x = b + m * CB(dg);
        __m512 a = _mm512_loadu_ps(x + SA(dg));
        for (int r = 0; r < NR; r++) {
            if (r >= nr) break;
            __m512i d = DOT(_mm512_setzero_si512(), lo[r], _mm512_loadu_si512(x + X1), hi[r], _mm512_loadu_si512(x + X1 + 64));
            if (dg == 2)
                d = _mm512_add_epi32(_mm512_slli_epi32(d, 8), DOT(_mm512_setzero_si512(), lo[r], _mm512_loadu_si512(x + X2),
                                                                  hi[r], _mm512_loadu_si512(x + X2 + 64)));
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(S[r], a), acc[r][m]);
        }
    }
}

static inline __attribute__((always_inline)) void tile_dot(const uint8_t *q, int64_t ldq, const uint16_t *sz,
                                                           int64_t ldsz, int nr, int64_t K, int lg, const uint8_t *prep,
                                                           int64_t cs, int mr, int dg, const float *gs, int64_t gst,
                                                           float *out) {
    int64_t full = K / CH, tail = K % CH;
    /* lane j's scale: word 2 * (8j / g) of the chunk's groups, into the high half of lane j's dword (a bf16
       there is its float); the even words are zeroed by the permute's mask */
    const __m512i words = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                                           12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i idx_s = _mm512_slli_epi16(_mm512_srl_epi16(_mm512_srli_epi16(words, 1), _mm_cvtsi32_si128(lg - 3)), 1);
    const __mmask32 full_mask = (__mmask32)((1u << (2 * (CH >> lg))) - 1);
    __m512 acc[NR][MR];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MR; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < full; c++) {
        for (int r = 0; r < NR; r++) {
            if (r >= nr) break;
            __builtin_prefetch(q + r * ldq + c * (CH / 2) + PF, 0, PFL);
            __builtin_prefetch(sz + r * ldsz + 2 * ((c * CH) >> lg) + PF / 16, 0, PFL);
        }
        tile_chunk(q + c * (CH / 2), ldq, sz + 2 * ((c * CH) >> lg), ldsz, nr, ~(__mmask64)0, full_mask, idx_s,
                   prep + c * cs, mr, dg, acc);
    }
    if (tail) {
        int64_t ng = tail >> lg ? tail >> lg : 1;
        tile_chunk(q + full * (CH / 2), ldq, sz + 2 * ((full * CH) >> lg), ldsz, nr, ((__mmask64)1 << (tail / 2)) - 1,
                   (__mmask32)((1u << (2 * ng)) - 1), idx_s, prep + full * cs, mr, dg, acc);
    }
    for (int r = 0; r < NR; r++) {
        if (r >= nr) break;
        for (int m = 0; m < MR; m++) {
            if (m >= mr) break;
            const float *sq = gs + m * gst;
            out[r * MR + m] = _mm512_reduce_add_ps(group_acc(acc[r][m], sz + r * ldsz, K >> lg, sq, sq + lanes(K)));
        }
    }
}
#else
#if VW == 8
static inline __m256i dot8(__m256i acc, __m256i lo, __m256i xl, __m256i hi, __m256i xh) {
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* out[m] = one weight row . mb prepped rows (AVX2 has 16 vector registers: one row at a time) */
static inline __attribute__((always_inline)) void row_dot(const uint8_t *q, const uint16_t *sz, int64_t K, int lg,
                                                          const uint8_t *prep, int64_t cs, int mb, int dg, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[MR];
    for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks(K); c++) {
        int64_t kc = c * CH, nk = min64(CH, K - kc);
        __builtin_prefetch(q + kc / 2 + PF);
        __m256i w = nk == CH ? _mm256_loadu_si256((const __m256i *)(q + kc / 2))
                             : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(q + kc / 2)));
        __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
        const uint16_t *p = sz + 2 * (kc >> lg);
        __m256 S = (1 << lg) < CH && nk == CH /* g = 32: lanes 0-3 group one, 4-7 group two */
                       ? _mm256_setr_m128(_mm_set1_ps(bf16f(p[0])), _mm_set1_ps(bf16f(p[2])))
                       : _mm256_set1_ps(bf16f(p[0]));
        for (int m = 0; m < MR; m++) {
            if (m >= mb) break;
            const uint8_t *r = prep + c * cs + m * CB(dg);
            __m256i d = dot8(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)(r + X1)), hi,
                             _mm256_loadu_si256((const __m256i *)(r + X1 + 32)));
            if (dg == 2)
                d = dot8(_mm256_slli_epi32(d, 8), lo, _mm256_loadu_si256((const __m256i *)(r + X2)), hi,
                         _mm256_loadu_si256((const __m256i *)(r + X2 + 32)));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(S, _mm256_loadu_ps((const float *)(r + SA(dg)))), acc[m]);
        }
    }
    for (int m = 0; m < mb && m < MR; m++) out[m] = hsum8(acc[m]);
}
#else
/* portable C: the same sums lane by lane */
static inline void row_dot(const uint8_t *q, const uint16_t *sz, int64_t K, int lg, const uint8_t *prep, int64_t cs,
                           int mb, int dg, float *out) {
    for (int m = 0; m < mb; m++) {
        float acc[VW] = {0};
        for (int64_t c = 0; c < chunks(K); c++) {
            int64_t kc = c * CH, nk = min64(CH, K - kc);
            for (int j = 0; j < VW; j++) {
                if (8 * j >= nk) break;
                const uint8_t *qb = q + kc / 2 + 4 * j, *r = prep + c * cs + m * CB(dg);
                const int8_t *x1 = (const int8_t *)r + X1 + 4 * j, *x2 = (const int8_t *)r + X2 + 4 * j;
                int32_t d1 = 0, d2 = 0;
                for (int i = 0; i < 4; i++) {
                    int32_t l = qb[i] & 15, h = qb[i] >> 4;
                    d1 += l * x1[i] + h * x1[CH / 2 + i];
                    if (dg == 2) d2 += l * x2[i] + h * x2[CH / 2 + i];
                }
                acc[j] += (float)(dg == 2 ? d1 * 256 + d2 : d1) * (bf16f(sz[2 * ((kc + 8 * j) >> lg)]) *
                                                                  ((const float *)(r + SA(dg)))[j]);
            }
        }
        float t = 0.f;
        for (int j = 0; j < VW; j++) t += acc[j];
        out[m] = t;
    }
}
#endif
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *q, int64_t ldq, const uint16_t *sz,
                                                           int64_t ldsz, int nr, int64_t K, int lg, const uint8_t *prep,
                                                           int64_t cs, int mr, int dg, const float *gs, int64_t gst,
                                                           float *out) {
    for (int r = 0; r < nr; r++) {
        row_dot(q + r * ldq, sz + r * ldsz, K, lg, prep, cs, mr, dg, out + r * MR);
        for (int m = 0; m < mr; m++)
            out[r * MR + m] += group_dot(sz + r * ldsz, K >> lg, gs + m * gst, gs + m * gst + lanes(K));
    }
}
#endif

/* one weight row against one activation row: its own function, so that every build runs the same code for
   it (one token's decode, the hot path) whatever the tile sizes */
__attribute__((noinline)) static void dot1(const uint8_t *q, const uint16_t *sz, int64_t K, int lg, const uint8_t *prep,
                                           int64_t cs, int dg, const float *gs, float *out) {
    if (dg == 2) tile_dot(q, 0, sz, 0, 1, K, lg, prep, cs, 1, 2, gs, 0, out);
    else tile_dot(q, 0, sz, 0, 1, K, lg, prep, cs, 1, 1, gs, 0, out);
}

/* out[r * MR + m] = W[r] . x[m], r < nr (1..NR), m < mr (1..MR); W's rows ldq bytes / ldsz words apart
   from (q, sz); x's prepped chunks cs bytes apart from prep, its group sums gst floats apart from gs.
   Each (nr, mr) a compile-time pair, so that the accumulators stay in registers. */
static void tile(const uint8_t *q, int64_t ldq, const uint16_t *sz, int64_t ldsz, int nr, int64_t K, int lg,
                 const uint8_t *prep, int64_t cs, int mr, int dg, const float *gs, int64_t gst, float *out) {
#define TILE(R, M)                                                                                                 \
    do {                                                                                                           \
        if (dg == 2) tile_dot(q + r * ldq, ldq, sz + r * ldsz, ldsz, R, K, lg, prep, cs, M, 2, gs, gst, out + r * MR); \
        else tile_dot(q + r * ldq, ldq, sz + r * ldsz, ldsz, R, K, lg, prep, cs, M, 1, gs, gst, out + r * MR);        \
    } while (0)
#define TILES(R)                                                                                                   \
    switch (mr) {                                                                                                  \
    case 1: TILE(R, 1); break;                                                                                     \
    case 2: TILE(R, 2); break;                                                                                     \
    case 3: TILE(R, 3); break;                                                                                     \
    case 4: TILE(R, 4); break;                                                                                     \
    case 5: TILE(R, 5); break;                                                                                     \
    case 6: TILE(R, 6); break;                                                                                     \
    case 7: TILE(R, 7); break;                                                                                     \
    default: TILE(R, MR); break;                                                                                   \
    }
    if (mr == 1) /* one activation row: a weight row at a time (one prefetched stream a thread streams fastest) */
        for (int r = 0; r < nr; r++) dot1(q + r * ldq, sz + r * ldsz, K, lg, prep, cs, dg, gs, out + r * MR);
    else if (nr == NR) {
        int r = 0;
        TILES(NR)
    } else
        for (int r = 0; r < nr; r++) TILES(1)
#undef TILES
#undef TILE
}

static inline void store(void *y, int y_bf16, int64_t i, float v) {
    if (y_bf16) ((uint16_t *)y)[i] = f32bf(v);
    else ((float *)y)[i] = v;
}

/* silu(g) * u with exp as 2^n * p(r) (relative error < 2e-7), branch-free so the loop vectorises */
static inline float silu_mul(float gt, float u) {
    float x = -gt;
    x = x > 88.f ? 88.f : x < -88.f ? -88.f : x;
    float n = rintf(x * 1.44269504f), r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (0.166666672f + r * (0.0416666418f + r * (0.00833333377f +
                                                                                          r * 0.00138888892f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float two; memcpy(&two, &bits, 4);
    return gt / (1.f + p * two) * u;
}

/* ---- entry points ------------------------------------------------------------------------------------ */
int mlight_int4_vw(void) { return VW; }
int mlight_int4_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* scratch bytes a call needs (64-byte aligned scratch): `mlight_int4_linear` with M rows of K inputs,
   or `mlight_int4_moe` over `nexp` experts with hidden D and expert width I (M = 0) */
int64_t mlight_int4_scratch(int64_t M, int64_t K, int64_t nexp, int64_t D, int64_t I) {
    if (nexp == 0) return prep_bytes(M, K) + M * K * 4 + 64;
    return prep_bytes(1, D) + nexp * (prep_bytes(1, I) + 2 * I * 4) + 2 * D * 4 + 64 * 4;
}

static int shape_ok(int64_t K, int64_t g) {
    return K > 0 && K % 32 == 0 && (g == 32 || g == 64 || g == 128) && K % g == 0;
}
static inline int log2g(int64_t g) { return g == 32 ? 5 : g == 64 ? 6 : 7; }

/* y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) . W^T; W's rows ldq bytes (q) and ldsz words
   (sz) apart */
int mlight_int4_linear(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint8_t *q, int64_t ldq,
                       const uint16_t *sz, int64_t ldsz, int64_t N, int64_t g, void *y, int y_bf16, int64_t ldy,
                       uint8_t *scratch, int threads) {
    if (!shape_ok(K, g) || M < 1) return -1;
    int dg = x_bf16 ? 1 : 2; /* digits an input: see prep */
    int64_t nch = chunks(K), cs = M * CB(dg); /* prep: row m's chunk c at scratch + c * cs + m * CB(dg) */
    int lg = log2g(g);
    float *xf = (float *)(scratch + prep_bytes(M, K));
    OMP(omp parallel num_threads(threads))
    {
        OMP(omp for schedule(static))
        for (int64_t m = 0; m < M; m++) {
            load_row(x, x_bf16, m * ldx, K, xf + m * K);
            prep_chunks(xf + m * K, K, scratch, M, m, 0, nch, dg);
            fold_groups(scratch, M, K, g, m);
        }
        /* a tile's NR weight rows stay in L1 while its rows of activations pass, MR at a time */
        OMP(omp for schedule(static))
        for (int64_t n0 = 0; n0 < N; n0 += NR) {
            int nr = N - n0 >= NR ? NR : 1;
            for (int64_t n = n0; n < min64(n0 + NR, N); n += nr)
                for (int64_t m0 = 0; m0 < M; m0 += MR) {
                    float out[NR * MR];
                    int mr = (int)min64(MR, M - m0);
                    tile(q + n * ldq, ldq, sz + n * ldsz, ldsz, nr, K, lg, scratch + m0 * CB(dg), cs, mr, dg,
                         sums(scratch, M, K, m0), 2 * lanes(K), out);
                    for (int r = 0; r < nr; r++)
                        for (int m = 0; m < mr; m++) store(y, y_bf16, (m0 + m) * ldy + n + r, out[r * MR + m]);
                }
        }
    }
    return 0;
}

/* One token's routed experts, SwiGLU, in one call: out [D] = sum_e w[e] * W2_e (silu(G_e x) * U_e x),
   w13_e = [G_e; U_e] [2I, D] and w2_e [D, I] at ids[e] * stride (bytes for q, words for sz) from their
   base; routing weights fp32 or bf16. Phases split over the team: x's prep; every expert's gate/up
   rows; their activations' prep; every output row over all experts (no accumulation between threads). */
int mlight_int4_moe(const void *x, int x_bf16, int64_t D, int64_t I, int64_t g, int nexp, const int64_t *ids,
                    const void *wts, int w_bf16, const uint8_t *q13, int64_t q13_es, const uint16_t *s13,
                    int64_t s13_es, const uint8_t *q2, int64_t q2_es, const uint16_t *s2, int64_t s2_es, void *out,
                    int out_bf16, uint8_t *scratch, int threads) {
    if (!shape_ok(D, g) || !shape_ok(I, g) || nexp < 1 || nexp > 64) return -1;
    int64_t psd = prep_bytes(1, D), psi = prep_bytes(1, I), ncd = chunks(D), nci = chunks(I);
    int64_t lsd = 2 * D / g, lsi = 2 * I / g; /* words between rows of scales */
    int lg = log2g(g), dg = x_bf16 ? 1 : 2; /* digits an input, for x and the expert activations alike */
    uint8_t *px = scratch, *ph = scratch + psd;
    float *gu = (float *)(ph + nexp * psi), *xf = gu + nexp * 2 * I, *acc = xf + D;
    float w[64];
    for (int e = 0; e < nexp; e++)
        w[e] = w_bf16 ? bf16f(((const uint16_t *)wts)[e]) : ((const float *)wts)[e];
    load_row(x, x_bf16, 0, D, xf);
    OMP(omp parallel num_threads(threads))
    {
        OMP(omp for schedule(static))
        for (int64_t c = 0; c < ncd; c++) prep_chunks(xf, D, px, 1, 0, c, c + 1, dg);
        OMP(omp single)
        fold_groups(px, 1, D, g, 0);
        OMP(omp for schedule(static) collapse(2)) /* NR of the 2I gate/up rows a tile (2I and D: multiples of 32) */
        for (int e = 0; e < nexp; e++)
            for (int64_t i = 0; i < 2 * I; i += NR) {
                float o[NR * MR];
                tile(q13 + ids[e] * q13_es + i * (D / 2), D / 2, s13 + ids[e] * s13_es + i * lsd, lsd, NR, D, lg, px,
                     CB(dg), 1, dg, sums(px, 1, D, 0), 0, o);
                for (int r = 0; r < NR; r++) gu[e * 2 * I + i + r] = o[r * MR];
            }
        OMP(omp for schedule(static) collapse(2))
        for (int e = 0; e < nexp; e++)
            for (int64_t c = 0; c < nci; c++) {
                float *h = gu + e * 2 * I; /* silu(gate) * up over this chunk, in place of the gates */
                for (int64_t k = c * CH; k < min64((c + 1) * CH, I); k++) h[k] = silu_mul(h[k], h[I + k]);
                prep_chunks(h, I, ph + e * psi, 1, 0, c, c + 1, dg);
            }
        OMP(omp for schedule(static))
        for (int e = 0; e < nexp; e++) fold_groups(ph + e * psi, 1, I, g, 0);
        /* expert by expert, so that one expert's prepped activations (18 KB at I = 7168) stay in L1; each
           thread owns the same rows d for every expert (static schedules of equal loops), so it adds into
           its own sums without waiting for the others */
        for (int e = 0; e < nexp; e++) {
            OMP(omp for schedule(static) nowait)
            for (int64_t d0 = 0; d0 < D; d0 += NR) {
                float o[NR * MR];
                tile(q2 + ids[e] * q2_es + d0 * (I / 2), I / 2, s2 + ids[e] * s2_es + d0 * lsi, lsi, NR, I, lg,
                     ph + e * psi, CB(dg), 1, dg, sums(ph + e * psi, 1, I, 0), 0, o);
                for (int r = 0; r < NR; r++) {
                    int64_t d = d0 + r;
                    float t = (e ? acc[d] : 0.f) + w[e] * o[r * MR];
                    if (e + 1 < nexp) acc[d] = t;
                    else store(out, out_bf16, d, t);
                }
            }
        }
    }
    return 0;
}
