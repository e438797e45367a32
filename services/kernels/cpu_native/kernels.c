/* pdserve's CPU kernels: the small ops of a decode step, one C call each.

On a CPU a one-request decode step runs ~65 small torch ops a layer (RMSNorm, RoPE, the
KV write, paged attention, SiLU) at a few microseconds of dispatch each, and at batch 1
those add up to a third of the step. Each function here does one such op in one pass
over memory. Built at first use with the machine's own compiler for its own CPU
(-march=native), loaded with ctypes (cpu_native/__init__.py); the tuner times them
against the torch reference per op and shape class.

Every function takes fp32 (suffix _f32) or bf16 (_bf16, stored as uint16_t) tensors,
strides in elements, and computes in fp32, rounding to bf16 where the torch reference
rounds. Threads: OpenMP, linked against torch's own OpenMP runtime so both share one
thread pool. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

/* glibc's vector expf (libmvec), declared as math.h declares it under -ffast-math, so
   that `omp simd` loops call it 8 or 16 lanes at a time without fast-math's other
   liberties */
__attribute__((__simd__("notinbranch"))) float expf(float);

typedef union {
    uint32_t u;
    float f;
} bits32;

static inline float bf16_to_f32(bf16 h) {
    bits32 b = {.u = (uint32_t)h << 16};
    return b.f;
}

static inline bf16 f32_to_bf16(float f) { /* round to nearest even, as torch does */
    bits32 b = {.f = f};
    uint32_t rounded = (b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16;
    uint32_t nan = (b.u >> 16) | 0x40u; /* a quiet NaN stays NaN */
    uint32_t is_nan = -(uint32_t)((b.u & 0x7fffffffu) > 0x7f800000u); /* all ones or 0 */
    return (bf16)((rounded & ~is_nan) | (nan & is_nan)); /* branch-free: vectorizes */
}

static inline float ld_f32(const float* p) { return *p; }
static inline void st_f32(float* p, float v) { *p = v; }
static inline float rnd_f32(float v) { return v; }
static inline float ld_bf16(const bf16* p) { return bf16_to_f32(*p); }
static inline void st_bf16(bf16* p, float v) { *p = f32_to_bf16(v); }
static inline float rnd_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* ---- RMSNorm -------------------------------------------------------------------------
   out = w * normed, normed = x * rsqrt(mean(x^2) + eps) in fp32, rounded to the dtype
   before the weight multiplies (the reference: weight * xf.to(dtype)). With a residual:
   res_out = x + res (rounded), normalised instead of x. */
#define DEFINE_RMS_NORM(SUF, T)                                                             \
    void rms_norm_##SUF(const T* x, int64_t sx, const T* res, int64_t sr, T* res_out,        \
                        const T* w, T* out, int64_t rows, int64_t h, float eps) {            \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            const T* xr = x + r * sx;                                                        \
            T* o = out + r * h;                                                              \
            float ss = 0.f;                                                                  \
            if (res) {                                                                       \
                const T* rr = res + r * sr;                                                  \
                T* ro = res_out + r * h;                                                     \
                _Pragma("omp simd reduction(+ : ss)") for (int64_t i = 0; i < h; i++) {     \
                    float v = rnd_##SUF(ld_##SUF(xr + i) + ld_##SUF(rr + i));                \
                    st_##SUF(ro + i, v);                                                     \
                    ss += v * v;                                                             \
                }                                                                            \
                xr = ro;                                                                     \
            } else {                                                                         \
                _Pragma("omp simd reduction(+ : ss)") for (int64_t i = 0; i < h; i++) {     \
                    float v = ld_##SUF(xr + i);                                              \
                    ss += v * v;                                                             \
                }                                                                            \
            }                                                                                \
            float inv = 1.0f / sqrtf(ss / (float)h + eps);                                   \
            _Pragma("omp simd") for (int64_t i = 0; i < h; i++)                              \
                st_##SUF(o + i, ld_##SUF(w + i) * rnd_##SUF(ld_##SUF(xr + i) * inv));       \
        }                                                                                    \
    }
DEFINE_RMS_NORM(f32, float)
DEFINE_RMS_NORM(bf16, bf16)

/* ---- SiLU and mul: out[r] = silu(x[r, :I]) * x[r, I:] (each rounded as torch does) ---- */
#define DEFINE_SILU(SUF, T)                                                                  \
    void silu_and_mul_##SUF(const T* x, int64_t sx, T* out, int64_t rows, int64_t inter) {  \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            const T* g = x + r * sx;                                                         \
            const T* u = g + inter;                                                          \
            T* o = out + r * inter;                                                          \
            _Pragma("omp simd") for (int64_t i = 0; i < inter; i++) {                        \
                float a = ld_##SUF(g + i);                                                   \
                float s = rnd_##SUF(a / (1.0f + expf(-a)));                                  \
                st_##SUF(o + i, s * ld_##SUF(u + i));                                        \
            }                                                                                \
        }                                                                                    \
    }
