/* One pass of Adam/AdamW over fp32 parameters and gradients whose two moments are each kept in fp32, bf16 or fp16, or
   both in e4m3 with a power-of-two scale per block (fp8: fp32 scales; mxfp8: e8m0 scales).

   Each element is computed in fp32 with the operations, in the order and with the fused multiply-adds, of torch's
   vectorised CPU kernel (torch._fused_adam_ / torch._fused_adamw_, the elements its vector loop takes), and a bf16
   moment is stored rounded to nearest even (torch's cast) or stochastically (kernels/stochastic_round.py's hash of
   the value and the step count), an fp16 one to nearest even (torch's cast). fp16 moments are stepped a tile at a
   time: widened into fp32 and narrowed again with the F16C conversions torch's own cast uses (GCC leaves a _Float16
   conversion in a loop scalar; integer conversions cost this CPU twice bf16's step), exact integer ones elsewhere. e4m3 moments are read, stepped and stored a block at a time as
   kernels/block_fp8.py quantizes them (the second moment as its correctly rounded square root). Built with
   -ffp-contract=off, so the fused multiply-adds are the explicit fmaf calls and no others; kernels/native_adam.py
   checks the result against torch's kernel and the fp8 codec bit for bit before it is used, and leaves the caller
   the last elements torch's scalar loop would take (and, fp8, the block they are in). Selects are written as masks
   where a branch kept a loop from being vectorised.

   Plain C, no torch headers: the caller passes data pointers (kernels/native_adam.py, through ctypes). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

enum { FP32 = 0, BF16 = 1, E4M3 = 2, FP16 = 3 };

typedef struct {
  float *param;
  float *grad;
  void *exp_avg;
  void *exp_avg_sq;
  int exp_avg_kind;
  int exp_avg_sq_kind;
  int64_t begin;
  int64_t end;
  /* the step's fp32 constants, rounded from double as torch's kernel rounds them */
  float decay;        /* AdamW: 1 - lr * weight_decay */
  float weight_decay; /* Adam: added to the gradient times the parameter */
  int decoupled;
  int has_decay;
  float lerp_coeff;   /* exp_avg.lerp_(grad, w): w where |w| < 0.5, else w - 1 */
  int lerp_small;
  float sq_coeff;     /* 1 - beta2 */
  float beta2;
  float bias2_sqrt;
  float eps;
  float neg_step_size;
  int maximize;
  float grad_scale;    /* the gradient is divided by it and stored back as it is read, as torch's kernel does; 0:
                          none (1 too: x / 1 is x, so that step changes nothing by skipping it) */
  int stochastic;
  uint32_t step_hash;  /* (int32) count * golden ratio, the stochastic draw's seed */
  /* e4m3 moments (both): one power-of-two scale per `block` elements, fp32 or e8m0 (`e8m0_scales`); the second
     moment kept as its square root (kernels/block_fp8.py) */
  void *exp_avg_scales;
  void *exp_avg_sq_scales;
  int e8m0_scales;
  int64_t block;
  /* e4m3 moments whose gradient is not one tensor (`grad` NULL): `segments` tensors, the t-th holding elements
     [segment_begins[t], segment_ends[t]) (ascending, apart), zeros between them (one rank's kept gradients:
     zero/direct_step.py) */
  float **segments;
  const int64_t *segment_begins;
  const int64_t *segment_ends;
  int64_t nsegments;
} Job;

/* The code of a value below a narrow format's normals (its magnitude's bits, `bits`): the value added to the power of
   two `magic` (the format's smallest normal times its fraction's width), whose last bits are then the code, rounded
   to nearest even by the addition. */
static inline uint32_t code_below_normals(uint32_t bits, uint32_t magic) {
  float magnitude, offset;
  memcpy(&magnitude, &bits, 4);
  memcpy(&offset, &magic, 4);
  magnitude = magnitude + offset;
  uint32_t sum;
  memcpy(&sum, &magnitude, 4);
  return sum - magic;
}

/* An fp16 value in fp32, exactly: a normal's exponent rebiased, a subnormal's fraction times 2^-24 (converted from an
   integer: no subnormal fp32 operand, which costs this CPU a slow path), infinities with fp32's exponent, NaN quieted
   with its payload (torch's vector loop). */
