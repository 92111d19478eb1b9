/* One pass of Adam/AdamW over fp32 parameters and gradients whose two moments are each kept in fp32 or bf16.

   Each element is computed in fp32 with the operations, in the order and with the fused multiply-adds, of torch's
   vectorised CPU kernel (torch._fused_adam_ / torch._fused_adamw_, the elements its vector loop takes), and a bf16
   moment is stored rounded to nearest even (torch's cast) or stochastically (kernels/stochastic_round.py's hash of
   the value and the step count). Built with -ffp-contract=off, so the fused multiply-adds are the explicit fmaf
   calls and no others; kernels/native_adam.py checks the result against torch's kernel bit for bit before it is
   used, and gives torch the last elements its scalar loop would take.

   Plain C, no torch headers: the caller passes data pointers (kernels/native_adam.py, through ctypes). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { FP32 = 0, BF16 = 1 };

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
  float grad_scale;    /* the gradient is divided by it and stored back, as torch's kernel does; 0: none */
  int stochastic;
  uint32_t step_hash;  /* (int32) count * golden ratio, the stochastic draw's seed */
} Job;

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

static inline uint16_t bf16_stochastic(float x, uint32_t step_hash) {
  uint32_t u;
  memcpy(&u, &x, 4);
  uint32_t h = (u ^ step_hash) * 0x85EBCA6Bu;
  h = (uint32_t)((int32_t)h ^ ((int32_t)h >> 13)) * 0xC2B2AE35u;
  uint32_t draw = (uint32_t)((int32_t)h >> 16) & 0xFFFFu;
  return (uint16_t)(uint32_t)((int32_t)(u + draw) >> 16);
}

static inline void store(void *base, int kind, int64_t i, float x, int stochastic, uint32_t step_hash) {
  if (kind == FP32) {
    ((float *)base)[i] = x;
  } else {
    ((uint16_t *)base)[i] = stochastic ? bf16_stochastic(x, step_hash) : bf16_nearest(x);
  }
}

enum { NO_DECAY = 0, DECOUPLED = 1, L2 = 2 };

/* The loop for one choice of kinds, decay and rounding, each a constant where it is inlined (run), so that each
   copy is vectorised with its loads, stores and branches fixed. */
static inline __attribute__((always_inline)) void step_range(const Job *job, int mk, int vk, int decay_mode,
                                                             int stochastic) {
  float *restrict param = job->param;
  const float *restrict grad = job->grad;
  void *restrict exp_avg = job->exp_avg;
  void *restrict exp_avg_sq = job->exp_avg_sq;
  const float decay = job->decay, weight_decay = job->weight_decay, sign = job->maximize ? -1.0f : 1.0f;
  const float lerp_coeff = job->lerp_coeff, sq_coeff = job->sq_coeff;
  const float beta2 = job->beta2, bias2_sqrt = job->bias2_sqrt, eps = job->eps;
  const float neg_step_size = job->neg_step_size;
  const int lerp_small = job->lerp_small;
  const uint32_t step_hash = job->step_hash;
  for (int64_t i = job->begin; i < job->end; i++) {
    float p = param[i];
    float g = grad[i] * sign; /* (times one: exact) */
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

#define KINDS(MODE, ST)                                                                    \
  if (job->exp_avg_kind == BF16 && job->exp_avg_sq_kind == BF16) step_range(job, BF16, BF16, MODE, ST); \
  else if (job->exp_avg_kind == BF16) step_range(job, BF16, FP32, MODE, ST);             \
  else if (job->exp_avg_sq_kind == BF16) step_range(job, FP32, BF16, MODE, ST);          \
  else step_range(job, FP32, FP32, MODE, ST);

#define MODES(ST)                                                                          \
  if (!job->has_decay) { KINDS(NO_DECAY, ST) }                                            \
  else if (job->decoupled) { KINDS(DECOUPLED, ST) }                                       \
  else { KINDS(L2, ST) }

static void *run(void *arg) {
  const Job *job = (const Job *)arg;
  if (job->grad_scale != 0.0f) { /* as torch's kernel: the gradient divided, and stored back, before it is used */
    for (int64_t i = job->begin; i < job->end; i++) job->grad[i] = job->grad[i] / job->grad_scale;
  }
  if (job->stochastic) { MODES(1) } else { MODES(0) }
  return NULL;
}

#define MAX_THREADS 256

/* Elements [0, n) of one tensor; `threads` contiguous ranges of whole cache lines, each on its own thread (the
   caller's thread runs the first). Returns 0, or -1 where a thread could not be started (nothing then stepped
   twice: the ranges not started are run on the caller's thread). */
int zeroplus_adam_stored(float *param, float *grad, void *exp_avg, int exp_avg_kind, void *exp_avg_sq,
                         int exp_avg_sq_kind, int64_t n, double lr, double beta1, double beta2, double weight_decay,
                         double eps, double count, int decoupled, int maximize, float grad_scale, int stochastic,
                         int threads) {
  double bias1 = 1 - pow(beta1, count);
  double bias2 = 1 - pow(beta2, count);
  double lerp_weight = 1 - beta1;
  Job base;
  memset(&base, 0, sizeof base);
  base.param = param;
  base.grad = grad;
  base.exp_avg = exp_avg;
  base.exp_avg_sq = exp_avg_sq;
  base.exp_avg_kind = exp_avg_kind;
  base.exp_avg_sq_kind = exp_avg_sq_kind;
  base.decoupled = decoupled;
  base.has_decay = weight_decay != 0;
  base.decay = (float)(1 - lr * weight_decay);
  base.weight_decay = (float)weight_decay;
  float w = (float)lerp_weight;
  base.lerp_small = fabsf(w) < 0.5f;
  base.lerp_coeff = base.lerp_small ? w : w - 1.0f;
  base.sq_coeff = (float)(1 - beta2);
  base.beta2 = (float)beta2;
  base.bias2_sqrt = (float)sqrt(bias2);
  base.eps = (float)eps;
  base.neg_step_size = (float)(-(lr / bias1));
  base.maximize = maximize;
  base.grad_scale = grad_scale;
  base.stochastic = stochastic;
  base.step_hash = (uint32_t)(int32_t)(float)count * 0x9E3779B1u;
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  int64_t per = (n + threads - 1) / threads;
  per = (per + 15) / 16 * 16;
  Job jobs[MAX_THREADS];
  pthread_t ids[MAX_THREADS];
  int started[MAX_THREADS];
  int count_jobs = 0;
  for (int64_t a = 0; a < n; a += per) {
    jobs[count_jobs] = base;
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
