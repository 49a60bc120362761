/* A few tokens' routed experts and dense rows on GGUF blocks, Q8_0 and K-quant rows dotted where they lie (decode
   at a small batch: each expert read once for all its tokens; the K-quants' rows also against an expert's few
   activation rows).

   gguf_matmul.c's one-token call decodes each weight row into a buffer of the thread's (the bytes copied,
   each block's half scale widened into two floats) and dots that buffer with the activations: at one
   activation row the copy costs about what the dot does, and the call read Q8_0 experts at half of what one
   core streams (5 of 10-11 GB/s on a 2-core Xeon, the 784M Mixtral's experts). A Q8_0 block is already the
   dot's operands (an f16 scale and 32 signed bytes), so here the dot reads the block itself: the same integer
   dots, the same float products and the same lane order as gguf_matmul.c's int8 tiles (AVX-512 VNNI: two
   blocks a 512-bit vector, even blocks in the low lanes; AVX2: even and odd blocks in two accumulators;
   plain C: 16 lanes), so the result equals `mlight_gguf_moe`'s int8 path bit for bit
   (tests/test_gguf_token.py).

   The K-quants (Q4_K, Q5_K, Q6_K; with AVX-512 VNNI) keep gguf_matmul.c's int16 arithmetic (activations int16
   a 256, the weights int16 with their sub-scales folded in, a super-block's dot an int32 a lane) and so its
   result bit for bit, but four weight rows a tile against the one activation row (their dots overlapping:
   1.25x one row), each super-block's scales unpacked in registers (through the stack they took a third of a
   Q4_K super-block's time) and the next rows prefetched. On the 784M Mixtral's expert shapes (Zen 5, one
   thread, weights from memory) that read Q4_K at 1.2-1.3x gguf_matmul.c's one-row kernel, Q6_K at 1.0x
   (bench/gguf_speed.py --kernel --paths main:int16,token); the same integers on u8 x s8 dots (k8_rows: the
   weights left bytes, the activations split into two bytes once a token) read them at 1.1-1.3x that again
   (Q4_K 24-25, Q5_K 21, Q6_K 15-16 G weights/s). mlight_gguf_token_linear takes a few activation
   rows too (an expert's rows at a small batch's decode): one weight row against up to TM of them, each 32
   values unpacked once for all, 1.1-1.6x gguf_matmul.c's k16 tiles at 2-8 rows (the same shapes). With AVX2
   and in plain C these rows are decoded first, as in gguf_matmul.c. Other formats take gguf_matmul.c's row
   decode as before.

   gguf_matmul.c is compiled into this library (its quantization, SiLU and decoders are the reference here,
   not a copy); the build's flags carry a hash of it, so a change there builds this afresh
   (core.model.cpu.gguf_token). */

#include "gguf_matmul.c"

/* the plain-C integers and floats of tile_scalar (the same float as the SIMD dots) */
static float dot_q8_0_c(const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd) {
    float acc[16] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 34 * b;
        const int8_t *u = (const int8_t *)(p + 2);
        float sd = f16f(p) * xd[b], *a = acc + 8 * (b & 1);
        for (int i = 0; i < 8; i++) {
            int t = 0;
            for (int j = 0; j < 4; j++) t += (int)u[4 * i + j] * (int)xq[32 * b + 4 * i + j];
            a[i] = FMA((float)t, sd, a[i]);
        }
    }
    float c[8];
    for (int i = 0; i < 8; i++) c[i] = acc[i] + acc[i + 8];
    float e0 = c[0] + c[4], e1 = c[1] + c[5], e2 = c[2] + c[6], e3 = c[3] + c[7];
    return (e0 + e2) + (e1 + e3);
}

#define TM 4 /* activation rows a tile of the in-place K-quant dots */
#define AHEAD 4096 /* bytes prefetched ahead of the dot: without it one core streamed 8-11 GB/s here, with it 17-25
                          (2-core Xeon VM; the hardware prefetchers alone fall behind) */

/* w . x for one Q8_0 row of nb blocks and x quantized per 32 (q, d): gguf_matmul.c's tile_simd with the
   block's own bytes and scale in place of the decoded row's. AVX-512: the scale products of 16 blocks at once
   (their halves gathered, 34 bytes apart), a pair's lanes permuted out of them */
static float dot_q8_0(const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd) {
#if SIMD == 2
    const __m512i at = _mm512_set_epi32(15 * 34, 14 * 34, 13 * 34, 12 * 34, 11 * 34, 10 * 34, 9 * 34, 8 * 34,
                                        7 * 34, 6 * 34, 5 * 34, 4 * 34, 3 * 34, 2 * 34, 34, 0);
    const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    int64_t b = 0;
    for (int64_t b0 = 0; b0 + 2 <= nb; b0 += 16) {
        int64_t n = nb - b0 < 16 ? nb - b0 : 16;
        __mmask16 live = (__mmask16)((1u << n) - 1);
        const uint8_t *p0 = row + 34 * b0;
        __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, (const void *)p0, 1);
        __m512 sd = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_maskz_loadu_ps(live, xd + b0));
        for (int64_t j = 0; j + 2 <= n; j += 2) {
            const uint8_t *p = p0 + 34 * j;
            _mm_prefetch((const char *)(p + AHEAD), _MM_HINT_T0);
            __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 2))),
                                           _mm256_loadu_si256((const __m256i *)(p + 36)), 1);
            __m512i a = _mm512_abs_epi8(v), q = _mm512_loadu_si512(xq + 32 * (b0 + j));
            q = _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(v), _mm512_setzero_si512(), q);
            __m512 s = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32((int)j)), sd);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a, q)), s, acc);
        }
        b = b0 + (n & ~(int64_t)1);
    }
    __m256 lo = _mm512_castps512_ps256(acc), hi = _mm512_extractf32x8_ps(acc, 1);
    if (b < nb) { /* an odd block count: the last block is even, the low lanes' */
        const uint8_t *p = row + 34 * b;
        __m256i v = _mm256_loadu_si256((const __m256i *)(p + 2)), a = _mm256_abs_epi8(v);
        __m256i q = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + 32 * b)), v);
        lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(a, q)), _mm256_set1_ps(f16f(p) * xd[b]), lo);
    }
    return hsum8(_mm256_add_ps(lo, hi));