static inline float f16_value(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, rest = (uint32_t)(h & 0x7FFFu) << 13;
  const float fraction = (float)(int32_t)(h & 0x3FFu) * 0x1p-24f;
  uint32_t small;
  memcpy(&small, &fraction, 4);
  const uint32_t normal = rest + ((uint32_t)(127 - 15) << 23);
  const uint32_t quiet = 0u - (uint32_t)(rest > (0x7C00u << 13));
  const uint32_t special = 0u - (uint32_t)(rest >= (0x7C00u << 13)), subnormal = 0u - (uint32_t)(rest < (0x400u << 13));
  const uint32_t bits = sign | (special & (rest | 0x7F800000u | (quiet & 0x400000u))) |
                        (~special & ((subnormal & small) | (~subnormal & normal)));
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

/* fp32 to fp16, rounded to nearest even as torch casts (overflow: infinity; NaN quieted with the top of its payload,
   as torch's vector loop); the three cases computed and one selected, so that a loop of it is vectorised. */
static inline uint16_t f16_nearest(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  const uint32_t small = code_below_normals(bits, 126u << 23); /* (0.5) */
  const uint32_t normal = (bits + ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((bits >> 13) & 1u)) >> 13;
  const uint32_t big = 0u - (uint32_t)(bits >= (143u << 23)), below = 0u - (uint32_t)(bits < (113u << 23));
  const uint32_t nan = 0u - (uint32_t)(bits > (255u << 23));
  const uint32_t special = (nan & (0x7E00u | ((bits >> 13) & 0x3FFu))) | (~nan & 0x7C00u);
  const uint32_t out = (big & special) | (~big & ((below & small) | (~below & normal)));
  return (uint16_t)((out & 0xFFFFu) | (sign >> 16));
}

static inline float load(const void *base, int kind, int64_t i) {
  if (kind == FP32) return ((const float *)base)[i];
  uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

static inline uint16_t bf16_nearest(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if (x != x) return 0x7FC0;  /* torch's NaN */
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* kernels/stochastic_round.random_bits: 16 bits hashed from a value's bits and the step */
static inline uint32_t draw16(uint32_t u, uint32_t step_hash) {
  uint32_t h = (u ^ step_hash) * 0x85EBCA6Bu;
  h = (uint32_t)((int32_t)h ^ ((int32_t)h >> 13)) * 0xC2B2AE35u;
  return (uint32_t)((int32_t)h >> 16) & 0xFFFFu;
}

static inline uint16_t bf16_stochastic(float x, uint32_t step_hash) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return (uint16_t)(uint32_t)((int32_t)(u + draw16(u, step_hash)) >> 16);
}

static inline void store(void *base, int kind, int64_t i, float x, int stochastic, uint32_t step_hash) {
  if (kind == FP32) {
    ((float *)base)[i] = x;
  } else {
    ((uint16_t *)base)[i] = stochastic ? bf16_stochastic(x, step_hash) : bf16_nearest(x);
  }
}

enum { NO_DECAY = 0, DECOUPLED = 1, L2 = 2 };

#define CONSTANTS(job)                                                                                  \
  const float decay = (job)->decay, weight_decay = (job)->weight_decay;                                 \
  const float sign = (job)->maximize ? -1.0f : 1.0f;                                                    \
  const float lerp_coeff = (job)->lerp_coeff, sq_coeff = (job)->sq_coeff;                               \
  const float beta2 = (job)->beta2, bias2_sqrt = (job)->bias2_sqrt, eps = (job)->eps;                   \
  const float neg_step_size = (job)->neg_step_size;                                                     \
  const int lerp_small = (job)->lerp_small;                                                             \
  const uint32_t step_hash = (job)->step_hash;

/* The loop for one choice of kinds, decay and rounding, each a constant where it is inlined (run), so that each
   copy is vectorised with its loads, stores and branches fixed. */
static inline __attribute__((always_inline)) void step_range(const Job *job, int mk, int vk, int decay_mode,
                                                             int stochastic) {
  float *restrict param = job->param;
  float *restrict grad = job->grad;
  void *restrict exp_avg = job->exp_avg;
  void *restrict exp_avg_sq = job->exp_avg_sq;
  CONSTANTS(job)
  const float grad_scale = job->grad_scale;
  for (int64_t i = job->begin; i < job->end; i++) {
    float p = param[i];
    float g = grad[i];
    if (grad_scale != 0.0f) { /* (the loop is unswitched on it) */
      g = g / grad_scale;
      grad[i] = g;
    }
    g = g * sign; /* (times one: exact) */
    if (decay_mode == DECOUPLED) p = p * decay;
    if (decay_mode == L2) g = fmaf(p, weight_decay, g);
    float m = load(exp_avg, mk, i);
    m = fmaf(lerp_coeff, g - m, lerp_small ? m : g);
    float v = load(exp_avg_sq, vk, i);
    v = fmaf(sq_coeff * g, g, v * beta2);
    store(exp_avg, mk, i, m, stochastic, step_hash);
    store(exp_avg_sq, vk, i, v, stochastic, step_hash);
    float denom = sqrtf(v) / bias2_sqrt + eps;
    param[i] = p + (neg_step_size * m) / denom;
  }
}

/* fp32 to e4m3, rounded to nearest even, as torch casts (out of range and NaN: NaN, 0x7f with the sign); both
   roundings computed and one selected, so that a loop of it is vectorised. */
static inline uint8_t e4m3_nearest(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  const uint32_t small = code_below_normals(bits, 141u << 23); /* (2^14) */
  const uint32_t normal = (bits + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20;
  const uint32_t nan = 0u - (uint32_t)(bits >= (1087u << 20)), below = 0u - (uint32_t)(bits < (121u << 23));
  const uint32_t out = (nan & 0x7Fu) | (~nan & ((below & small) | (~below & normal)));
  return (uint8_t)((out & 0xFFu) | (sign >> 24));
}

/* e4m3_nearest of a value whose 20 bits below e4m3's fraction are zero (the stochastic draw added and truncated), its
   magnitude above 448's first made 448's (infinity included, NaN not): a normal is then exact, so its code is its
   bits rebiased with no rounding; below the normals, and NaN, as e4m3_nearest. */
static inline uint8_t e4m3_truncated(uint32_t u) {
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  const uint32_t nan = 0u - (uint32_t)(magnitude > 0x7F800000u);
  const uint32_t bits = magnitude < 0x43E00000u ? magnitude : 0x43E00000u;
  const uint32_t small = code_below_normals(bits, 141u << 23); /* (2^14) */
  const uint32_t normal = (bits - (120u << 23)) >> 20;
  const uint32_t below = 0u - (uint32_t)(bits < (121u << 23));
  const uint32_t out = (nan & 0x7Fu) | (~nan & ((below & small) | (~below & normal)));
  return (uint8_t)((out & 0xFFu) | ((u & 0x80000000u) >> 24));
}

/* An e4m3 code's fp32 value, as torch casts it (exactly: normals rebiased, subnormals m * 2^-9; NaN codes NaN). */
static inline float e4m3_value(uint8_t code) {
  const uint32_t c = code, sign = (c & 0x80u) << 24, exponent = (c >> 3) & 0xFu, mantissa = c & 7u;
  const uint32_t normal = sign | ((exponent + 120u) << 23) | (mantissa << 20);
  const float magnitude = (float)(int32_t)mantissa * 0x1p-9f;
  uint32_t small;
  memcpy(&small, &magnitude, 4);
  small |= sign;
  const uint32_t nan = 0u - (uint32_t)((c & 0x7Fu) == 0x7Fu), subnormal = 0u - (uint32_t)(exponent == 0);
  const uint32_t bits = (nan & (sign | 0x7FC00000u)) | (~nan & ((subnormal & small) | (~subnormal & normal)));
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

/* 2^e in fp32, exactly (a subnormal from 2^-149, 0 below), as ldexpf(1, e) for e < 128. */
static inline float pow2(int e) {
  const uint32_t bits = e >= -126 ? (uint32_t)(e + 127) << 23 : (e >= -149 ? 1u << (e + 149) : 0u);
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

/* frexpf(x, &e)'s exponent for a finite non-negative x (0 for 0, as frexpf), and whether its mantissa is 0.5 (x a
   power of two). */
static inline int frexp_exponent(float x, int *half) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  const uint32_t biased = (bits >> 23) & 0xFFu, fraction = bits & 0x7FFFFFu;
  if (biased != 0) {
    *half = fraction == 0;
    return (int)biased - 126;
  }
  if (fraction == 0) {
    *half = 0;
    return 0;
  }
  *half = (fraction & (fraction - 1u)) == 0;
  return 32 - __builtin_clz(fraction) - 149;
}

static inline float block_scale(const void *scales, int e8m0, int64_t b) {
  if (!e8m0) return ((const float *)scales)[b];
  return pow2((int)((const uint8_t *)scales)[b] - 127);
}

/* x[0, count) / scale (or times its exact reciprocal, `multiply`) into e4m3 codes, rounded to nearest or
   stochastically. */
static inline __attribute__((always_inline)) void quantize_values(const float *restrict x, int64_t count,
                                                                  uint8_t *restrict codes, float factor, int multiply,
                                                                  int stochastic, uint32_t step_hash) {
  for (int64_t i = 0; i < count; i++) {
    float y = multiply ? x[i] * factor : x[i] / factor;
    if (stochastic) {
      uint32_t u;
      memcpy(&u, &y, 4);
      u = (u + (draw16(u, step_hash) << 4)) & ~0xFFFFFu;
      codes[i] = e4m3_truncated(u);
    } else {
      codes[i] = e4m3_nearest(y);
    }
  }
}

/* x[0, count) into e4m3 codes and one scale, as kernels/block_fp8.quantize: the smallest power of two s with
   max|x| / s <= 448 (1 for zeros; no smaller than 2^-127 for e8m0), then x / s rounded (stochastically: 16 hashed
   bits added to the 20 bits e4m3 drops, truncated, clamped to 448). */
static inline __attribute__((always_inline)) void quantize_block(const float *restrict x, int64_t count,
                                                                 uint8_t *restrict codes, void *scales, int e8m0,
                                                                 int64_t b, int stochastic, uint32_t step_hash) {
  uint32_t largest = 0; /* of |x|'s bits: ordered as the magnitudes, and a NaN's above them all, as torch's max */
  for (int64_t i = 0; i < count; i++) {
    uint32_t u;
    memcpy(&u, &x[i], 4);
    u &= 0x7FFFFFFFu;
    largest = u > largest ? u : largest;
  }
  float amax;
  memcpy(&amax, &largest, 4);
  int exponent = 0, half = 0;
  if (largest < 0x7F800000u) exponent = frexp_exponent(amax / 448.0f, &half); /* (inf and NaN: 0, as frexpf) */
  exponent -= half;
  if (e8m0 && exponent < -127) exponent = -127;
  float scale = amax == 0.0f ? 1.0f : pow2(exponent);
  if (e8m0) ((uint8_t *)scales)[b] = (uint8_t)(amax == 0.0f ? 127 : exponent + 127);
  else ((float *)scales)[b] = scale;
  /* x / 2^e is x * 2^-e exactly where 2^-e is an fp32 value (e >= -127): a multiply instead of a divide */
  if (amax != 0.0f && exponent >= -127) quantize_values(x, count, codes, pow2(-exponent), 1, stochastic, step_hash);
  else quantize_values(x, count, codes, scale, 0, stochastic, step_hash);
}

#define MAX_BLOCK 256

/* x[0, n) divided by `scale` in place (a block's gradient, while it is in cache), as torch's kernel divides and
   stores back. */
static inline void divide(float *restrict x, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i++) x[i] = x[i] / scale;
}

/* The gradient of elements [a, a + block) where it is in segments: a pointer into the one segment holding them all,
   or `gathered` filled from the segments it meets (zeros between). `cursor`: the first segment that may still hold
   an element at or after `a` (blocks are visited in ascending order). A gathered block's pieces are divided by the
   job's grad_scale where they are first (a piece lies in one block only), as step_blocks divides a block read in
   place. */
static inline float *block_gradient(const Job *job, int64_t a, int64_t block, int64_t *cursor,
                                          float *gathered) {
  int64_t s = *cursor;
  while (s < job->nsegments && job->segment_ends[s] <= a) s++;
  *cursor = s;
  if (s < job->nsegments && job->segment_begins[s] <= a && a + block <= job->segment_ends[s])
    return job->segments[s] + (a - job->segment_begins[s]);
  memset(gathered, 0, (size_t)block * sizeof(float));
  for (int64_t t = s; t < job->nsegments && job->segment_begins[t] < a + block; t++) {
    const int64_t lo = job->segment_begins[t] > a ? job->segment_begins[t] : a;
    const int64_t hi = job->segment_ends[t] < a + block ? job->segment_ends[t] : a + block;
    float *piece = job->segments[t] + (lo - job->segment_begins[t]);
    if (job->grad_scale != 0.0f) divide(piece, hi - lo, job->grad_scale);
    memcpy(gathered + (lo - a), piece, (size_t)(hi - lo) * sizeof(float));
  }
  return gathered;
}

/* Whole blocks of e4m3 moments between begin and end (multiples of the block): each block read into fp32 (the
   second moment squared), stepped, and stored again with a scale of its own (the second as its square root,
   correctly rounded: kernels/block_fp8.root_). */
static inline __attribute__((always_inline)) void step_blocks(const Job *job, int decay_mode, int stochastic,
                                                              int64_t block) {
  float *restrict param = job->param;
  float *grad = job->grad;
  uint8_t *m_codes = (uint8_t *)job->exp_avg, *v_codes = (uint8_t *)job->exp_avg_sq;
  CONSTANTS(job)
  float m[MAX_BLOCK], v[MAX_BLOCK], gathered[MAX_BLOCK];
  int64_t cursor = 0;
  for (int64_t a = job->begin; a < job->end; a += block) {
    const int64_t b = a / block;
    const float sm = block_scale(job->exp_avg_scales, job->e8m0_scales, b);
    const float sv = block_scale(job->exp_avg_sq_scales, job->e8m0_scales, b);
    float *g_here = grad != NULL ? grad + a : block_gradient(job, a, block, &cursor, gathered);
    if (job->grad_scale != 0.0f && g_here != gathered) divide(g_here, block, job->grad_scale);
    const float *restrict g_at = g_here;
    for (int64_t i = 0; i < block; i++) { /* (step_range's operations) */
      float p = param[a + i];
      float g = g_at[i] * sign;
      if (decay_mode == DECOUPLED) p = p * decay;
      if (decay_mode == L2) g = fmaf(p, weight_decay, g);
      float mi = e4m3_value(m_codes[a + i]) * sm;
      mi = fmaf(lerp_coeff, g - mi, lerp_small ? mi : g);
      float root = e4m3_value(v_codes[a + i]) * sv;
      float vi = fmaf(sq_coeff * g, g, (root * root) * beta2);
      float denom = sqrtf(vi) / bias2_sqrt + eps;
      param[a + i] = p + (neg_step_size * mi) / denom;
      m[i] = mi;
      v[i] = sqrtf(vi);
    }
    quantize_block(m, block, m_codes + a, job->exp_avg_scales, job->e8m0_scales, b, stochastic, step_hash);
    quantize_block(v, block, v_codes + a, job->exp_avg_sq_scales, job->e8m0_scales, b, stochastic, step_hash);
  }
}

#define KINDS(MODE, ST)                                                                    \
  if (job->exp_avg_kind == FP16 || job->exp_avg_sq_kind == FP16) step_tiles(job, MODE, ST); \
  else kinds(job, MODE, ST);

/* fp16 codes [0, n) into fp32 and back (the F16C instructions torch's cast uses; the last few, or every one without
   F16C, by f16_value and f16_nearest, which give the same bits). */
static void widen16(const uint16_t *restrict codes, float *restrict out, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(codes + i))));
#endif
  for (; i < n; i++) out[i] = f16_value(codes[i]);
}

