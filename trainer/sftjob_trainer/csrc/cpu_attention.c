// sftjob's causal attention for packed rows on x86-64 CPUs with AVX2 and FMA: fp32, forward
// and backward, exact softmax (no online rescaling: a block of query rows keeps every score
// of its keys).
//
// Why: torch's CPU flash kernel runs at 2.4-3.9x the floor this CPU's products and
// exponentials allow on the 84-456-token sequences of the bench (bench/README.md, "What is left
// at the bench shape"); this kernel computes only the causal half, tile by tile, with one
// register-blocked product (6 x 16 outputs per step) for all seven products of attention.
//
// Layout: a tensor is (data, head stride, token stride) in floats, head_dim contiguous. q and o
// have hq heads, k and v hk (hq % hk == 0: grouped-query heads share a kv head). The row's
// sequences start at bounds[0..nseq) and end at bounds[nseq] (tokens). One task is one
// (sequence, kv head) with its group of query heads, so a task alone writes its rows of dk and
// dv and no two threads write the same memory; tasks are taken longest sequence first. The
// result depends on neither the thread count nor the order tasks are taken in.
//
// Threads: OpenMP, with torch's own runtime (the trainer loads this library after torch, and
// torch's libgomp.so.1 then satisfies it), so torch's pool runs these tasks too.
#define _GNU_SOURCE  // qsort_r
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 6
#define NR 16
#define BR 48  // query rows per block: a multiple of MR and NR

typedef int64_t i64;

typedef struct {
  float *p;
  i64 h, t;  // head and token strides, in floats
} Ten;

static inline i64 pad_to(i64 n, i64 m) { return (n + m - 1) / m * m; }
static inline i64 min64(i64 a, i64 b) { return a < b ? a : b; }

// C[MR x NR] (+)= sum_k A[r*ars + k*acs] * B[k*ldb + 0..NR). Twelve named accumulators: in an
// array the compiler spills them to the stack at every step (half the speed).
static inline void tile(i64 K, const float *A, i64 ars, i64 acs, const float *B, i64 ldb, float *C, i64 ldc,
                        int acc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float *a0 = A, *a1 = A + ars, *a2 = A + 2 * ars, *a3 = A + 3 * ars, *a4 = A + 4 * ars,
              *a5 = A + 5 * ars;
  for (i64 k = 0; k < K; k++) {
    const __m256 b0 = _mm256_loadu_ps(B), b1 = _mm256_loadu_ps(B + 8);
    __m256 x;
    x = _mm256_broadcast_ss(a0), c00 = _mm256_fmadd_ps(x, b0, c00), c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(a1), c10 = _mm256_fmadd_ps(x, b0, c10), c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(a2), c20 = _mm256_fmadd_ps(x, b0, c20), c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(a3), c30 = _mm256_fmadd_ps(x, b0, c30), c31 = _mm256_fmadd_ps(x, b1, c31);
    x = _mm256_broadcast_ss(a4), c40 = _mm256_fmadd_ps(x, b0, c40), c41 = _mm256_fmadd_ps(x, b1, c41);
    x = _mm256_broadcast_ss(a5), c50 = _mm256_fmadd_ps(x, b0, c50), c51 = _mm256_fmadd_ps(x, b1, c51);
    a0 += acs, a1 += acs, a2 += acs, a3 += acs, a4 += acs, a5 += acs;
    B += ldb;
  }
#define OUT(r, v0, v1)                                                             \
  {                                                                                \
    float *p = C + (r) * ldc;                                                      \
    _mm256_storeu_ps(p, acc ? _mm256_add_ps(v0, _mm256_loadu_ps(p)) : v0);         \
    _mm256_storeu_ps(p + 8, acc ? _mm256_add_ps(v1, _mm256_loadu_ps(p + 8)) : v1); \
  }
  OUT(0, c00, c01) OUT(1, c10, c11) OUT(2, c20, c21) OUT(3, c30, c31) OUT(4, c40, c41) OUT(5, c50, c51)
#undef OUT
}

// What a causal mask lets a product skip, for C's rows i (absolute query or key i0 + i):
//   SCORES: C is [queries x keys]: keys up to the tile's last query only;
//   PROBS:  A is [queries x keys]: keys (the inner dimension) up to the tile's last query;
//   PROBS_T: A is [keys x queries]: queries (inner) from the tile's first key on.
enum { SCORES, PROBS, PROBS_T };