#elif SIMD == 1
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 34 * b;
        if (!(b & 1)) _mm_prefetch((const char *)(p + AHEAD), _MM_HINT_T0);
        __m256i v = _mm256_loadu_si256((const __m256i *)(p + 2)), a = _mm256_abs_epi8(v);
        __m256i q = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + 32 * b)), v);
        acc[b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(a, q)), _mm256_set1_ps(f16f(p) * xd[b]), acc[b & 1]);
    }
    return hsum8(_mm256_add_ps(acc[0], acc[1]));
#else
    return dot_q8_0_c(row, nb, xq, xd);
#endif
}

#if SIMD == 2
/* k16_scales with the scales kept in a register: the sub-scales as int16 in the low lanes of *sc (Q4_K, Q5_K:
   8, the 6-bit unpacking of gguf_matmul.c's sm_k4 on three words; Q6_K: 16), the mins as int32, d and dmin
   from one conversion. Through the stack (k16_scales) this prologue took a third of a Q4_K super-block's time. */
static inline __attribute__((always_inline)) void k16_scales_v(const int kind, const uint8_t *blk, __m512i *sc,
                                                               __m256i *mn, float *d, float *dm) {
    if (kind == 4) {
        *sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))));
        *mn = _mm256_setzero_si256(), *d = f16f(blk + 208), *dm = 0.f;
        return;
    }
    uint32_t u0, u1, u2, dd;
    memcpy(&u0, blk + 4, 4), memcpy(&u1, blk + 8, 4), memcpy(&u2, blk + 12, 4), memcpy(&dd, blk, 4);
    uint32_t s0 = u0 & 0x3f3f3f3f, m0 = u1 & 0x3f3f3f3f;
    uint32_t s1 = (u2 & 0x0f0f0f0f) | (((u0 >> 6) & 0x03030303) << 4);
    uint32_t m1 = ((u2 >> 4) & 0x0f0f0f0f) | (((u1 >> 6) & 0x03030303) << 4);
    *sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)s1, (int)s0)));
    *mn = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)m1, (int)m0));
    __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd));
    *d = _mm_cvtss_f32(f), *dm = _mm_cvtss_f32(_mm_movehdup_ps(f));
}

/* Q5_K's values 32j..32j + 31 as int16 weights with their sub-scale (k16_w's integers), the scales from a
   register */
static inline __attribute__((always_inline)) __m512i k16_wv(const uint8_t *blk, __m512i sc, int j) {
    __m512i s = _mm512_permutexvar_epi16(_mm512_set1_epi16((short)j), sc);
    return _mm512_mullo_epi16(_mm512_cvtepu8_epi16(u32_k(3, blk, j)), s);
}

/* w . x[m] for NR rows ldw bytes apart of kind 2-4 (K values each) and MRC rows x of int16 a 256: gguf_matmul.c's
   k16_tile (the same integers a lane, the same FMAs, so the same floats), with the prefetch the Q8_0 dot has,
   the scales in registers, and each super-block's integer dots in two chains an activation row (their sum is
   exact, its order free); each weight row's 32 values unpacked once for all MRC rows. Q4_K's 32 bytes of two
   sub-blocks are widened to int16 once and split into nibbles there. out [NR][MRC] */
static inline __attribute__((always_inline)) void k16_rows(const int kind, const uint8_t *row, int64_t ldw,
                                                           const int NR, int64_t K, const KQRow *x, const int MRC,
                                                           float *out) {
    __m256 acc[4][TM];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MRC; m++) acc[r][m] = _mm256_setzero_ps();
    /* the next tile's rows follow these: AHEAD bytes on, or where a tile spans more, the same place a tile on (4
       rows of K = 3840 span 8-13 KB: 4 KB ahead fell inside the tile, and the down rows ran at 0.6-0.8x) */
    int64_t ahead = NR * ldw > AHEAD ? NR * ldw : AHEAD;
    for (int64_t b = 0; b < K / 256; b++) {
        const int16_t *q[TM];
        for (int m = 0; m < MRC; m++) q[m] = x[m].q + 256 * b;
        for (int r = 0; r < NR; r++) {
            const uint8_t *blk = row + r * ldw + b * TS[kind];
            for (int c = 0; c < TS[kind]; c += 64) _mm_prefetch((const char *)(blk + ahead + c), _MM_HINT_T0);
            __m512i sc;
            __m256i mn;
            float d, dm;
            k16_scales_v(kind, blk, &sc, &mn, &d, &dm);
            __m512i t0[TM], t1[TM];
            for (int m = 0; m < MRC; m++) t0[m] = t1[m] = _mm512_setzero_si512();
            if (kind == 2) {
                const __m512i m4 = _mm512_set1_epi16(15);
                for (int i = 0; i < 4; i++) {
                    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * i)));
                    __m512i s0 = _mm512_permutexvar_epi16(_mm512_set1_epi16((short)(2 * i)), sc);
                    __m512i s1 = _mm512_permutexvar_epi16(_mm512_set1_epi16((short)(2 * i + 1)), sc);
                    __m512i w0 = _mm512_mullo_epi16(_mm512_and_si512(v, m4), s0);
                    __m512i w1 = _mm512_mullo_epi16(_mm512_srli_epi16(v, 4), s1);
                    for (int m = 0; m < MRC; m++) {
                        t0[m] = k16_dot(t0[m], w0, q[m] + 64 * i);
                        t1[m] = k16_dot(t1[m], w1, q[m] + 64 * i + 32);
                    }
                }
            } else if (kind == 4) { /* a half's ql and qh bytes widened once for its four 32s (u32_k's bits) */
                const __m512i m4 = _mm512_set1_epi16(15), m30 = _mm512_set1_epi16(0x30), c32 = _mm512_set1_epi16(32);
                for (int h = 0; h < 2; h++) {
                    __m512i l0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 64 * h)));
                    __m512i l1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32)));
                    __m512i hb = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
                    __m512i u[4] = {
                        _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 4), m30)),
                        _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 2), m30)),
                        _mm512_or_si512(_mm512_srli_epi16(l0, 4), _mm512_and_si512(hb, m30)),
                        _mm512_or_si512(_mm512_srli_epi16(l1, 4), _mm512_and_si512(_mm512_srli_epi16(hb, 2), m30))};
                    for (int t = 0; t < 4; t++) {
                        int j = 4 * h + t;
                        __m512i at = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)),
                                                        _mm256_set1_epi16((short)(2 * j + 1)), 1);
                        __m512i sj = _mm512_permutexvar_epi16(at, sc); /* scales 2j, 2j + 1: a 16 each */
                        __m512i w = _mm512_mullo_epi16(_mm512_sub_epi16(u[t], c32), sj);
                        for (int m = 0; m < MRC; m++) {
                            if (t & 1) t1[m] = k16_dot(t1[m], w, q[m] + 32 * j);
                            else t0[m] = k16_dot(t0[m], w, q[m] + 32 * j);
                        }
                    }
                }
            } else
                for (int j = 0; j < KN; j += 2) {
                    __m512i w0 = k16_wv(blk, sc, j), w1 = k16_wv(blk, sc, j + 1);
                    for (int m = 0; m < MRC; m++) {
                        t0[m] = k16_dot(t0[m], w0, q[m] + 32 * j);
                        t1[m] = k16_dot(t1[m], w1, q[m] + 32 * j + 32);
                    }
                }
            for (int m = 0; m < MRC; m++)
                acc[r][m] = k16_lanes(kind, fold8(_mm512_add_epi32(t0[m], t1[m])), x[m].bs + 8 * b, mn, d, dm,
                                      x[m].d[b], acc[r][m]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MRC; m++) out[r * MRC + m] = hsum8(acc[r][m]);
}

