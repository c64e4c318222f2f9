// The one-row products whose weights come by the copy engine (cp.async.bulk) into shared memory
// and are multiplied on the tensor cores, q8_g32 with K % 256 == 0: bulk_product, shared by
// fused.cu's normed products and gemv.cu's plain one (their contracts), with its fill and
// epilogue hooks.
#pragma once
#include "gemv_mma.cuh"

#define BULK_MAX_K 8192  // the longest row a block holds in shared memory
#define BULK_THREADS 256

#define BULK_ROWS 16  // rows a stage holds: one MMA tile
#define BULK_MAX_STAGES 8

// Row strides of a stage in shared memory: codes K + 32 bytes and scales K / 16 + 16, so that
// the eight rows a quarter warp reads for an MMA fall on distinct banks (K % 256 == 0).
__device__ __forceinline__ int bulk_code_ld(int k) { return k + 32; }
__device__ __forceinline__ int bulk_scale_ld(int k) { return k / 16 + 16; }

// The rows this block owns (bulk_product): [begin, end), stage i holding begin + 16 i ...
struct BulkRows {
    int begin, end;
};

__device__ __forceinline__ BulkRows bulk_rows(int n) {
    const int per = ((n + (int)gridDim.x - 1) / (int)gridDim.x + BULK_ROWS - 1) / BULK_ROWS * BULK_ROWS;
    const int begin = min(n, (int)blockIdx.x * per);
    return {begin, min(n, begin + per)};
}

// Four int8 codes (a u32) to two f16x2 pairs, exactly: bytes 0-1 into `lo`, 2-3 into `hi`. A
// code biased to 0..255 is the low byte of the f16 1024 + b (high byte 0x64); 1152 off gives it.
__device__ __forceinline__ void i8x4_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
    const uint32_t u = w ^ 0x80808080u;
    const __half2 off = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
    const uint32_t l = __byte_perm(u, 0x64646464u, 0x4140), h = __byte_perm(u, 0x64646464u, 0x4342);
    const __half2 lv = __hsub2(*reinterpret_cast<const __half2*>(&l), off);
    const __half2 hv = __hsub2(*reinterpret_cast<const __half2*>(&h), off);
    lo = *reinterpret_cast<const uint32_t*>(&lv);
    hi = *reinterpret_cast<const uint32_t*>(&hv);
}