static void narrow16(const float *restrict values, uint16_t *restrict codes, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i *)(codes + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(values + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; i++) codes[i] = f16_nearest(values[i]);
}

/* step_range for fp32 and bf16 moments, the kinds dispatched */
static inline __attribute__((always_inline)) void kinds(const Job *job, int mode, int stochastic) {
  if (job->exp_avg_kind == BF16 && job->exp_avg_sq_kind == BF16) step_range(job, BF16, BF16, mode, stochastic);
  else if (job->exp_avg_kind == BF16) step_range(job, BF16, FP32, mode, stochastic);
  else if (job->exp_avg_sq_kind == BF16) step_range(job, FP32, BF16, mode, stochastic);
  else step_range(job, FP32, FP32, mode, stochastic);
}

enum { TILE = 512 };

/* An fp16 moment a tile at a time: widened into fp32 (in cache), stepped as an fp32 one, narrowed back. */
static inline __attribute__((always_inline)) void step_tiles(const Job *job, int mode, int stochastic) {
  float m_tile[TILE], v_tile[TILE];
  for (int64_t a = job->begin; a < job->end; a += TILE) {
    const int64_t len = job->end - a < TILE ? job->end - a : TILE;
    Job tile = *job;
    tile.param = job->param + a;
    tile.grad = job->grad + a;
    tile.begin = 0;
    tile.end = len;
    void *moments[2] = {job->exp_avg, job->exp_avg_sq};
    const int kinds_of[2] = {job->exp_avg_kind, job->exp_avg_sq_kind};
    float *tiles[2] = {m_tile, v_tile};
    void *placed[2];
    int placed_kinds[2];
    for (int k = 0; k < 2; k++) {
      if (kinds_of[k] == FP16) {
        widen16((const uint16_t *)moments[k] + a, tiles[k], len);
        placed[k] = tiles[k];
        placed_kinds[k] = FP32;
      } else {
        placed[k] = kinds_of[k] == FP32 ? (void *)((float *)moments[k] + a) : (void *)((uint16_t *)moments[k] + a);
        placed_kinds[k] = kinds_of[k];
      }
    }
    tile.exp_avg = placed[0];
    tile.exp_avg_sq = placed[1];
    tile.exp_avg_kind = placed_kinds[0];
    tile.exp_avg_sq_kind = placed_kinds[1];
    kinds(&tile, mode, stochastic);
    for (int k = 0; k < 2; k++)
      if (kinds_of[k] == FP16) narrow16(tiles[k], (uint16_t *)moments[k] + a, len);
  }
}

