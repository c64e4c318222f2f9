// Token selection from f32 logits [rows, ld] over `vocab` entries; out: i32 [rows].
// NaN logits are never chosen (they rank below every number).
//
// ninfer_argmax: out[r] = index of the largest logit, ties to the lowest index.
//
// ninfer_sample: per row, with params[r] = {temperature, top_p, min_p, u, top_k}:
//   temperature <= 0: the argmax above (u is ignored).
//   Otherwise e_i = exp((l_i - max) / temperature) and the kept set is
//     top-k:  logits >= the k-th largest logit (ties at the threshold kept; k <= 0 or
//             k >= vocab disables it);
//     top-p:  within top-k, logits >= tau_p, the largest logit value such that the mass
//             sum(e_i : tau_p <= l_i, i in top-k) >= top_p * sum(e_i : i in top-k)
//             (the smallest descending prefix reaching top_p; top_p >= 1 disables it);
//     min-p:  e_i >= min_p (p_i >= min_p * p_max; min_p <= 0 disables it).
//   The token is the first id, in id order, at which the running mass of kept tokens exceeds
//   u * (their total mass), u in [0, 1).
//   Thresholds are found by 8-bit radix selection on order-preserving keys of the logits;
//   masses are f32 sums in shared memory (their summation order is not fixed).
// Launch: block 1024, grid (rows).
#include "common.cuh"

#define SAMPLE_THREADS 1024

struct SampleParams {
    float temperature;
    float top_p;
    float min_p;
    float u;
    int top_k;
    int pad0;
    int pad1;
    int pad2;
};
static_assert(sizeof(SampleParams) == 32, "mirrored in crates/ninfer-kernels/src/sample.rs");

struct SampleArgs {
    const float* logits;
    const SampleParams* params;
    int* out;
    int rows;
    int vocab;
    int ld;
    int pad;
};
static_assert(sizeof(SampleArgs) == 40, "mirrored in crates/ninfer-kernels/src/sample.rs");