// fused.cu's row_product for q8_g32 (K % 256 == 0), its weights brought into shared memory by the
// copy engine and multiplied on the tensor cores. A stage is one 16-row tile, copied row by row
// (warp 0: lane r the codes of row r, lane 16 + r its scales) onto the stage's mbarrier; every
// stage that fits is asked for before grid_wait(), so the DRAM streams them while the kernel
// ahead still runs, without a register held per byte in flight. The eight warps split K into
// 32-column groups (warp w: groups w, w + 8, ...) in gemv_mma.cuh's MMA k order, f16 operands:
// int8 codes are exact in f16, and so is the row `fill` builds (converted after it) while |x| <
// 65,504, which an RMSNorm bounds by sqrt(K) max|1 + w|. Each group's two MMAs are summed
// from zero and scaled by its f16 scale in f32; B's column 0 is x, the others zero. Thread 16 i
// + r sums row r of stage i over the warps in order, stores it and runs `epi(row, v)` (so a
// block owns at most 256 rows: the launcher's check). The stage strides' padding keeps every
// row 16-byte aligned for its copy.
template <typename Fill, typename Epi>
__device__ __forceinline__ void bulk_product(const GemvArgs& a, Fill fill, Epi epi) {
    __shared__ __align__(16) bf16 xs[BULK_MAX_K];
    __shared__ uint64_t bar[BULK_MAX_STAGES];
    __shared__ float part[MMA_WARPS][BULK_ROWS];
    extern __shared__ __align__(128) uint8_t stage_mem[];
    grid_release();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int k = a.m.cols, cld = bulk_code_ld(k), sld = bulk_scale_ld(k);
    const uint32_t stage_bytes = BULK_ROWS * (cld + sld);
    uint32_t dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    const int stages = max(1, min(BULK_MAX_STAGES, (int)(dyn / stage_bytes)));
    const BulkRows rows = bulk_rows(a.m.rows);
    const int nst = (rows.end - rows.begin + BULK_ROWS - 1) / BULK_ROWS;
    // By warp 0: stage i's rows into buffer i % stages.
    const auto issue = [&](int i) {
        const int r0 = rows.begin + BULK_ROWS * i, n = min(BULK_ROWS, rows.end - r0), r = lane & 15;
        uint8_t* buf = stage_mem + (size_t)(i % stages) * stage_bytes;
        uint64_t* b = &bar[i % stages];
        if (lane == 0) mbar_expect(b, n * (k + k / 16));
        __syncwarp();
        if (r < n) {
            if (lane < 16)
                bulk_copy(buf + r * cld, static_cast<const int8_t*>(a.m.p0) + (size_t)(r0 + r) * k, k, b);
            else
                bulk_copy(buf + BULK_ROWS * cld + r * sld, static_cast<const uint8_t*>(a.m.p1) + (size_t)(r0 + r) * (k / 16), k / 16, b);
        }
    };
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; ++i) mbar_init(&bar[i]);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == 0)
        for (int i = 0; i < min(stages, nst); ++i) issue(i);
    grid_wait();
    fill(xs);
    // The row as f16, in place: thread i converts the chunks i, i + 256, ... that fill stored.
    for (int c = threadIdx.x; c < k / 8; c += BULK_THREADS) {
        uint4* p = reinterpret_cast<uint4*>(xs + c * 8);
        float v[8];
        unpack_bf8(*p, v);
        __half2 h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
        *p = *reinterpret_cast<const uint4*>(h);
    }
    __syncthreads();
    for (int i = 0; i < nst; ++i) {
        mbar_wait(&bar[i % stages], (i / stages) & 1);
        const uint8_t* buf = stage_mem + (size_t)(i % stages) * stage_bytes;
        const uint8_t* sc = buf + BULK_ROWS * cld;
        float acc0 = 0.f, acc1 = 0.f;  // column 0 (x) of rows g and g + 8, in lanes t == 0
        for (int grp = warp; grp < k / 32; grp += MMA_WARPS) {
            const uint2 q0 = *reinterpret_cast<const uint2*>(buf + g * cld + grp * 32 + 8 * t);
            const uint2 q1 = *reinterpret_cast<const uint2*>(buf + (g + 8) * cld + grp * 32 + 8 * t);
            const float s0 = f16_bits_to_f(*reinterpret_cast<const uint16_t*>(sc + g * sld + 2 * grp));
            const float s1 = f16_bits_to_f(*reinterpret_cast<const uint16_t*>(sc + (g + 8) * sld + 2 * grp));
            const uint4 xv = g == 0 ? *reinterpret_cast<const uint4*>(xs + grp * 32 + 8 * t) : make_uint4(0u, 0u, 0u, 0u);
            float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                uint32_t a0, a1, a2, a3;
                i8x4_f16(st ? q0.y : q0.x, a0, a2);
                i8x4_f16(st ? q1.y : q1.x, a1, a3);
                mma_f16(d, a0, a1, a2, a3, st ? xv.z : xv.x, st ? xv.w : xv.y);
            }
            acc0 = fmaf(d[0], s0, acc0);
            acc1 = fmaf(d[2], s1, acc1);
        }
        if (t == 0) {
            part[warp][g] = acc0;
            part[warp][g + 8] = acc1;
        }
        __syncthreads();  // every warp is done with this buffer, and part is whole
        if (warp == 0 && i + stages < nst) {
            // The buffer's shared-memory reads before the copy engine's writes.
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue(i + stages);
        }
        const int r = threadIdx.x - BULK_ROWS * i, row = rows.begin + BULK_ROWS * i + r;
        if (r >= 0 && r < BULK_ROWS && row < rows.end) {
            float sum = 0.f;
#pragma unroll
            for (int v = 0; v < MMA_WARPS; ++v) sum += part[v][r];
            const float v = sum * row_multiplier<EncQ8>(a.m, 0, row);
            store_out(a.y, row, v, a.out_f32, a.accumulate);
            epi(row, v);
        }
        __syncthreads();  // part is written again by the next stage
    }
}