#define MODES(ST)                                                                          \
  if (!job->has_decay) { KINDS(NO_DECAY, ST) }                                            \
  else if (job->decoupled) { KINDS(DECOUPLED, ST) }                                       \
  else { KINDS(L2, ST) }

/* fp8's blocks of 128 and 256 in 512-bit vectors, which GCC leaves at 256 bits unless asked (WIDEST: the step
   1.3-1.6x faster on an AVX-512 CPU; a CPU without AVX-512 keeps its widest); mxfp8's 32 at GCC's width, where 512
   bits took longer. Each with the block a constant, so its loops have no remainder. */
#define BLOCK_MODES(ST, BLOCK)                                                              \
  if (!job->has_decay) step_blocks(job, NO_DECAY, ST, BLOCK);                              \
  else if (job->decoupled) step_blocks(job, DECOUPLED, ST, BLOCK);                         \
  else step_blocks(job, L2, ST, BLOCK);

#define BLOCKS_OF(NAME, BLOCK, TARGET)                                                     \
  static __attribute__((noinline)) TARGET void NAME(const Job *job) {                       \
    if (job->stochastic) { BLOCK_MODES(1, BLOCK) } else { BLOCK_MODES(0, BLOCK) }             \
  }

#if defined(__GNUC__) && !defined(__clang__)
#define WIDEST __attribute__((target("prefer-vector-width=512")))
#else
#define WIDEST
#endif