DEFINE_SILU(f32, float)
DEFINE_SILU(bf16, bf16)

/* ---- RoPE (rotate-half) and the KV write ----------------------------------------------
   q [T, Hq, D] (row stride sq, head stride D), k, v [T, Hk, D] (row strides sk, sv).
   q_out [T, Hq, D] (contiguous) gets q rotated. k rotated goes to k_out ([T, Hk, D],
   contiguous) when kc is NULL; otherwise k rotated and v go to the paged caches at
   slot_mapping[t] (block = slot / block_size, offset = slot % block_size; cache strides
   cb, ct, ch for block, token, head; head_dim contiguous; a negative slot writes
   nothing). cos_sin [max_pos, D]: cos in the first half, sin in the second, fp32 or the
   dtype (cs_f32 says which). Rotated values are rounded once, as the fp32 reference
   rounds its fp32 result. */
#define ROTATE(SUF, X, O)                                                                    \
    for (int64_t i = 0; i < half; i++) {                                                     \
        float x1 = ld_##SUF((X) + i), x2 = ld_##SUF((X) + half + i);                         \
        float c = cs[i], s = cs[half + i];                                                   \
        st_##SUF((O) + i, x1 * c - x2 * s);                                                  \
        st_##SUF((O) + half + i, x2 * c + x1 * s);                                           \
    }
#define DEFINE_ROPE(SUF, T)                                                                  \
    void rope_store_kv_##SUF(const int64_t* pos, const T* q, int64_t sq, const T* k,        \
                             int64_t sk, const T* v, int64_t sv, const void* cos_sin,        \
                             int cs_f32, T* q_out, T* k_out, T* kc, T* vc, int64_t cb,       \
                             int64_t ct, int64_t ch, const int64_t* slots,                   \
                             int64_t block_size, int64_t tokens, int64_t hq, int64_t hk,     \
                             int64_t d) {                                                    \
        int64_t half = d / 2;                                                                \
        float cs[1024];                                                                      \
        for (int64_t t = 0; t < tokens; t++) {                                               \
            for (int64_t i = 0; i < d; i++)                                                  \
                cs[i] = cs_f32 ? ((const float*)cos_sin)[pos[t] * d + i]                     \
                               : ld_##SUF((const T*)cos_sin + pos[t] * d + i);               \
            for (int64_t hh = 0; hh < hq; hh++) {                                            \
                ROTATE(SUF, q + t * sq + hh * d, q_out + (t * hq + hh) * d)                  \
            }                                                                                \
            if (!kc) {                                                                       \
                for (int64_t hh = 0; hh < hk; hh++) {                                        \
                    ROTATE(SUF, k + t * sk + hh * d, k_out + (t * hk + hh) * d)              \
                }                                                                            \
                continue;                                                                    \
            }                                                                                \
            int64_t slot = slots[t];                                                         \
            if (slot < 0) continue;                                                          \
            int64_t base = (slot / block_size) * cb + (slot % block_size) * ct;              \
            for (int64_t hh = 0; hh < hk; hh++) {                                            \
                ROTATE(SUF, k + t * sk + hh * d, kc + base + hh * ch)                        \
                memcpy(vc + base + hh * ch, v + t * sv + hh * d, d * sizeof(T));             \
            }                                                                                \
        }                                                                                    \
    }
DEFINE_ROPE(f32, float)
DEFINE_ROPE(bf16, bf16)

/* k and v [T, Hk, D] (row strides sk, sv) into the paged caches at slot_mapping[t]. */
#define DEFINE_STORE(SUF, T)                                                                 \
    void store_kv_##SUF(const T* k, int64_t sk, const T* v, int64_t sv, T* kc, T* vc,       \
                        int64_t cb, int64_t ct, int64_t ch, const int64_t* slots,            \
                        int64_t block_size, int64_t tokens, int64_t hk, int64_t d) {         \
        for (int64_t t = 0; t < tokens; t++) {                                               \
            int64_t slot = slots[t];                                                         \
            if (slot < 0) continue;                                                          \
            int64_t base = (slot / block_size) * cb + (slot % block_size) * ct;              \
            for (int64_t hh = 0; hh < hk; hh++) {                                            \
                memcpy(kc + base + hh * ch, k + t * sk + hh * d, d * sizeof(T));             \
                memcpy(vc + base + hh * ch, v + t * sv + hh * d, d * sizeof(T));             \
            }                                                                                \
        }                                                                                    \
    }
DEFINE_STORE(f32, float)
DEFINE_STORE(bf16, bf16)

/* ---- Paged attention ------------------------------------------------------------------
   Causal attention of every query row over its sequence's paged KV: sequence s owns
   query rows cu_q[s] .. cu_q[s+1]; its context is seq_lens[s] tokens, the last rows'
   positions; row i of a sequence with query length L sits at seq_len - L + i and sees
   keys 0 .. that position, or with a sliding window w > 0 only the last w of them. q, out [T, Hq, D] (row stride sq / so, head stride D);
   caches as in rope_store_kv. One work item per (query row, KV head): the group's query
   heads share each key and value read. Scores in fp32, softmax exact (max first). */