// Order-preserving map of f32 to u32; NaN maps to 0, below every number.
__device__ __forceinline__ uint32_t order_key(float f) {
    if (isnan(f)) return 0u;
    const uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct SampleShared {
    float red_v[32];
    int red_i[32];
    uint32_t cnt[256];
    float mass[256];
    float fred[32];
    uint32_t prefix;
    float target;
    uint32_t k_rem;
    int result;
    int last_kept;
    int take_lowest;  // the target proved unreachable: select the smallest key
};

// Block-wide argmax (value, lowest index); NaN never wins.
__device__ void block_argmax(const float* row, int vocab, SampleShared& sh, float& best, int& best_i) {
    float v = -INFINITY;
    int vi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const float x = row[i];
        if (!isnan(x) && (x > v || vi == 0x7fffffff)) {
            v = x;
            vi = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, vi, o);
        if (oi != 0x7fffffff && (vi == 0x7fffffff || ov > v || (ov == v && oi < vi))) {
            v = ov;
            vi = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sh.red_v[warp] = v;
        sh.red_i[warp] = vi;
    }
    __syncthreads();
    best = -INFINITY;
    best_i = 0x7fffffff;
    for (int w = 0; w < SAMPLE_THREADS / 32; ++w) {
        const float ov = sh.red_v[w];
        const int oi = sh.red_i[w];
        if (oi != 0x7fffffff && (best_i == 0x7fffffff || ov > best || (ov == best && oi < best_i))) {
            best = ov;
            best_i = oi;
        }
    }
    if (best_i == 0x7fffffff) best_i = 0;  // all NaN
    __syncthreads();
}

__device__ float block_sum(float v, SampleShared& sh) {
    v = warp_sum1(v);
    if ((threadIdx.x & 31) == 0) sh.fred[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
    for (int w = 0; w < SAMPLE_THREADS / 32; ++w) t += sh.fred[w];
    __syncthreads();
    return t;
}

// Radix selection of a key threshold over keys >= floor_key.
// by_mass == false: the key of the k-th largest element (k = sh.k_rem on entry).
// by_mass == true: the largest key whose suffix mass (keys >= it) reaches sh.target.
__device__ uint32_t radix_select(const float* row, int vocab, float top, float inv_t,
                                 uint32_t floor_key, bool by_mass, SampleShared& sh) {
    if (threadIdx.x == 0) {
        sh.prefix = 0;
        sh.take_lowest = 0;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += SAMPLE_THREADS) {
            sh.cnt[i] = 0;
            sh.mass[i] = 0.f;
        }
        __syncthreads();
        const uint32_t hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        const uint32_t prefix = sh.prefix;
        const int lane = threadIdx.x & 31;
        for (int base = 0; base < vocab; base += SAMPLE_THREADS) {
            const int i = base + threadIdx.x;
            const float x = i < vocab ? row[i] : NAN;
            const uint32_t key = order_key(x);
            const bool valid = key >= floor_key && key != 0u && (key & hi_mask) == prefix;
            const uint32_t d = (key >> shift) & 0xffu;
            const float e = valid && by_mass ? expf((x - top) * inv_t) : 0.f;
            // Logits share few leading digits: add each digit's lanes as one group, which
            // keeps the shared-memory atomics off a handful of hot bins.
            unsigned pending = __ballot_sync(0xffffffffu, valid);
            while (pending) {
                const int leader = __ffs(pending) - 1;
                const uint32_t ld = __shfl_sync(0xffffffffu, d, leader);
                const bool mine = ((pending >> lane) & 1u) && d == ld;
                const unsigned grp = __ballot_sync(0xffffffffu, mine);
                const float gs = by_mass ? warp_sum1(mine ? e : 0.f) : 0.f;
                if (lane == leader) {
                    atomicAdd(&sh.cnt[ld], (uint32_t)__popc(grp));
                    if (by_mass) atomicAdd(&sh.mass[ld], gs);
                }
                pending &= ~grp;
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int chosen = -1, lowest = -1;
            float above_m = 0.f, lowest_above = 0.f;
            uint32_t above_c = 0;
            for (int d = 255; d >= 0; --d) {
                if (sh.cnt[d] == 0) continue;
                const bool hit = !sh.take_lowest && (by_mass ? above_m + sh.mass[d] >= sh.target
                                                             : above_c + sh.cnt[d] >= sh.k_rem);
                if (hit) {
                    chosen = d;
                    break;
                }
                lowest = d;
                lowest_above = above_m;
                above_m += sh.mass[d];
                above_c += sh.cnt[d];
            }
            if (chosen < 0) {
                // Fewer candidates than k, or rounding left the mass target out of reach:
                // the threshold becomes the smallest candidate key, which keeps them all.
                chosen = lowest;
                above_m = lowest_above;
                sh.take_lowest = 1;
            }
            if (chosen >= 0) {
                sh.prefix = prefix | ((uint32_t)chosen << shift);
                if (by_mass) sh.target -= above_m;
                else sh.k_rem -= above_c;
            }
        }
        __syncthreads();
    }
    return sh.prefix;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) ninfer_argmax(SampleArgs a) {
    __shared__ SampleShared sh;
    const float* row = a.logits + (size_t)blockIdx.x * a.ld;
    float best;
    int best_i;
    block_argmax(row, a.vocab, sh, best, best_i);
    if (threadIdx.x == 0) a.out[blockIdx.x] = best_i;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) ninfer_sample(SampleArgs a) {
    __shared__ SampleShared sh;
    const int r = blockIdx.x;
    const float* row = a.logits + (size_t)r * a.ld;
    const SampleParams p = a.params[r];
    float top;
    int top_i;
    block_argmax(row, a.vocab, sh, top, top_i);
    if (!(p.temperature > 0.f) || top == -INFINITY) {
        if (threadIdx.x == 0) a.out[r] = top_i;
        return;
    }
    const float inv_t = 1.f / p.temperature;
    uint32_t thr = 1u;  // every non-NaN key
    if (p.top_k > 0 && p.top_k < a.vocab) {
        if (threadIdx.x == 0) sh.k_rem = (uint32_t)p.top_k;
        __syncthreads();
        thr = radix_select(row, a.vocab, top, inv_t, 1u, false, sh);
    }
    if (p.top_p < 1.f) {
        float z = 0.f;
        for (int i = threadIdx.x; i < a.vocab; i += SAMPLE_THREADS) {
            const float x = row[i];
            if (order_key(x) >= thr) z += expf((x - top) * inv_t);
        }
        z = block_sum(z, sh);
        if (threadIdx.x == 0) sh.target = fmaxf(p.top_p, 0.f) * z;
        __syncthreads();
        thr = radix_select(row, a.vocab, top, inv_t, thr, true, sh);
    }
    // Final pass: each thread owns a contiguous id range, so that an exclusive scan of the
    // per-thread masses orders the kept mass by token id.
    const int per = (a.vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int i0 = threadIdx.x * per, i1 = min(a.vocab, i0 + per);
    const float min_p = p.min_p;
    float mine = 0.f;
    int my_last = -1;
    for (int i = i0; i < i1; ++i) {
        const float x = row[i];
        if (order_key(x) < thr) continue;
        const float e = expf((x - top) * inv_t);
        if (min_p > 0.f && e < min_p) continue;
        mine += e;
        my_last = i;
    }
    // Inclusive scan over the block: warp scans, then the warp totals.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    if (threadIdx.x == 0) {
        sh.result = 0x7fffffff;
        sh.last_kept = -1;
    }
    if (lane == 31) sh.fred[warp] = incl;
    __syncthreads();
    float warp_off = 0.f, total = 0.f;
    for (int w = 0; w < SAMPLE_THREADS / 32; ++w) {
        if (w < warp) warp_off += sh.fred[w];
        total += sh.fred[w];
    }
    const float excl = warp_off + incl - mine;
    const float target = p.u * total;
    if (my_last >= 0) atomicMax(&sh.last_kept, my_last);
    if (mine > 0.f && target >= excl && target < excl + mine) {
        float run = excl;
        int pick = my_last;
        for (int i = i0; i < i1; ++i) {
            const float x = row[i];
            if (order_key(x) < thr) continue;
            const float e = expf((x - top) * inv_t);
            if (min_p > 0.f && e < min_p) continue;
            run += e;
            if (run > target) {
                pick = i;
                break;
            }
        }
        atomicMin(&sh.result, pick);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int res = sh.result;
        if (res == 0x7fffffff) res = sh.last_kept >= 0 ? sh.last_kept : top_i;
        a.out[r] = res;
    }
}