/* ---- one activation row on u8 x s8 dots, the int16 path's integers kept ----------------------------------
   At one activation row k16_rows spends most of its instructions making int16 weights (widening, the sub-scale
   broadcast and multiply) for one dot each. Here the weights stay the file's unsigned bytes (Q4_K 0..15, Q5_K
   0..31, Q6_K 0..63) and each int16 activation is split once a token into two signed bytes, q = 256 h + l with l
   q's signed low byte (-128..127) and h = (q - l) / 256 (|q| <= 16383, so |h| <= 64): maddubs turns a pair of
   weight bytes and a pair of h (l) bytes into one int16, and vpdpwssd multiplies it by the pair's sub-scale into
   an int32 lane, for h and l in two accumulators; 256 th + tl is then the int16 path's lane.
   Exact: maddubs saturates at |32767| and its pairs are at most 2 * 63 * 128 = 16128 (Q6_K's l; Q6_K's -32
   offset is taken off the int16 pairs, 32 (a + b) of each pair of activation bytes, precomputed: |pair| <=
   2 * 32 * 128 after it); vpdpwssd's products (int16 x int16) are exact in int32 and its and vpaddd's sums
   wrap modulo 2^32, so th, tl and 256 th + tl are the int16 path's sums modulo 2^32 and, as those lie in int32
   (gguf_matmul.c's bound: |lane| < 2^31 - 2^17), equal to them. The lanes must hold the same values as
   k16_rows' (their float conversion rounds): lane i of a 32-value sub-block holds values 2i, 2i + 1, 2i + 16,
   2i + 17 there, so the weight bytes are permuted (vpermw: word 2i <- word i, 2i + 1 <- word i + 8 of each 32
   bytes) and the activation bytes stored in that order. Each 512-bit vector holds two sub-blocks (a slot): the
   low and high nibbles of 64 qs bytes (Q4_K, Q5_K: sub-blocks 0 and 2, 1 and 3, 4 and 6, 5 and 7), Q6_K's 32
   values t = 0, 1 or 2, 3 of a half. */
#define KB 1024 /* bytes of a super-block's split activations: slot v's h at 128v, its l at 128v + 64; Q6_K's
                   pair offsets (int16) at 512 + 128v and 512 + 128v + 64 */
static const int SLOT[2][4][2] = {{{0, 2}, {1, 3}, {4, 6}, {5, 7}}, {{0, 1}, {2, 3}, {4, 5}, {6, 7}}};

/* the activation row x (K) split for kind's slots into xb (K / 256 * KB bytes): byte p of a 32 holds value
   2 (p >> 2) + (p & 1) + 16 ((p >> 1) & 1) (a vpermw), l = q's low byte sign-extended, h = (q - l) >> 8 (exact:
   q - l is a multiple of 256); Q6_K's pair offsets 32 (a + b) by maddubs (|32 (a + b)| <= 8192) */
static void split_row(int kind, const KQRow *x, int64_t K, int8_t *xb) {
    const __m512i at = _mm512_set_epi16(31, 30, 15, 14, 29, 28, 13, 12, 27, 26, 11, 10, 25, 24, 9, 8,
                                        23, 22, 7, 6, 21, 20, 5, 4, 19, 18, 3, 2, 17, 16, 1, 0);
    for (int64_t b = 0; b < K / 256; b++) {
        int8_t *o = xb + KB * b;
        for (int v = 0; v < 4; v++)
            for (int hh = 0; hh < 2; hh++) {
                __m512i q = _mm512_permutexvar_epi16(
                    at, _mm512_loadu_si512(x->q + 256 * b + 32 * SLOT[kind == 4][v][hh]));
                __m512i l = _mm512_srai_epi16(_mm512_slli_epi16(q, 8), 8), h = _mm512_srai_epi16(_mm512_sub_epi16(q, l), 8);
                _mm256_storeu_si256((__m256i *)(o + 128 * v + 32 * hh), _mm512_cvtepi16_epi8(h));
                _mm256_storeu_si256((__m256i *)(o + 128 * v + 64 + 32 * hh), _mm512_cvtepi16_epi8(l));
            }
        if (kind == 4)
            for (int w = 0; w < 8; w++) /* w even: slot w / 2's h pairs, odd: its l pairs */
                _mm512_storeu_si512(o + 512 + 64 * w, _mm512_maddubs_epi16(_mm512_set1_epi8(32), _mm512_loadu_si512(o + 64 * w)));
    }
}