#define DEFINE_ATTENTION(SUF, T)                                                                   \
    void paged_attention_##SUF(const T* q, int64_t sq, const T* kc, const T* vc,                   \
                               int64_t cb, int64_t ct, int64_t ch, const int32_t* tables,          \
                               int64_t st, const int32_t* cu_q, const int32_t* seq_lens,           \
                               int64_t num_seqs, int64_t block_size, T* out, int64_t so,           \
                               int64_t hq, int64_t hk, int64_t d, int64_t max_len,                 \
                               float scale, int64_t window, int threads) {                         \
        int64_t tokens = cu_q[num_seqs];                                                           \
        int64_t groups = hq / hk;                                                                  \
        int64_t items = tokens * hk;                                                               \
        _Pragma("omp parallel num_threads(threads)") {                                             \
            float* scores = malloc(sizeof(float) * groups * (max_len > 0 ? max_len : 1));          \
            float* acc = malloc(sizeof(float) * groups * d);                                       \
            float* qf = malloc(sizeof(float) * groups * d);                                        \
            float* row = malloc(sizeof(float) * d); /* one key or value row in fp32 */             \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t it = 0; it < items; it++) {       \
                int64_t t = it / hk, g = it % hk;                                                  \
                int64_t s = 0;                                                                     \
                while (cu_q[s + 1] <= t) s++;                                                      \
                int64_t qlen = cu_q[s + 1] - cu_q[s];                                              \
                int64_t n = seq_lens[s] - qlen + (t - cu_q[s]) + 1; /* keys up to it */            \
                int64_t first = window > 0 && n > window ? n - window : 0;                         \
                const int32_t* table = tables + s * st;                                            \
                for (int64_t j = 0; j < groups; j++)                                               \
                    for (int64_t i = 0; i < d; i++)                                                \
                        qf[j * d + i] = ld_##SUF(q + t * sq + (g * groups + j) * d + i) * scale;   \
                for (int64_t p = first; p < n; p++) {                                              \
                    const T* kp = kc + (int64_t)table[p / block_size] * cb +                       \
                                  (p % block_size) * ct + g * ch;                                  \
                    _Pragma("omp simd") for (int64_t i = 0; i < d; i++) row[i] = ld_##SUF(kp + i); \
                    for (int64_t j = 0; j < groups; j++) {                                         \
                        const float* qj = qf + j * d;                                              \
                        float dot = 0.f;                                                           \
                        _Pragma("omp simd reduction(+ : dot)") for (int64_t i = 0; i < d; i++)     \
                            dot += qj[i] * row[i];                                                 \
                        scores[j * max_len + p] = dot;                                             \
                    }                                                                              \
                }                                                                                  \
                for (int64_t j = 0; j < groups; j++) {                                             \
                    float* sj = scores + j * max_len;                                              \
                    float m = -INFINITY, sum = 0.f;                                                \
                    _Pragma("omp simd reduction(max : m)") for (int64_t p = first; p < n; p++)     \
                        m = sj[p] > m ? sj[p] : m;                                                 \
                    _Pragma("omp simd reduction(+ : sum)") for (int64_t p = first; p < n; p++) {   \
                        sj[p] = expf(sj[p] - m);                                                   \
                        sum += sj[p];                                                              \
                    }                                                                              \
                    float inv = 1.0f / sum;                                                        \
                    _Pragma("omp simd") for (int64_t p = first; p < n; p++) sj[p] *= inv;          \
                }                                                                                  \
                memset(acc, 0, sizeof(float) * groups * d);                                        \
                for (int64_t p = first; p < n; p++) {                                              \
                    const T* vp = vc + (int64_t)table[p / block_size] * cb +                       \
                                  (p % block_size) * ct + g * ch;                                  \
                    _Pragma("omp simd") for (int64_t i = 0; i < d; i++) row[i] = ld_##SUF(vp + i); \
                    for (int64_t j = 0; j < groups; j++) {                                         \
                        float pj = scores[j * max_len + p];                                        \
                        float* aj = acc + j * d;                                                   \
                        _Pragma("omp simd") for (int64_t i = 0; i < d; i++) aj[i] += pj * row[i];  \
                    }                                                                              \
                }                                                                                  \
                for (int64_t j = 0; j < groups; j++)                                               \
                    for (int64_t i = 0; i < d; i++)                                                \
                        st_##SUF(out + t * so + (g * groups + j) * d + i, acc[j * d + i]);         \
            }                                                                                      \
            free(scores);                                                                          \
            free(acc);                                                                             \
            free(qf);                                                                              \
            free(row);                                                                             \
        }                                                                                          \
    }
DEFINE_ATTENTION(f32, float)
DEFINE_ATTENTION(bf16, bf16)