BLOCKS_OF(blocks_128, 128, WIDEST)
BLOCKS_OF(blocks_256, 256, WIDEST)
BLOCKS_OF(blocks_32, 32, )
BLOCKS_OF(blocks_any, job->block, )

static void step_all_blocks(const Job *job) {
  if (job->block == 128) blocks_128(job);
  else if (job->block == 256) blocks_256(job);
  else if (job->block == 32) blocks_32(job);
  else blocks_any(job);
}

static void *run(void *arg) {
  const Job *job = (const Job *)arg;
  if (job->exp_avg_kind == E4M3) step_all_blocks(job);
  else if (job->stochastic) { MODES(1) } else { MODES(0) }
  return NULL;
}

#define MAX_THREADS 256

static Job constants(float *param, float *grad, double lr, double beta1, double beta2, double weight_decay,
                     double eps, double count, int decoupled, int maximize, float grad_scale, int stochastic) {
  double bias1 = 1 - pow(beta1, count);
  double bias2 = 1 - pow(beta2, count);
  Job base;
  memset(&base, 0, sizeof base);
  base.param = param;
  base.grad = grad;
  base.decoupled = decoupled;
  base.has_decay = weight_decay != 0;
  base.decay = (float)(1 - lr * weight_decay);
  base.weight_decay = (float)weight_decay;
  float w = (float)(1 - beta1);
  base.lerp_small = fabsf(w) < 0.5f;
  base.lerp_coeff = base.lerp_small ? w : w - 1.0f;
  base.sq_coeff = (float)(1 - beta2);
  base.beta2 = (float)beta2;
  base.bias2_sqrt = (float)sqrt(bias2);
  base.eps = (float)eps;
  base.neg_step_size = (float)(-(lr / bias1));
  base.maximize = maximize;
  base.grad_scale = grad_scale == 1.0f ? 0.0f : grad_scale;
  base.stochastic = stochastic;
  base.step_hash = (uint32_t)(int32_t)(float)count * 0x9E3779B1u;
  return base;
}