static inline __m512i idx16(int lo, int hi) { /* words 0-15: lo, 16-31: hi */
    return _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1);
}

/* the 16 bytes at p, p + ldw, ... of NR (1-4) rows in a 512-bit vector's 128-bit lanes (the rest zero) */
static inline __attribute__((always_inline)) __m512i lanes4(const uint8_t *p, int64_t ldw, const int NR) {
    __m512i l = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)p));
    if (NR > 1) l = _mm512_inserti32x4(l, _mm_loadu_si128((const __m128i *)(p + ldw)), 1);
    if (NR > 2) l = _mm512_inserti32x4(l, _mm_loadu_si128((const __m128i *)(p + 2 * ldw)), 2);
    if (NR > 3) l = _mm512_inserti32x4(l, _mm_loadu_si128((const __m128i *)(p + 3 * ldw)), 3);
    return l;
}

/* Q4_K / Q5_K: the first 16 bytes of NR blocks (lanes4) to, a lane each, the 8 six-bit sub-scales (bytes 0-7)
   and the 8 six-bit mins (8-15), sm_k4's unpacking in one go for the tile's rows (scale byte i at i + 4: sub-scale
   j < 4 is byte j + 4's low 6 bits, j >= 4 byte j + 8's low nibble and byte j's top 2 bits; min j < 4 byte j + 8's
   low 6 bits, j >= 4 byte j + 8's high nibble and byte j + 4's top 2 bits) */
static inline __m512i k4_scales4(__m512i l) {
    const __m512i ia = _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i ib = _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    const __m512i ma = _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m512i mh = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    __m512i a = _mm512_shuffle_epi8(l, ia), h = _mm512_shuffle_epi8(l, ib);
    __m512i lo = _mm512_or_si512(_mm512_and_si512(a, ma), _mm512_and_si512(_mm512_srli_epi16(a, 4), mh));
    return _mm512_or_si512(lo, _mm512_and_si512(_mm512_srli_epi16(h, 2), _mm512_set1_epi8(0x30)));
}

/* w . x for NR (1, 2, 4) rows ldw bytes apart of kind 2-4 (K values each) and one activation row x split at xb:
   the same integers a lane as k16_rows with one row, the same float products and sums. The tile's scales are
   unpacked together (the rows' scale bytes a 128-bit lane each: one shuffle-and-mask pass, then a vpermw per
   sub-block pair and row), and the float lanes of two rows share a 512-bit vector (the same FMAs a lane) */