// C[M x N] (+)= A[M x K] B[K x N]; M % MR == 0, N % NR == 0.
static void gemm(i64 M, i64 N, i64 K, const float *A, i64 ars, i64 acs, const float *B, i64 ldb, float *C,
                 i64 ldc, int acc, int mask, i64 i0) {
  for (i64 i = 0; i < M; i += MR) {
    i64 n = N, k0 = 0, k1 = K;
    if (mask == SCORES) n = min64(N, pad_to(i0 + i + MR, NR));
    if (mask == PROBS) k1 = min64(K, i0 + i + MR);
    if (mask == PROBS_T) k0 = i > i0 ? i - i0 : 0;
    if (k0 >= k1) {
      if (!acc)
        for (i64 r = 0; r < MR; r++) memset(C + (i + r) * ldc, 0, N * sizeof(float));
      continue;
    }
    for (i64 j = 0; j < n; j += NR)
      tile(k1 - k0, A + i * ars + k0 * acs, ars, acs, B + k0 * ldb + j, ldb, C + i * ldc + j, ldc, acc);
  }
}

// exp(x) for x <= 0: Cephes' polynomial after x = n ln2 + r; below -87.3 (no normal result) 0.
static inline __m256 exp_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

static inline float hsum(__m256 v) {
  float t[8];
  _mm256_storeu_ps(t, v);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

// Row r of S (query i = i0 + r, keys 0..i) becomes exp(S * scale - m). The forward finds m (the
// row's largest scaled score), leaves the row unnormalised and returns lse = m + log(sum) and
// 1/sum; the backward passes m = lse, which gives the normalised probabilities. Keys right of i
// become 0 (up to lds); rows past the sequence's end are all 0.
static void softmax_rows(float *S, i64 lds, i64 i0, i64 rows, i64 s, float scale, float *lse, int forward,
                         float *inv) {
  for (i64 r = 0; r < rows; r++) {
    float *row = S + r * lds;
    const i64 i = i0 + r, n = i + 1, n8 = n / 8 * 8;
    if (i >= s) {
      memset(row, 0, lds * sizeof(float));
      continue;
    }
    float m = forward ? -INFINITY : lse[i];
    if (forward) {
      __m256 mv = _mm256_set1_ps(-INFINITY);
      for (i64 j = 0; j < n8; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(row + j));
      float t[8];
      _mm256_storeu_ps(t, mv);
      for (int u = 0; u < 8; u++) m = t[u] > m ? t[u] : m;
      for (i64 j = n8; j < n; j++) m = row[j] > m ? row[j] : m;
      m *= scale;
    }
    const __m256 sc = _mm256_set1_ps(scale), mm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (i64 j = 0; j < n8; j += 8) {
      const __m256 p = exp_ps(_mm256_fmsub_ps(_mm256_loadu_ps(row + j), sc, mm));
      sum = _mm256_add_ps(sum, p);
      _mm256_storeu_ps(row + j, p);
    }
    float l = hsum(sum);
    for (i64 j = n8; j < n; j++) {
      row[j] = expf(row[j] * scale - m);
      l += row[j];
    }
    memset(row + n, 0, (lds - n) * sizeof(float));
    if (forward) {
      inv[r] = 1.0f / l;
      lse[i] = m + logf(l);
    }
  }
}

typedef struct {
  Ten q, k, v, o, dout, dq, dk, dv;
  float *lse;  // [hq, tokens], contiguous
  const i64 *bounds;
  i64 *order;  // sequences, longest first
  i64 nseq, tokens, hq, hk, d;
  float scale;
  int backward;
} Job;

typedef struct {
  float *kp, *kt, *vp, *vt, *qb, *s, *ob, *dka, *dva, *dob, *dp, *rowv;
} Scratch;

// Rows a..a+n of head h into dst (row stride d), rows n..np zero.
static void gather(float *dst, Ten x, i64 h, i64 a, i64 n, i64 np, i64 d) {
  for (i64 i = 0; i < n; i++) memcpy(dst + i * d, x.p + h * x.h + (a + i) * x.t, d * sizeof(float));
  memset(dst + n * d, 0, (np - n) * d * sizeof(float));
}

static void scatter(Ten x, i64 h, i64 a, i64 n, const float *src, i64 d) {
  for (i64 i = 0; i < n; i++) memcpy(x.p + h * x.h + (a + i) * x.t, src + i * d, d * sizeof(float));
}

static void transpose(float *dst, i64 ldd, const float *src, i64 n, i64 d) {
  for (i64 i = 0; i < n; i++)
    for (i64 c = 0; c < d; c++) dst[c * ldd + i] = src[i * d + c];
}

// Query rows i0.. of a block: rb of them (a multiple of MR reaching past the sequence's last).
static inline i64 block_rows(i64 s, i64 i0) { return min64(BR, pad_to(s - i0, MR)); }

static void forward_task(const Job *J, Scratch *W, i64 seq, i64 g) {
  const i64 a = J->bounds[seq], s = J->bounds[seq + 1] - a, sp = pad_to(s, BR), d = J->d, G = J->hq / J->hk;
  gather(W->kp, J->k, g, a, s, sp, d);
  transpose(W->kt, sp, W->kp, sp, d);
  gather(W->vp, J->v, g, a, s, sp, d);
  for (i64 h = g * G; h < (g + 1) * G; h++) {
    float *lse = J->lse + h * J->tokens + a;
    gather(W->qb, J->q, h, a, s, sp, d);
    for (i64 i0 = 0; i0 < s; i0 += BR) {
      const i64 rb = block_rows(s, i0), c1 = i0 + rb;  // keys 0..c1 hold every unmasked score
      gemm(rb, pad_to(c1, NR), d, W->qb + i0 * d, d, 1, W->kt, sp, W->s, sp, 0, SCORES, i0);
      softmax_rows(W->s, sp, i0, rb, s, J->scale, lse, 1, W->rowv);
      gemm(rb, d, c1, W->s, sp, 1, W->vp, d, W->ob + i0 * d, d, 0, PROBS, i0);
      for (i64 r = 0; r < rb && i0 + r < s; r++) {  // normalise the output row, not the probabilities
        const __m256 f = _mm256_set1_ps(W->rowv[r]);
        float *o = W->ob + (i0 + r) * d;
        for (i64 c = 0; c < d; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), f));
      }
    }
    scatter(J->o, h, a, s, W->ob, d);
  }
}

