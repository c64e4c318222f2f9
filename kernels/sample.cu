// Token selection from f32 logits [rows, ld] over `vocab` entries; out: i32 [rows].
// NaN logits are never chosen (they rank below every number).
//
// ninfer_argmax (grid (ARGMAX_CLUSTER, rows) in clusters of ARGMAX_CLUSTER blocks along x,
// block ARGMAX_THREADS, no workspace; dependent launch): out[r] = index of the largest logit of
// row r, ties to the lowest index (all-NaN rows give 0), the same ids as ninfer_sample's
// argmax below by the same comparison. Block x of row r's cluster takes the ids [x*per,
// (x+1)*per), per = ceil(vocab / ARGMAX_CLUSTER); block 0 picks among the blocks' bests
// through distributed shared memory. One launch with no grid-wide barrier, so it may start
// while the head still runs, where the cooperative launch below cannot.
//
// ninfer_sample (cooperative launch: grid (slices, rows), block 512; every block of the grid
// must be resident, which the launcher ensures from the occupancy of this kernel). Block x of
// row r owns the id range [x*per, (x+1)*per), per = ceil(vocab / slices); the blocks meet at
// grid-wide barriers and share per-row scratch in `ws` (SAMPLE_WS_WORDS(slices) u32 per row).
//   params[r].temperature <= 0: out[r] = index of the largest logit, ties
//   to the lowest index (argmax; all-NaN rows give 0).
//   Otherwise, with params[r] = {temperature, top_p, min_p, u, top_k},
//   e_i = exp((l_i - max) / temperature) and the kept set is
//     top-k:  logits >= the k-th largest logit (ties at the threshold kept; k <= 0 or
//             k >= vocab disables it; fewer than k numbers keeps them all);
//     top-p:  within top-k, logits >= tau_p, the largest logit value such that the mass
//             sum(e_i : tau_p <= l_i, i in top-k) >= top_p * sum(e_i : i in top-k)
//             (the smallest descending prefix reaching top_p; top_p >= 1 disables it);
//     min-p:  e_i >= min_p (p_i >= min_p * p_max; min_p <= 0 disables it).
//   The token is the first id, in id order, at which the running mass of kept tokens exceeds
//   u * (their total mass), u clamped into [0, 1). A row that keeps nothing (min_p > 1) gets
//   its argmax.
//   Thresholds are found by 8-bit radix selection on order-preserving keys of the logits, with
//   per-row histograms summed across blocks by atomics; masses are f32 sums whose summation
//   order is not fixed.
#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;

#define ARGMAX_CLUSTER 8
#define ARGMAX_THREADS 1024
#define ARGMAX_LOADS 16
#define SAMPLE_THREADS 512
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define SAMPLE_MAX_SLICES 128
// Per-row scratch (u32 words): 8 radix passes x (256 counts + 256 masses), the top-k mass, then
// per-slice max, argmax, kept mass and last kept id.
#define WS_Z 4096
#define WS_SLICE 4097
#define SAMPLE_WS_WORDS(s) (WS_SLICE + 4 * (s))

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
    uint32_t* ws;
    int rows;
    int vocab;
    int ld;
    int pad;
};
static_assert(sizeof(SampleArgs) == 48, "mirrored in crates/ninfer-kernels/src/sample.rs");

// Order-preserving map of f32 to u32; NaN maps to 0, below every number.
__device__ __forceinline__ uint32_t order_key(float f) {
    if (isnan(f)) return 0u;
    const uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct SampleShared {
    uint32_t cnt[256];
    float mass[256];
    float red_v[SAMPLE_WARPS];
    int red_i[SAMPLE_WARPS];
    float fred[SAMPLE_WARPS];
    float slice_prefix[SAMPLE_MAX_SLICES + 1];
    uint32_t prefix;
    float target;
    uint32_t k_rem;
    int take_lowest;
    int any_k;
    int any_p;
    int result;
};

__device__ __forceinline__ bool better(float ov, int oi, float v, int vi) {
    return oi != 0x7fffffff && (vi == 0x7fffffff || ov > v || (ov == v && oi < vi));
}

// Warp-wide argmax over the lanes' pairs; every lane gets the result.
__device__ __forceinline__ void warp_best(float& v, int& vi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, vi, o);
        if (better(ov, oi, v, vi)) {
            v = ov;
            vi = oi;
        }
    }
}