static inline __attribute__((always_inline)) void k8_rows(const int kind, const uint8_t *row, int64_t ldw,
                                                          const int NR, int64_t K, const KQRow *x, const int8_t *xb,
                                                          float *out) {
    /* word 2i <- i, 2i + 1 <- i + 8 in each 16 (pw), the low 16 into both halves (pb) */
    const __m512i pw = _mm512_set_epi16(31, 23, 30, 22, 29, 21, 28, 20, 27, 19, 26, 18, 25, 17, 24, 16,
                                        15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    const __m512i pb = _mm512_set_epi16(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0,
                                        15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const int NP = (NR + 1) / 2; /* row pairs */
    /* six[v]: slot v's scales (int16) shuffled out of the 8 words in every 128-bit lane (vpshufb: Q4_K, Q5_K a
       row's 8 sub-scales; Q6_K scales 8 (v >> 1) .. 8 (v >> 1) + 7 of its 16) */
    __m512i six[4], bit[4];
    for (int v = 0; v < 4; v++) {
        int ja = SLOT[kind == 4][v][0], jb = SLOT[kind == 4][v][1];
        if (kind == 4) /* Q6_K: a 16's scale a word, alternating (values 2i, 2i + 1 | 2i + 16, 2i + 17) */
            six[v] = _mm512_add_epi16(idx16((2 * ja % 8) * 0x202 + 0x100, (2 * jb % 8) * 0x202 + 0x100),
                                      _mm512_set1_epi32(0x02020000));
        else six[v] = idx16(ja * 0x202 + 0x100, jb * 0x202 + 0x100);
        bit[v] = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << ja)), _mm256_set1_epi8((char)(1 << jb)), 1);
    }
    const __m512i pair = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1); /* 0 x 8, 1 x 8 */
    __m512 acc[2];
    for (int p = 0; p < NP; p++) acc[p] = _mm512_setzero_ps();
    /* twice k16_rows' distance, into L2: into L1 (T0) the tile's lines ran this loop at 0.7-0.8x k16_rows from
       memory (1.1x from cache); into L2 1.2-1.3x (Zen 5, the 784M Mixtral's expert shapes, 8 experts) */
    int64_t ahead = 2 * (NR * ldw > AHEAD ? NR * ldw : AHEAD);
    for (int64_t b = 0; b < K / 256; b++) {
        const int8_t *a = xb + KB * b;
        const uint8_t *b0 = row + b * TS[kind];
        __m512i sw[2], mnp[2]; /* a pair's scales as int16 (16 words a row), its mins as int32 (8 a row) */
        __m256 dd; /* d dx and dmin dx of row r at 2r, 2r + 1 (Q6_K: d dx at r) */
        __m512 dx = _mm512_set1_ps(x->d[b]);
        if (kind == 4) {
            __m512i l = lanes4(b0 + 192, ldw, NR);
            sw[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(l)), sw[1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(l, 1));
            __m128i h = _mm_cvtsi32_si128(b0[208] | b0[209] << 8);
            for (int r = 1; r < NR; r++) h = _mm_insert_epi16(h, b0[r * ldw + 208] | b0[r * ldw + 209] << 8, r);
            dd = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm512_castps512_ps256(dx));
        } else {
            __m512i l = lanes4(b0, ldw, NR), sm = k4_scales4(l);
            sw[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(sm)), sw[1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(sm, 1));
            const __m512i hi8 = _mm512_set_epi64(7, 7, 7, 7, 7, 5, 3, 1); /* each lane's bytes 8-15: the mins */
            __m512i mq = _mm512_permutexvar_epi64(hi8, sm);
            mnp[0] = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(mq));
            mnp[1] = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(mq, 1));
            __m128i h = _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), l));
            dd = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm512_castps512_ps256(dx));
        }
        __m512i t[4];
        for (int r = 0; r < NR; r++) {
            const uint8_t *blk = b0 + r * ldw;
            for (int c = 0; c < TS[kind]; c += 64) _mm_prefetch((const char *)(blk + ahead + c), _MM_HINT_T1);
            __m512i u[4];
            if (kind == 4)
                for (int c = 0; c < 2; c++) {
                    __m512i lq = _mm512_permutexvar_epi16(pw, _mm512_loadu_si512(blk + 64 * c));
                    __m512i hq = _mm512_permutexvar_epi16(
                        pb, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c))));
                    u[2 * c] = _mm512_or_si512(_mm512_and_si512(lq, m4),
                                               _mm512_and_si512(_mm512_sllv_epi16(hq, idx16(4, 2)), m30));
                    u[2 * c + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lq, 4), m4),
                                                   _mm512_and_si512(_mm512_srlv_epi16(hq, idx16(0, 2)), m30));
                }
            else {
                const uint8_t *qs = blk + (kind == 2 ? 16 : 48);
                for (int c = 0; c < 2; c++) {
                    __m512i v = _mm512_permutexvar_epi16(pw, _mm512_loadu_si512(qs + 64 * c));
                    u[2 * c] = _mm512_and_si512(v, m4), u[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                }
                if (kind == 3) { /* Q5_K: bit j of qh's bytes is sub-block j's fifth bit */
                    __m512i hq = _mm512_permutexvar_epi16(
                        pb, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + 16))));
                    for (int v = 0; v < 4; v++)
                        u[v] = _mm512_mask_add_epi8(u[v], _mm512_test_epi8_mask(hq, bit[v]), u[v], _mm512_set1_epi8(16));
                }
            }
            __m512i th = _mm512_setzero_si512(), tl = _mm512_setzero_si512();
            /* the row's (first) 8 scales in every 128-bit lane; Q6_K's second 8 for slots 2, 3 */
            __m512i q = sw[r >> 1];
            __m512i rl = r & 1 ? _mm512_shuffle_i64x2(q, q, 0xaa) : _mm512_shuffle_i64x2(q, q, 0), rh = rl;
            if (kind == 4) rh = r & 1 ? _mm512_shuffle_i64x2(q, q, 0xff) : _mm512_shuffle_i64x2(q, q, 0x55);
            for (int v = 0; v < 4; v++) {
                __m512i sv = _mm512_shuffle_epi8(kind == 4 && v >= 2 ? rh : rl, six[v]);
                __m512i ph = _mm512_maddubs_epi16(u[v], _mm512_loadu_si512(a + 128 * v));
                __m512i pl = _mm512_maddubs_epi16(u[v], _mm512_loadu_si512(a + 128 * v + 64));
                if (kind == 4) {
                    ph = _mm512_sub_epi16(ph, _mm512_loadu_si512(a + 512 + 128 * v));
                    pl = _mm512_sub_epi16(pl, _mm512_loadu_si512(a + 512 + 128 * v + 64));
                }
                th = _mm512_dpwssd_epi32(th, ph, sv), tl = _mm512_dpwssd_epi32(tl, pl, sv);
            }
            t[r] = _mm512_add_epi32(_mm512_slli_epi32(th, 8), tl);
        }
        if (NR == 1) t[1] = _mm512_setzero_si512();
        const __m512 dz = _mm512_castps256_ps512(dd);
        const __m512i bs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->bs + 8 * b)));
        for (int p = 0; p < NP; p++) { /* rows 2p, 2p + 1: fold8 of each into one vector's halves, k16_lanes' FMAs */
            __m512i f = _mm512_add_epi32(_mm512_shuffle_i64x2(t[2 * p], t[2 * p + 1], 0x44),
                                         _mm512_shuffle_i64x2(t[2 * p], t[2 * p + 1], 0xee));
            if (kind == 4) {
                __m512 sd = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(2 * p)), dz);
                acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(f), sd, acc[p]);
            } else {
                __m512i at = _mm512_add_epi32(_mm512_add_epi32(pair, pair), _mm512_set1_epi32(4 * p));
                __m512 sd = _mm512_permutexvar_ps(at, dz), sm = _mm512_permutexvar_ps(_mm512_add_epi32(at, _mm512_set1_epi32(1)), dz);
                acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(f), sd, acc[p]);
                acc[p] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(mnp[p], bs)), sm, acc[p]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = hsum8(r & 1 ? _mm512_extractf32x8_ps(acc[r >> 1], 1) : _mm512_castps512_ps256(acc[r >> 1]));
}

/* the K-quant activation row quantized at xp split for kind's u8 dots into xb */
static void split_kq(int kind, uint8_t *xp, int64_t K, int8_t *xb) {
    KQRow x = kqrow_at(xp, K);
    split_row(kind, &x, K, xb);
}

static void k8_n(int kind, const uint8_t *row, int64_t ldw, int NR, int64_t K, const KQRow *x, const int8_t *xb,
                 float *out) {
#define K8_N(k) switch (NR) { case 1: k8_rows(k, row, ldw, 1, K, x, xb, out); break; \
                              case 2: k8_rows(k, row, ldw, 2, K, x, xb, out); break; \
                              default: k8_rows(k, row, ldw, 4, K, x, xb, out); break; }
    switch (kind) {
    case 2: K8_N(2) break;
    case 3: K8_N(3) break;
    default: K8_N(4) break;
    }
#undef K8_N
}

/* k16_rows specialised: NR (1, 2 or 4) weight rows ldw bytes apart of kind 2-4 against one activation row, or
   one weight row against mr (2..TM) rows (a second weight row alongside ran 0.9-1.1x that, Zen 5: the
   registers of 2 x mr accumulators) */