static void backward_task(const Job *J, Scratch *W, i64 seq, i64 g) {
  const i64 a = J->bounds[seq], s = J->bounds[seq + 1] - a, sp = pad_to(s, BR), d = J->d, G = J->hq / J->hk;
  const __m256 sc = _mm256_set1_ps(J->scale);
  gather(W->kp, J->k, g, a, s, sp, d);
  transpose(W->kt, sp, W->kp, sp, d);
  gather(W->vp, J->v, g, a, s, sp, d);
  transpose(W->vt, sp, W->vp, sp, d);
  memset(W->dka, 0, sp * d * sizeof(float));
  memset(W->dva, 0, sp * d * sizeof(float));
  for (i64 h = g * G; h < (g + 1) * G; h++) {
    const float *lse = J->lse + h * J->tokens + a;
    gather(W->qb, J->q, h, a, s, sp, d);
    gather(W->dob, J->dout, h, a, s, sp, d);
    gather(W->ob, J->o, h, a, s, sp, d);
    for (i64 i = 0; i < s; i++) {  // rowv[i] = dO_i · O_i
      __m256 acc = _mm256_setzero_ps();
      for (i64 c = 0; c < d; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(W->dob + i * d + c), _mm256_loadu_ps(W->ob + i * d + c), acc);
      W->rowv[i] = hsum(acc);
    }
    for (i64 i0 = 0; i0 < s; i0 += BR) {
      const i64 rb = block_rows(s, i0), c1 = i0 + rb, c16 = pad_to(c1, NR);
      float *P = W->s, *dP = W->dp;
      gemm(rb, c16, d, W->qb + i0 * d, d, 1, W->kt, sp, P, sp, 0, SCORES, i0);
      softmax_rows(P, sp, i0, rb, s, J->scale, (float *)lse, 0, NULL);
      gemm(c1, d, rb, P, 1, sp, W->dob + i0 * d, d, W->dva, d, 1, PROBS_T, i0);  // dV += Pᵀ dO
      gemm(rb, c16, d, W->dob + i0 * d, d, 1, W->vt, sp, dP, sp, 0, SCORES, i0);  // dP = dO Vᵀ
      for (i64 r = 0; r < rb; r++) {                                           // dS = P (dP - rowv) scale
        const i64 i = i0 + r, nv = min64(pad_to(i + 1, 8), c16);  // P is 0 right of i, dP unset past c16
        const __m256 di = _mm256_set1_ps(i < s ? W->rowv[i] : 0.0f);
        float *pr = P + r * sp, *dr = dP + r * sp;
        for (i64 j = 0; j < nv; j += 8)
          _mm256_storeu_ps(dr + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(pr + j), sc),
                                                 _mm256_sub_ps(_mm256_loadu_ps(dr + j), di)));
        if (nv < c1) memset(dr + nv, 0, (c1 - nv) * sizeof(float));
      }
      gemm(rb, d, c1, dP, sp, 1, W->kp, d, W->ob + i0 * d, d, 0, PROBS, i0);      // dQ = dS K
      gemm(c1, d, rb, dP, 1, sp, W->qb + i0 * d, d, W->dka, d, 1, PROBS_T, i0);  // dK += dSᵀ Q
    }
    scatter(J->dq, h, a, s, W->ob, d);
  }
  scatter(J->dk, g, a, s, W->dka, d);
  scatter(J->dv, g, a, s, W->dva, d);
}