// Block-wide argmax over pairs held by the threads of WARPS warps, through red_v / red_i
// (WARPS entries of shared memory); every thread gets the result.
template <int WARPS>
__device__ void block_best(float v, int vi, float* red_v, int* red_i, float& best, int& best_i) {
    warp_best(v, vi);
    if ((threadIdx.x & 31) == 0) {
        red_v[threadIdx.x >> 5] = v;
        red_i[threadIdx.x >> 5] = vi;
    }
    __syncthreads();
    best = -INFINITY;
    best_i = 0x7fffffff;
    for (int w = 0; w < WARPS; ++w)
        if (better(red_v[w], red_i[w], best, best_i)) {
            best = red_v[w];
            best_i = red_i[w];
        }
    __syncthreads();
}

__device__ float block_sum(float v, SampleShared& sh) {
    v = warp_sum1(v);
    if ((threadIdx.x & 31) == 0) sh.fred[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
    for (int w = 0; w < SAMPLE_WARPS; ++w) t += sh.fred[w];
    __syncthreads();
    return t;
}

// One radix selection over the row, 4 passes of 8 bits, every block of the grid taking part
// (grid barriers are reached by all blocks; `active` blocks do the work of their row).
// Count mode: the key of the k-th largest candidate (k = sh.k_rem on entry).
// Mass mode: the largest key whose suffix mass (candidates with keys >= it) reaches sh.target.
// Candidates: keys >= floor_key, NaN excluded. hist: this row's 4 pass histograms.
__device__ uint32_t radix_select(cg::grid_group& grid, const float* row, int lo, int hi, float top,
                                 float inv_t, uint32_t floor_key, bool by_mass, bool active,
                                 uint32_t* hist, SampleShared& sh) {
    if (threadIdx.x == 0) {
        sh.prefix = 0;
        sh.take_lowest = 0;
    }
    const int lane = threadIdx.x & 31;
    for (int pass = 0; pass < 4; ++pass) {
        const int shift = 24 - 8 * pass;
        uint32_t* gcnt = hist + pass * 512;
        float* gmass = reinterpret_cast<float*>(gcnt + 256);
        for (int i = threadIdx.x; i < 256; i += SAMPLE_THREADS) {
            sh.cnt[i] = 0;
            sh.mass[i] = 0.f;
        }
        __syncthreads();
        const uint32_t prefix = sh.prefix;
        if (active) {
            const uint32_t hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
            for (int base = lo; base < hi; base += SAMPLE_THREADS) {
                const int i = base + threadIdx.x;
                const float x = i < hi ? row[i] : NAN;
                const uint32_t key = order_key(x);
                const bool valid = key >= floor_key && key != 0u && (key & hi_mask) == prefix;
                const uint32_t d = (key >> shift) & 0xffu;
                const float e = valid && by_mass ? expf((x - top) * inv_t) : 0.f;
                // Logits share few leading digits: each digit's lanes are added as one group.
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
            for (int i = threadIdx.x; i < 256; i += SAMPLE_THREADS) {
                if (sh.cnt[i]) {
                    atomicAdd(gcnt + i, sh.cnt[i]);
                    if (by_mass) atomicAdd(gmass + i, sh.mass[i]);
                }
            }
        }
        grid.sync();
        if (active) {
            for (int i = threadIdx.x; i < 256; i += SAMPLE_THREADS) {
                sh.cnt[i] = __ldcg(gcnt + i);
                sh.mass[i] = __ldcg(gmass + i);
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
        }
        __syncthreads();
    }
    return sh.prefix;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) ninfer_sample(SampleArgs a) {
    grid_release();
    grid_wait();
    cg::grid_group grid = cg::this_grid();
    __shared__ SampleShared sh;
    const int S = gridDim.x, b = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
    const float* row = a.logits + (size_t)r * a.ld;
    uint32_t* ws = a.ws + (size_t)r * SAMPLE_WS_WORDS(S);
    float* wsf = reinterpret_cast<float*>(ws);
    int* wsi = reinterpret_cast<int*>(ws);
    const int per = (a.vocab + S - 1) / S;
    const int lo = min(a.vocab, b * per), hi = min(a.vocab, lo + per);

    // Zero this row's histograms and top-k mass (shared out over the row's blocks).
    for (int i = b * SAMPLE_THREADS + tid; i <= WS_Z; i += S * SAMPLE_THREADS) ws[i] = 0u;
    // Which filters any row of the launch uses decides, grid-uniformly, which phases run.
    if (tid == 0) {
        sh.any_k = 0;
        sh.any_p = 0;
    }
    __syncthreads();
    for (int i = tid; i < a.rows; i += SAMPLE_THREADS) {
        const SampleParams q = a.params[i];
        if (q.temperature > 0.f) {
            if (q.top_k > 0 && q.top_k < a.vocab) sh.any_k = 1;
            if (q.top_p < 1.f) sh.any_p = 1;
        }
    }

    // Slice argmax, then the row's argmax from every slice (same order in every block).
    float v = -INFINITY;
    int vi = 0x7fffffff;
    for (int i = lo + tid; i < hi; i += SAMPLE_THREADS) {
        const float x = row[i];
        if (!isnan(x) && (vi == 0x7fffffff || x > v)) {
            v = x;
            vi = i;
        }
    }
    float top;
    int top_i;
    block_best<SAMPLE_WARPS>(v, vi, sh.red_v, sh.red_i, top, top_i);
    if (tid == 0) {
        wsf[WS_SLICE + b] = top;
        wsi[WS_SLICE + S + b] = top_i;
    }
    grid.sync();
    v = -INFINITY;
    vi = 0x7fffffff;
    if (tid < S) {
        v = __ldcg(wsf + WS_SLICE + tid);
        vi = __ldcg(wsi + WS_SLICE + S + tid);
    }
    block_best<SAMPLE_WARPS>(v, vi, sh.red_v, sh.red_i, top, top_i);
    if (top_i == 0x7fffffff) top_i = 0;  // all NaN

    const SampleParams p = a.params[r];
    const bool sampling = p.temperature > 0.f && top != -INFINITY;
    const float inv_t = sampling ? 1.f / p.temperature : 0.f;
    const bool use_k = sampling && p.top_k > 0 && p.top_k < a.vocab;
    const bool use_p = sampling && p.top_p < 1.f;
    uint32_t thr = 1u;  // every non-NaN key
    if (sh.any_k) {
        if (tid == 0) sh.k_rem = (uint32_t)max(p.top_k, 1);
        __syncthreads();
        const uint32_t t = radix_select(grid, row, lo, hi, top, inv_t, 1u, false, use_k, ws, sh);
        if (use_k) thr = t;
    }
    if (sh.any_p) {
        float z = 0.f;
        if (use_p)
            for (int i = lo + tid; i < hi; i += SAMPLE_THREADS) {
                const float x = row[i];
                if (order_key(x) >= thr) z += expf((x - top) * inv_t);
            }
        z = block_sum(z, sh);
        if (tid == 0 && use_p) atomicAdd(wsf + WS_Z, z);
        grid.sync();
        if (tid == 0) sh.target = fmaxf(p.top_p, 0.f) * __ldcg(wsf + WS_Z);
        __syncthreads();
        const uint32_t t = radix_select(grid, row, lo, hi, top, inv_t, thr, true, use_p, ws + 2048, sh);
        if (use_p) thr = t;
    }

    // Kept mass of this slice, per thread over a contiguous id range so that an exclusive scan
    // of the per-thread masses orders the mass by token id.
    const int tper = (hi - lo + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int i0 = min(hi, lo + tid * tper), i1 = min(hi, i0 + tper);
    float mine = 0.f;
    int my_last = -1;
    if (sampling) {
        for (int i = i0; i < i1; ++i) {
            const float x = row[i];
            if (order_key(x) < thr) continue;
            const float e = expf((x - top) * inv_t);
            if (p.min_p > 0.f && e < p.min_p) continue;
            mine += e;
            my_last = i;
        }
    }
    const int lane = tid & 31, warp = tid >> 5;
    float incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) sh.fred[warp] = incl;
    if (tid == 0) sh.result = 0x7fffffff;
    __syncthreads();
    float warp_off = 0.f, slice_mass = 0.f;
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        if (w < warp) warp_off += sh.fred[w];
        slice_mass += sh.fred[w];
    }
    if (tid == 0) wsf[WS_SLICE + 2 * S + b] = slice_mass;
    grid.sync();
    if (tid < S) sh.slice_prefix[tid + 1] = __ldcg(wsf + WS_SLICE + 2 * S + tid);
    __syncthreads();
    if (tid == 0) {
        sh.slice_prefix[0] = 0.f;
        for (int s = 1; s <= S; ++s) sh.slice_prefix[s] += sh.slice_prefix[s - 1];
    }
    __syncthreads();
    const float total = sh.slice_prefix[S];
    if (!sampling || !(total > 0.f)) {
        if (b == 0 && tid == 0) a.out[r] = top_i;
        return;
    }
    const float u = fminf(fmaxf(p.u, 0.f), 0x1.fffffep-1f);
    const float target = u * total;
    // The slices partition [0, total) by the prefix sums above; inside the owning slice the
    // threads partition it the same way (positions taken relative to the slice, so that one
    // thread's end and the next one's start are the same float).
    if (!(target >= sh.slice_prefix[b] && target < sh.slice_prefix[b + 1])) return;
    const float prev = __shfl_up_sync(0xffffffffu, incl, 1);
    const float start = sh.slice_prefix[b] + (warp_off + (lane == 0 ? 0.f : prev));
    const float end = sh.slice_prefix[b] + (warp_off + incl);
    if (mine > 0.f && target >= start && target < end) {
        float run = start;
        int pick = my_last;
        for (int i = i0; i < i1; ++i) {
            const float x = row[i];
            if (order_key(x) < thr) continue;
            const float e = expf((x - top) * inv_t);
            if (p.min_p > 0.f && e < p.min_p) continue;
            run += e;
            if (run > target) {
                pick = i;
                break;
            }
        }
        sh.result = pick;
    }
    __syncthreads();
    if (tid == 0) a.out[r] = sh.result != 0x7fffffff ? sh.result : top_i;
}

struct ArgmaxArgs {
    const float* logits;
    int* out;
    int rows;
    int vocab;
    int ld;
    int pad;
};
static_assert(sizeof(ArgmaxArgs) == 32, "mirrored in crates/ninfer-kernels/src/sample.rs");

extern "C" __global__ void __cluster_dims__(ARGMAX_CLUSTER, 1, 1) __launch_bounds__(ARGMAX_THREADS) ninfer_argmax(ArgmaxArgs a) {
    grid_release();
    __shared__ float red_v[ARGMAX_THREADS / 32];
    __shared__ int red_i[ARGMAX_THREADS / 32];
    __shared__ float slice_v;
    __shared__ int slice_i;
    cg::cluster_group cl = cg::this_cluster();
    const int b = (int)cl.block_rank(), r = blockIdx.y;
    const int per = (a.vocab + ARGMAX_CLUSTER - 1) / ARGMAX_CLUSTER;
    const int lo = min(a.vocab, b * per), hi = min(a.vocab, lo + per);
    const float* row = a.logits + (size_t)r * a.ld;
    grid_wait();
    float v = -INFINITY;
    int vi = 0x7fffffff;
    // ARGMAX_LOADS loads in flight per thread and round trip (a slice of the model's vocabulary
    // takes two); ascending ids per thread, so a strict > keeps the lowest of equal logits.
    for (int base = lo + threadIdx.x; base < hi; base += ARGMAX_THREADS * ARGMAX_LOADS) {
        float x[ARGMAX_LOADS];
#pragma unroll
        for (int j = 0; j < ARGMAX_LOADS; ++j) {
            const int i = base + j * ARGMAX_THREADS;
            x[j] = i < hi ? row[i] : NAN;
        }
#pragma unroll
        for (int j = 0; j < ARGMAX_LOADS; ++j)
            if (!isnan(x[j]) && (vi == 0x7fffffff || x[j] > v)) {
                v = x[j];
                vi = base + j * ARGMAX_THREADS;
            }
    }
    float top;
    int top_i;
    block_best<ARGMAX_THREADS / 32>(v, vi, red_v, red_i, top, top_i);
    if (threadIdx.x == 0) {
        slice_v = top;
        slice_i = top_i;
    }
    cl.sync();
    if (b == 0 && threadIdx.x < 32) {
        v = -INFINITY;
        vi = 0x7fffffff;
        if (threadIdx.x < ARGMAX_CLUSTER) {
            v = *cl.map_shared_rank(&slice_v, threadIdx.x);
            vi = *cl.map_shared_rank(&slice_i, threadIdx.x);
        }
        warp_best(v, vi);
        if (threadIdx.x == 0) a.out[r] = vi == 0x7fffffff ? 0 : vi;
    }
    // The other blocks' shared memory stays theirs until block 0 has read it.
    cl.sync();
}