static void k16_n(int kind, const uint8_t *row, int64_t ldw, int NR, int64_t K, const KQRow *x, int mr, float *out) {
#define K16_N(k) switch (mr > 1 ? mr : -NR) { case -1: k16_rows(k, row, ldw, 1, K, x, 1, out); break; \
                                               case -2: k16_rows(k, row, ldw, 2, K, x, 1, out); break; \
                                               case -4: k16_rows(k, row, ldw, 4, K, x, 1, out); break; \
                                               case 2: k16_rows(k, row, ldw, 1, K, x, 2, out); break; \
                                               case 3: k16_rows(k, row, ldw, 1, K, x, 3, out); break; \
                                               default: k16_rows(k, row, ldw, 1, K, x, 4, out); break; }
    switch (kind) {
    case 2: K16_N(2) break;
    case 3: K16_N(3) break;
    default: K16_N(4) break;
    }
#undef K16_N
}
#endif

/* a row of format `kind` (K values) . the activation row quantized at xp: Q8_0 in place, else decoded into
   own (gguf_matmul.c's dot_one); simd 0: the plain-C dots */
static float dot_row(int kind, const uint8_t *row, int64_t K, uint8_t *xp, uint8_t *own, int64_t RW, int simd) {
    if (kind != 0) return dot_one(kind, row, K, xp, own, RW, simd);
    QRow x = qrow_at(xp, K);
    return simd ? dot_q8_0(row, K / 32, x.q, x.d) : dot_q8_0_c(row, K / 32, x.q, x.d);
}

#define TR 4 /* weight rows a tile at one token: 1.25x one row (Q4_K, AVX-512 VNNI), the rows' dots overlapping */

#if SIMD != 2
#define KB 0
static void split_kq(int kind, uint8_t *xp, int64_t K, int8_t *xb) { (void)kind, (void)xp, (void)K, (void)xb; }
#endif

/* out[r] = row r . x for nr (1..TR) rows ldw bytes apart: the K-quants' in-place tiles (on xb, x split by
   split_row, where SIMD == 2), else row by row */
static void dot_tile(int kind, const uint8_t *row, int64_t ldw, int nr, int64_t K, uint8_t *xp, const int8_t *xb,
                     uint8_t *own, int64_t RW, int simd, float *out) {
#if SIMD == 2
    if (simd && is_k(kind)) {
        KQRow x = kqrow_at(xp, K);
        if (nr == 3) {
            k8_n(kind, row, ldw, 2, K, &x, xb, out);
            k8_n(kind, row + 2 * ldw, ldw, 1, K, &x, xb, out + 2);
        } else k8_n(kind, row, ldw, nr, K, &x, xb, out);
        return;
    }
#else
    (void)xb;
#endif
    for (int r = 0; r < nr; r++) out[r] = dot_row(kind, row + r * ldw, K, xp, own, RW, simd);
}

#define MAX_SLOTS 512 /* (token, expert) pairs a mlight_gguf_tokens_moe call takes */
/* tiles a thread takes at a time: a phase's tiles in CHUNKS runs a thread, at least 16 tiles (64 rows). Runs of
   16 tiles, dealt alternately, broke each thread's stream every 64 rows: at one token the 784M Mixtral's Q4_K
   experts came 1.2-1.3x faster in long runs on two Zen 5 cores (1.0-1.1x for Q8_0, whose rows are wider) */
#define CHUNKS 4
static inline int64_t chunk_of(int64_t tiles, int threads) {
    int64_t c = (tiles + CHUNKS * threads - 1) / (CHUNKS * threads);
    return c < 16 ? 16 : c;
}

/* the rows `at` (a group's slots, nr of them) of an expert's matrix tile [n, n + nr) (rows ldw bytes apart):
   out[s][r] (slot s's row r, TR floats a slot) = row . the slot's activation row (quantized at xq + s * qb; split
   at xb + s * sb where SIMD == 2). One slot: dot_tile's 4-row tiles; several (a K-quant on the SIMD dots): each
   weight row once against up to TM of them (k16_n); other formats' rows decoded once for all of them (the
   in-place Q8_0 dot unpacks a block's scale and signs again for every slot); else each slot in turn. The same
   floats either way. */
static void group_tile(int kind, const uint8_t *w, int64_t ldw, int nr, int64_t K, const int *at, int ns, uint8_t *xq,
                       int64_t qb, const int8_t *xb, int64_t sb, uint8_t *own, int64_t RW, int simd, float *out) {
#if SIMD == 2
    if (ns > 1 && simd && is_k(kind)) {
        KQRow xs[TM];
        float v[TM];
        for (int r = 0; r < nr; r++)
            for (int s0 = 0; s0 < ns; s0 += TM) {
                int mr = ns - s0 < TM ? ns - s0 : TM;
                for (int m = 0; m < mr; m++) xs[m] = kqrow_at(xq + at[s0 + m] * qb, K);
                k16_n(kind, w + r * ldw, ldw, 1, K, xs, mr, v);
                for (int m = 0; m < mr; m++) out[at[s0 + m] * TR + r] = v[m];
            }
        return;
    }
#endif
    if (ns > 1 && !is_k(kind)) { /* each weight row decoded once for all the slots (gguf_matmul.c's int8 tiles) */
        QRow xs[MR];
        float v[MR];
        WRow wr = wrow_at(own, RW);
        for (int r = 0; r < nr; r++) {
            decode_row_i8(kind, w + r * ldw, K, wr);
            for (int s0 = 0; s0 < ns; s0 += MR) {
                int mr = ns - s0 < MR ? ns - s0 : MR;
                for (int m = 0; m < mr; m++) xs[m] = qrow_at(xq + at[s0 + m] * qb, K);
                dot_rows_i8(kind, wr, K, xs, mr, simd, v);
                for (int m = 0; m < mr; m++) out[at[s0 + m] * TR + r] = v[m];
            }
        }
        return;
    }
    for (int i = 0; i < ns; i++)
        dot_tile(kind, w, ldw, nr, K, xq + at[i] * qb, xb + at[i] * sb, own, RW, simd, out + at[i] * TR);
}