/* Elements [0, n) in `threads` contiguous ranges, each a multiple of `align` elements, on threads of their own (the
   caller's runs the first). Returns 0, or -1 where a thread could not be started (its range then runs on the
   caller's thread: nothing is stepped twice or left out). */
static int run_ranges(const Job *base, int64_t n, int64_t align, int threads) {
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  int64_t per = (n + threads - 1) / threads;
  per = (per + align - 1) / align * align;
  Job jobs[MAX_THREADS];
  pthread_t ids[MAX_THREADS];
  int started[MAX_THREADS];
  int count_jobs = 0;
  for (int64_t a = 0; a < n && count_jobs < MAX_THREADS; a += per) {
    jobs[count_jobs] = *base;
    jobs[count_jobs].begin = a;
    jobs[count_jobs].end = a + per < n ? a + per : n;
    count_jobs++;
  }
  int failed = 0;
  for (int t = 1; t < count_jobs; t++) {
    started[t] = pthread_create(&ids[t], NULL, run, &jobs[t]) == 0;
    failed |= !started[t];
  }
  if (count_jobs > 0) run(&jobs[0]);
  for (int t = 1; t < count_jobs; t++) {
    if (started[t]) pthread_join(ids[t], NULL);
    else run(&jobs[t]);
  }
  return failed ? -1 : 0;
}