static float *scratch(i64 n) {
  float *p = aligned_alloc(64, pad_to(n * (i64)sizeof(float), 64));
  if (p) memset(p, 0, n * sizeof(float));
  return p;
}

// One thread's share: tasks taken from a shared counter until none is left. 0 or -1 (no memory).
static int work(const Job *J, i64 *next) {
  i64 smax = 0;
  for (i64 i = 0; i < J->nseq; i++) smax = J->bounds[i + 1] - J->bounds[i] > smax ? J->bounds[i + 1] - J->bounds[i] : smax;
  const i64 sp = pad_to(smax, BR), d = J->d;
  Scratch W = {scratch(sp * d), scratch(sp * d), scratch(sp * d), scratch(sp * d), scratch(sp * d),
               scratch(BR * sp), scratch(sp * d), scratch(sp * d),    scratch(sp * d), scratch(sp * d),
               scratch(BR * sp), scratch(sp)};
  float **all = (float **)&W;
  const unsigned nbuf = sizeof(W) / sizeof(float *);
  int rc = 0;
  for (unsigned i = 0; i < nbuf; i++) rc |= all[i] == NULL;
  for (i64 t; !rc && (t = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < J->nseq * J->hk;) {
    if (J->backward)
      backward_task(J, &W, J->order[t / J->hk], t % J->hk);
    else
      forward_task(J, &W, J->order[t / J->hk], t % J->hk);
  }
  for (unsigned i = 0; i < nbuf; i++) free(all[i]);
  return rc ? -1 : 0;
}

static int longer_first(const void *x, const void *y, void *bounds) {
  const i64 a = *(const i64 *)x, b = *(const i64 *)y, *B = bounds;
  const i64 la = B[a + 1] - B[a], lb = B[b + 1] - B[b];
  return la != lb ? (la < lb) - (la > lb) : (a > b) - (a < b);
}

// 0, 1 (shapes this kernel does not take), 2 (bounds not increasing) or 3 (out of memory).
static int run(Job *J, int threads) {
  if (J->d <= 0 || J->d % NR || J->hk <= 0 || J->hq % J->hk || J->nseq <= 0) return 1;
  for (i64 i = 0; i < J->nseq; i++)
    if (J->bounds[i + 1] <= J->bounds[i] || J->bounds[i] < 0 || J->bounds[i + 1] > J->tokens) return 2;
  J->order = malloc(J->nseq * sizeof(i64));
  if (!J->order) return 3;
  for (i64 i = 0; i < J->nseq; i++) J->order[i] = i;
  qsort_r(J->order, J->nseq, sizeof(i64), longer_first, (void *)J->bounds);
  i64 next = 0;
  int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : failed)
  failed |= work(J, &next) != 0;
  free(J->order);
  return failed ? 3 : 0;
}

static Ten ten(float *p, const i64 *st) { return (Ten){p, st[0], st[1]}; }

// strides: (head, token) for q, k, v, o. lse: [hq, tokens].
int sftjob_attention_forward(const float *q, const float *k, const float *v, float *o, float *lse,
                             const i64 *strides, const i64 *bounds, i64 nseq, i64 tokens, i64 hq, i64 hk, i64 d,
                             float scale, int threads) {
  Job J = {.q = ten((float *)q, strides), .k = ten((float *)k, strides + 2), .v = ten((float *)v, strides + 4),
           .o = ten(o, strides + 6), .lse = lse, .bounds = bounds, .nseq = nseq, .tokens = tokens,
           .hq = hq, .hk = hk, .d = d, .scale = scale, .backward = 0};
  return run(&J, threads);
}

// strides: (head, token) for q, k, v, o, dout, dq, dk, dv; lse as the forward wrote it.
int sftjob_attention_backward(const float *q, const float *k, const float *v, const float *o, const float *dout,
                              const float *lse, float *dq, float *dk, float *dv, const i64 *strides,
                              const i64 *bounds, i64 nseq, i64 tokens, i64 hq, i64 hk, i64 d, float scale,
                              int threads) {
  Job J = {.q = ten((float *)q, strides), .k = ten((float *)k, strides + 2), .v = ten((float *)v, strides + 4),
           .o = ten((float *)o, strides + 6), .dout = ten((float *)dout, strides + 8),
           .dq = ten(dq, strides + 10), .dk = ten(dk, strides + 12), .dv = ten(dv, strides + 14),
           .lse = (float *)lse, .bounds = bounds, .nseq = nseq, .tokens = tokens, .hq = hq, .hk = hk, .d = d,
           .scale = scale, .backward = 1};
  return run(&J, threads);
}