/* M tokens' routed experts, SwiGLU: out[m] (ldo apart) = sum_j w[m, j] * W2_e (silu(G_e x_m) * U_e x_m), e =
   ids[m, j], for x [M, D] (rows ldx apart), ids int64 and routing weights (fp32 or bf16) [M, nexp]; W13_e and W2_e
   as mlight_gguf_moe's. Each expert a slot routes to is read once for all its slots (a small batch's decode), and
   every token's result equals the same token alone (M = 1) bit for bit: each slot's rows dotted as one token's
   (group_tile), each output summed over the token's experts in the order given. Phases split over the team: the
   experts' gate/up tiles; SiLU and each slot's h quantized; the down tiles; the sums. path 1 plain C, 2 SIMD; scratch as
   mlight_gguf_tokens_moe_scratch. */
int mlight_gguf_tokens_moe(int k13, int k2, const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t D, int64_t I,
                           int nexp, const int64_t *ids, const void *wts, int w_bf16, const uint8_t *w13, int64_t e13,
                           int64_t ldw13, const uint8_t *w2, int64_t e2, int64_t ldw2, void *out, int out_bf16,
                           int64_t ldo, float *scratch, int threads, int path) {
    int64_t S = M * nexp;
    if (k13 < 0 || k13 > 5 || k2 < 0 || k2 > 5 || D % BS[k13] || I % BS[k2] || nexp < 1 || nexp > 64 || M < 1 ||
        S > MAX_SLOTS || threads < 1 || path < 1 || path > 2)
        return -1;
    int simd = path == 2, split13 = simd && SIMD == 2 && is_k(k13), split2 = simd && SIMD == 2 && is_k(k2);
    int64_t RW = D > I ? D : I, qd = xrow_bytes(k13, D), qi = xrow_bytes(k2, I), sd = D / 256 * KB, si = I / 256 * KB;
    int64_t wb = wrow_bytes(RW) > kwrow_bytes(RW) ? wrow_bytes(RW) : kwrow_bytes(RW);
    /* gu: each slot's gate|up, then h; ys: each slot's down rows; v: a tile's dots, TR a slot, per thread */
    float *gu = scratch, *ys = gu + S * 2 * I, *v = ys + S * D, w[MAX_SLOTS];
    uint8_t *xq = (uint8_t *)(v + (int64_t)threads * S * TR), *hq = xq + S * qd, *wq = hq + S * qi;
    int8_t *xb = (int8_t *)(wq + (int64_t)threads * wb), *hb = xb + S * sd;
    /* the slots grouped by expert (ascending, slots in order): `at` holds them, group g at at[g0[g]..g0[g + 1]) */
    int at[MAX_SLOTS], g0[MAX_SLOTS + 1], ng = 0;
    int64_t ge[MAX_SLOTS];
    for (int64_t s = 0; s < S; s++) {
        if (ids[s] < 0) return -1;
        w[s] = w_bf16 ? bf16f(((const uint16_t *)wts)[s]) : ((const float *)wts)[s];
    }
    for (int64_t e = -1, n = 0; n < S;) { /* the next expert above e, its slots appended */
        int64_t next = INT64_MAX;
        for (int64_t s = 0; s < S; s++) next = ids[s] > e && ids[s] < next ? ids[s] : next;
        g0[ng] = (int)n, ge[ng++] = e = next;
        for (int64_t s = 0; s < S; s++)
            if (ids[s] == e) at[n++] = (int)s;
    }
    g0[ng] = (int)S;
    /* each slot's copy of its token's row, quantized (and split): a group's slots index one array */
    for (int64_t s = 0; s < S; s++) {
        const int64_t m = s / nexp;
        if (s % nexp == 0) {
            const void *r = x_bf16 ? (const void *)((const uint16_t *)x + m * ldx)
                                   : (const void *)((const float *)x + m * ldx);
            quantize_for(k13, r, x_bf16, D, xq + s * qd);
            if (split13) split_kq(k13, xq + s * qd, D, xb + s * sd);
        } else {
            memcpy(xq + s * qd, xq + (s - 1) * qd, qd);
            if (split13) memcpy(xb + s * sd, xb + (s - 1) * sd, sd);
        }
    }
    OMP(omp parallel num_threads(threads))
    {
        int t = THREAD_ID();
        uint8_t *own = wq + (int64_t)t * wb;
        float *vt = v + (int64_t)t * S * TR;
        int64_t t13 = (2 * I + TR - 1) / TR; /* tiles of an expert's gate/up rows */
        /* dealt in runs as threads come free: a static split gave one thread the experts with more slots */
        const int64_t c13 = chunk_of(ng * t13, threads);
        OMP(omp for schedule(dynamic, c13))
        for (int64_t r = 0; r < ng * t13; r++) {
            int64_t g = r / t13, n = TR * (r % t13);
            int nr = 2 * I - n < TR ? (int)(2 * I - n) : TR;
            group_tile(k13, w13 + ge[g] * e13 + n * ldw13, ldw13, nr, D, at + g0[g], g0[g + 1] - g0[g], xq, qd, xb,
                       sd, own, RW, simd, vt);
            for (int i = g0[g]; i < g0[g + 1]; i++)
                for (int q = 0; q < nr; q++) gu[at[i] * 2 * I + n + q] = vt[at[i] * TR + q];
        }
        OMP(omp for schedule(static))
        for (int64_t s = 0; s < S; s++) {
            float *h = gu + s * 2 * I;
            for (int64_t i = 0; i < I; i++) h[i] = h[i] / (1.f + expf(-h[i])) * h[I + i];
            quantize_for(k2, h, 0, I, hq + s * qi);
            if (split2) split_kq(k2, hq + s * qi, I, hb + s * si);
        }
        int64_t t2 = (D + TR - 1) / TR; /* tiles of an expert's down rows */
        const int64_t c2 = chunk_of(ng * t2, threads);
        OMP(omp for schedule(dynamic, c2))
        for (int64_t r = 0; r < ng * t2; r++) { /* expert by expert: its rows streamed in order */
            int64_t g = r / t2, d = TR * (r % t2);
            int nr = D - d < TR ? (int)(D - d) : TR;
            group_tile(k2, w2 + ge[g] * e2 + d * ldw2, ldw2, nr, I, at + g0[g], g0[g + 1] - g0[g], hq, qi, hb, si,
                       own, RW, simd, vt);
            for (int i = g0[g]; i < g0[g + 1]; i++)
                for (int q = 0; q < nr; q++) ys[at[i] * D + d + q] = vt[at[i] * TR + q];
        }
        OMP(omp for schedule(static))
        for (int64_t md = 0; md < M * D; md++) { /* each output summed over the token's experts in their order */
            int64_t m = md / D, d = md % D;
            float y = 0;
            for (int j = 0; j < nexp; j++) y += w[m * nexp + j] * ys[(m * nexp + j) * D + d];
            put(out, out_bf16, m * ldo + d, y);
        }
    }
    return 0;
}