/* fp32, bf16 or fp16 moments (`*_kind`: FP32, BF16, FP16), elements [0, n). */
int zeroplus_adam_stored(float *param, float *grad, void *exp_avg, int exp_avg_kind, void *exp_avg_sq,
                         int exp_avg_sq_kind, int64_t n, double lr, double beta1, double beta2, double weight_decay,
                         double eps, double count, int decoupled, int maximize, float grad_scale, int stochastic,
                         int threads) {
  Job base = constants(param, grad, lr, beta1, beta2, weight_decay, eps, count, decoupled, maximize, grad_scale,
                       stochastic);
  base.exp_avg = exp_avg;
  base.exp_avg_sq = exp_avg_sq;
  base.exp_avg_kind = exp_avg_kind;
  base.exp_avg_sq_kind = exp_avg_sq_kind;
  return run_ranges(&base, n, 16, threads);
}

/* e4m3 moments with a scale per `block` elements (fp32, or e8m0 where `e8m0_scales`), elements [0, n), n a multiple
   of the block. The gradient is `grad`, or where that is NULL the `nsegments` tensors `segments` (Job), each of
   fp32 elements [segment_begins[t], segment_ends[t]), ascending and apart, zeros between them. Returns -2 for a block
   over MAX_BLOCK or an n that is not a multiple of it, -3 for segments out of order or a NULL `grad` with none
   (nothing done). */
int zeroplus_adam_blocks(float *param, float *grad, uint8_t *exp_avg, void *exp_avg_scales, uint8_t *exp_avg_sq,
                         void *exp_avg_sq_scales, int e8m0_scales, int64_t block,
                         int64_t n, double lr, double beta1, double beta2, double weight_decay, double eps,
                         double count, int decoupled, int maximize, float grad_scale, int stochastic, int threads,
                         float **segments, const int64_t *segment_begins, const int64_t *segment_ends,
                         int64_t nsegments) {
  if (block < 1 || block > MAX_BLOCK || n % block != 0) return -2;
  if (grad == NULL && nsegments < 1) return -3;
  for (int64_t t = 0; grad == NULL && t < nsegments; t++) {
    if (segment_begins[t] < (t > 0 ? segment_ends[t - 1] : 0) || segment_ends[t] < segment_begins[t]) return -3;
  }
  Job base = constants(param, grad, lr, beta1, beta2, weight_decay, eps, count, decoupled, maximize, grad_scale,
                       stochastic);
  base.exp_avg = exp_avg;
  base.exp_avg_sq = exp_avg_sq;
  base.exp_avg_kind = base.exp_avg_sq_kind = E4M3;
  base.exp_avg_scales = exp_avg_scales;
  base.exp_avg_sq_scales = exp_avg_sq_scales;
  base.e8m0_scales = e8m0_scales;
  base.block = block;
  if (grad == NULL) {
    base.segments = segments;
    base.segment_begins = segment_begins;
    base.segment_ends = segment_ends;
    base.nsegments = nsegments;
  }
  return run_ranges(&base, n, block, threads);
}