/* floats of scratch a mlight_gguf_tokens_moe call needs */
int64_t mlight_gguf_tokens_moe_scratch(int64_t M, int64_t D, int64_t I, int nexp, int threads) {
    int64_t S = M * nexp, RW = D > I ? D : I;
    int64_t qd = qrow_bytes(D) > kqrow_bytes(D) ? qrow_bytes(D) : kqrow_bytes(D);
    int64_t qi = qrow_bytes(I) > kqrow_bytes(I) ? qrow_bytes(I) : kqrow_bytes(I);
    int64_t wb = wrow_bytes(RW) > kwrow_bytes(RW) ? wrow_bytes(RW) : kwrow_bytes(RW);
    int64_t bytes = S * (qd + qi + (D / 256 + I / 256) * KB) + threads * wb;
    return S * (2 * I + D) + (int64_t)threads * S * TR + (bytes + 3) / 4;
}

/* one token: mlight_gguf_tokens_moe with M = 1 (the ABI older revisions' callers bind) */
int mlight_gguf_token_moe(int k13, int k2, const void *x, int x_bf16, int64_t D, int64_t I, int nexp,
                          const int64_t *ids, const void *wts, int w_bf16, const uint8_t *w13, int64_t e13,
                          int64_t ldw13, const uint8_t *w2, int64_t e2, int64_t ldw2, void *out, int out_bf16,
                          float *scratch, int threads, int path) {
    return mlight_gguf_tokens_moe(k13, k2, x, x_bf16, D, 1, D, I, nexp, ids, wts, w_bf16, w13, e13, ldw13, w2, e2, ldw2,
                                  out, out_bf16, D, scratch, threads, path);
}

/* mlight_gguf_linear's integer paths (1 plain C, 2 SIMD) for a few activation rows: y [M, N] (rows ldy apart) =
   x [M, K] (rows ldx apart) . W^T, W's rows ldw bytes apart in blocks of `kind`, Q8_0 dotted in place; the
   K-quants' SIMD rows (AVX-512 VNNI) in place too, each weight row against up to TM activation rows at once
   (read once for all of them); elsewhere each activation row in turn. scratch as
   mlight_gguf_token_linear_scratch(M, K, threads) */
int mlight_gguf_token_linear(int kind, const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint8_t *w,
                             int64_t ldw, int64_t N, void *y, int y_bf16, int64_t ldy, float *scratch, int threads,
                             int path) {
    if (kind < 0 || kind > 5 || K % BS[kind] || M < 1 || threads < 1 || path < 1 || path > 2) return -1;
    int64_t wb = wrow_bytes(K) > kwrow_bytes(K) ? wrow_bytes(K) : kwrow_bytes(K), qb = xrow_bytes(kind, K);
    uint8_t *xq = (uint8_t *)scratch, *rows = xq + M * qb;
    for (int64_t m = 0; m < M; m++) {
        const void *r = x_bf16 ? (const void *)((const uint16_t *)x + m * ldx) : (const void *)((const float *)x + m * ldx);
        quantize_for(kind, r, x_bf16, K, xq + m * qb);
    }
    /* one row of a K-quant on the u8 dots (SIMD == 2): split past the threads' rows */
    int8_t *xb = (int8_t *)(rows + (int64_t)threads * wb);
#if SIMD == 2
    int wide = M > 1 && path == 2 && is_k(kind);
    if (M == 1 && path == 2 && is_k(kind)) split_kq(kind, xq, K, xb);
#endif
    OMP(omp parallel num_threads(threads))
    {
        int t = THREAD_ID();
        uint8_t *own = rows + (int64_t)t * wb;
#if SIMD == 2
        if (wide) {
            KQRow xs[TM];
            float v[TM];
            OMP(omp for schedule(static))
            for (int64_t n = 0; n < N; n++)
                for (int64_t m0 = 0; m0 < M; m0 += TM) {
                    int mr = M - m0 < TM ? (int)(M - m0) : TM;
                    for (int m = 0; m < mr; m++) xs[m] = kqrow_at(xq + (m0 + m) * qb, K);
                    k16_n(kind, w + n * ldw, ldw, 1, K, xs, mr, v);
                    for (int m = 0; m < mr; m++) put(y, y_bf16, (m0 + m) * ldy + n, v[m]);
                }
        } else
#endif
        {
            OMP(omp for schedule(static))
            for (int64_t n4 = 0; n4 < (N + TR - 1) / TR; n4++) {
                int64_t n = TR * n4;
                int nr = N - n < TR ? (int)(N - n) : TR;
                float v[TR];
                for (int64_t m = 0; m < M; m++) {
                    dot_tile(kind, w + n * ldw, ldw, nr, K, xq + m * qb, xb, own, K, path == 2, v);
                    for (int r = 0; r < nr; r++) put(y, y_bf16, m * ldy + n + r, v[r]);
                }
            }
        }
    }
    return 0;
}

/* floats of scratch a mlight_gguf_token_linear call needs */
int64_t mlight_gguf_token_linear_scratch(int64_t M, int64_t K, int threads) {
    int64_t x = qrow_bytes(K) > kqrow_bytes(K) ? qrow_bytes(K) : kqrow_bytes(K);
    int64_t wb = wrow_bytes(K) > kwrow_bytes(K) ? wrow_bytes(K) : kwrow_bytes(K);
    return (M * x + (int64_t)threads * wb + K / 256 * KB + 3) / 4;
}

/* floats of scratch a mlight_gguf_token_moe call needs */
int64_t mlight_gguf_token_moe_scratch(int64_t D, int64_t I, int nexp, int threads) {
    return mlight_gguf_tokens_moe_scratch(1, D, I, nexp, threads);
}
