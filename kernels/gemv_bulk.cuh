// The products whose weights come by the copy engine (cp.async.bulk) into shared memory and are
// multiplied on the tensor cores, q8_g32 with K % 256 == 0: bulk_product (one row) and
// bulk_rows_product (2-16 rows), shared by fused.cu's normed products and gemv.cu's plain ones
// (their contracts), with their fill and epilogue hooks.
#pragma once
#include "gemv_mma.cuh"

#define BULK_MAX_K 8192  // the longest row a block holds in shared memory
#define BULK_THREADS 256

#define BULK_ROWS 16  // rows a stage holds: one MMA tile
#define BULK_MAX_STAGES 8

// Row stride (elements) of a batch's x rows in shared memory, so that the eight rows and four
// column chunks a quarter warp reads fall on distinct banks (mirrored in fused.rs and gemv.rs).
#define NORM_LD(k) (((k) + 63) / 64 * 64 + 32)

// Bytes rounded up to the 128 after which bulk_rows_product's stages start.
__device__ __forceinline__ int bulk_align(int bytes) { return (bytes + 127) / 128 * 128; }

// Row strides of a stage in shared memory: codes K + 32 bytes and scales K / 16 + 16, so that
// the eight rows a quarter warp reads for an MMA fall on distinct banks (K % 256 == 0).
__device__ __forceinline__ int bulk_code_ld(int k) { return k + 32; }
__device__ __forceinline__ int bulk_scale_ld(int k) { return k / 16 + 16; }

// The rows this block owns: [begin, end), stage i holding begin + 16 i ...
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

// A block's stages of 16 rows in shared memory at `mem` (as many as `bytes` hold, 1 to
// BULK_MAX_STAGES), each copied row by row onto its mbarrier: stage i in buffer (slot)
// i % stages, whose barrier completes its phase i / stages. The loops carry slot and phase
// (BulkSlot) instead of dividing: a signed division is some twenty instructions, and the
// first of them ran between grid_wait() and the first MMA.
struct BulkStages {
    uint8_t* mem;
    uint64_t* bar;
    BulkRows rows;
    int k, cld, sld, stages, count;
    uint32_t stage_bytes;

    __device__ uint8_t* buf(int slot) const { return mem + (size_t)slot * stage_bytes; }

    // By warp 0: stage i's rows into `slot` (lane r the codes of row r, lane 16 + r its scales).
    __device__ void issue(const Mat& m, int i, int slot, int lane) const {
        const int r0 = rows.begin + BULK_ROWS * i, n = min(BULK_ROWS, rows.end - r0), r = lane & 15;
        uint8_t* b = buf(slot);
        uint64_t* mb = &bar[slot];
        if (lane == 0) mbar_expect(mb, n * (k + k / 16));
        __syncwarp();
        if (r < n) {
            if (lane < 16)
                bulk_copy(b + r * cld, static_cast<const int8_t*>(m.p0) + (size_t)(r0 + r) * k, k, mb);
            else
                bulk_copy(b + BULK_ROWS * cld + r * sld, static_cast<const uint8_t*>(m.p1) + (size_t)(r0 + r) * (k / 16), k / 16, mb);
        }
    }

    // The barriers set up and every stage that fits asked for (the whole block calls it).
    __device__ void start(const Mat& m) const {
        if (threadIdx.x == 0) {
            for (int i = 0; i < stages; ++i) mbar_init(&bar[i]);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
        if (threadIdx.x < 32)
            for (int i = 0; i < min(stages, count); ++i) issue(m, i, i, threadIdx.x);
    }

    // After a block barrier that follows every read of stage i's buffer (in `slot`): stage
    // i + stages into it.
    __device__ void refill(const Mat& m, int i, int slot) const {
        if (threadIdx.x < 32 && i + stages < count) {
            // The buffer's shared-memory reads before the copy engine's writes.
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue(m, i + stages, slot, threadIdx.x);
        }
    }
};

// Stage i's buffer and the phase its barrier completes, carried from one stage to the next.
struct BulkSlot {
    int slot = 0, phase = 0;

    __device__ void wait(const BulkStages& s) const { mbar_wait(&s.bar[slot], phase); }
    __device__ void next(const BulkStages& s) {
        if (++slot == s.stages) {
            slot = 0;
            phase ^= 1;
        }
    }
};

// The stages of a block whose dynamic shared memory past `skip` bytes (a multiple of 128) holds them.
__device__ __forceinline__ BulkStages bulk_stages(const Mat& m, uint64_t* bar, int skip) {
    extern __shared__ __align__(128) uint8_t bulk_dyn[];
    const int k = m.cols, cld = bulk_code_ld(k), sld = bulk_scale_ld(k);
    const uint32_t stage_bytes = BULK_ROWS * (cld + sld);
    uint32_t dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    const int stages = max(1, min(BULK_MAX_STAGES, (int)((dyn - skip) / stage_bytes)));
    const BulkRows rows = bulk_rows(m.rows);
    const int count = (rows.end - rows.begin + BULK_ROWS - 1) / BULK_ROWS;
    return {bulk_dyn + skip, bar, rows, k, cld, sld, stages, count, stage_bytes};
}

// `rows` bf16 rows of K elements (row stride ld) to f16 in place: thread i the chunks i, i + 256,
// ... of each row (a row at a time, so that no chunk index is divided).
__device__ __forceinline__ void rows_to_f16(bf16* xs, int rows, int k, int ld) {
    for (int b = 0; b < rows; ++b) {
        for (int c = threadIdx.x; c < k / 8; c += BULK_THREADS) {
            uint4* p = reinterpret_cast<uint4*>(xs + (size_t)b * ld + c * 8);
            float v[8];
            unpack_bf8(*p, v);
            __half2 h[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
            *p = *reinterpret_cast<const uint4*>(h);
        }
    }
}

// One row of x (K elements) copied into the block's shared memory as bulk_product's row: thread
// i the chunks i, i + 256, ... (those it converts to f16 next).
__device__ __forceinline__ void copy_row(bf16* xs, const bf16* x, int k) {
    for (int c = threadIdx.x; c < k / 8; c += BULK_THREADS) *reinterpret_cast<uint4*>(xs + c * 8) = ldg16(x + c * 8);
}

// One 32-column group of a stage for the rows g and g + 8 (gemv_mma.cuh's MMA k order), its
// two MMAs summed from zero per n tile and scaled by the rows' f16 scales into acc; xb[n] is
// this lane's B (x row 8n + g at the group's columns 8t..8t+7, f16).
template <int NT>
__device__ __forceinline__ void bulk_group(float (&acc)[NT][4], const BulkStages& s, const uint8_t* buf, int g, int t, int grp,
                                           const uint4 (&xb)[NT]) {
    const uint8_t* sc = buf + BULK_ROWS * s.cld;
    const uint2 q0 = *reinterpret_cast<const uint2*>(buf + g * s.cld + grp * 32 + 8 * t);
    const uint2 q1 = *reinterpret_cast<const uint2*>(buf + (g + 8) * s.cld + grp * 32 + 8 * t);
    const float s0 = f16_bits_to_f(*reinterpret_cast<const uint16_t*>(sc + g * s.sld + 2 * grp));
    const float s1 = f16_bits_to_f(*reinterpret_cast<const uint16_t*>(sc + (g + 8) * s.sld + 2 * grp));
    float d[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.f;
#pragma unroll
    for (int st = 0; st < 2; ++st) {
        uint32_t a0, a1, a2, a3;
        i8x4_f16(st ? q0.y : q0.x, a0, a2);
        i8x4_f16(st ? q1.y : q1.x, a1, a3);
#pragma unroll
        for (int n = 0; n < NT; ++n) mma_f16(d[n], a0, a1, a2, a3, st ? xb[n].z : xb[n].x, st ? xb[n].w : xb[n].y);
    }
    scale_add<NT>(acc, d, s0, s1);
}

// fused.cu's row_product for q8_g32 (K % 256 == 0), its weights brought into shared memory by
// the copy engine (BulkStages) and multiplied on the tensor cores. Every stage that fits is asked
// for before grid_wait(), so the DRAM streams them while the kernel ahead still runs, without a
// register held per byte in flight. The eight warps split K into 32-column groups (warp w:
// groups w, w + 8, ...), f16 operands: int8 codes are exact in f16, and so is the row `fill`
// builds (converted after it) while |x| < 65,504, which an RMSNorm bounds by sqrt(K) max|1 + w|.
// B's column 0 is x, the others zero. Thread 16 i + r sums row r of stage i over the warps in
// order, stores it and runs `epi(row, v)` (so a block owns at most 256 rows: the launcher's
// check). The stage strides' padding keeps every row 16-byte aligned for its copy.
template <typename Fill, typename Epi>
__device__ __forceinline__ void bulk_product(const GemvArgs& a, Fill fill, Epi epi) {
    __shared__ __align__(16) bf16 xs[BULK_MAX_K];
    __shared__ uint64_t bar[BULK_MAX_STAGES];
    __shared__ float part[MMA_WARPS][BULK_ROWS];
    grid_release();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const BulkStages s = bulk_stages(a.m, bar, 0);
    s.start(a.m);
    grid_wait();
    fill(xs);
    rows_to_f16(xs, 1, s.k, s.k);
    __syncthreads();
    BulkSlot at;
    for (int i = 0; i < s.count; ++i, at.next(s)) {
        at.wait(s);
        const uint8_t* buf = s.buf(at.slot);
        float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};  // column 0 (x) of rows g and g + 8 in lanes t == 0
        for (int grp = warp; grp < s.k / 32; grp += MMA_WARPS) {
            const uint4 xb[1] = {g == 0 ? *reinterpret_cast<const uint4*>(xs + grp * 32 + 8 * t) : make_uint4(0u, 0u, 0u, 0u)};
            bulk_group<1>(acc, s, buf, g, t, grp, xb);
        }
        if (t == 0) {
            part[warp][g] = acc[0][0];
            part[warp][g + 8] = acc[0][2];
        }
        __syncthreads();  // every warp is done with this buffer, and part is whole
        s.refill(a.m, i, at.slot);
        const int r = threadIdx.x - BULK_ROWS * i, row = s.rows.begin + BULK_ROWS * i + r;
        if (r >= 0 && r < BULK_ROWS && row < s.rows.end) {
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

// bulk_product for a batch of a.batch <= 8 * NT rows: `fill()` builds them (bf16, row stride ld)
// at the start of the dynamic shared memory, in its first xs_bytes (a multiple of 128), and they
// are turned into f16 in place; the stages follow. B's column 8n + g is row 8n + g (zero past
// the batch). `begin(tile)` runs as stage i starts (tile = the stage's first row / 16), before
// its wait; thread i < 128 NT stores output (r, b) = (i / 8NT, i % 8NT) of each stage (the sum
// over the warps in order, at y[b * ldy + row]) and then runs `epi(row, b, v)`.
template <int NT, typename Fill, typename Begin, typename Epi>
__device__ __forceinline__ void bulk_rows_product(const GemvArgs& a, bf16* xs, int ld, int xs_bytes, Fill fill, Begin begin, Epi epi) {
    __shared__ uint64_t bar[BULK_MAX_STAGES];
    __shared__ float part[MMA_WARPS][BULK_ROWS][8 * NT];
    grid_release();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const BulkStages s = bulk_stages(a.m, bar, xs_bytes);
    s.start(a.m);
    grid_wait();
    fill();
    __syncthreads();
    rows_to_f16(xs, a.batch, s.k, ld);
    __syncthreads();
    BulkSlot at;
    for (int i = 0; i < s.count; ++i, at.next(s)) {
        const int row0 = s.rows.begin + BULK_ROWS * i;
        begin(row0 / BULK_ROWS);
        at.wait(s);
        const uint8_t* buf = s.buf(at.slot);
        float acc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
        for (int grp = warp; grp < s.k / 32; grp += MMA_WARPS) {
            uint4 xb[NT];
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int b = 8 * n + g;
                xb[n] = b < a.batch ? *reinterpret_cast<const uint4*>(xs + (size_t)b * ld + grp * 32 + 8 * t) : make_uint4(0u, 0u, 0u, 0u);
            }
            bulk_group<NT>(acc, s, buf, g, t, grp, xb);
        }
        acc_to_part<NT>(part[warp], acc, g, t);
        __syncthreads();  // every warp is done with this buffer, and part is whole
        s.refill(a.m, i, at.slot);
        if (threadIdx.x < BULK_ROWS * 8 * NT) {
            const int r = threadIdx.x / (8 * NT), b = threadIdx.x - r * 8 * NT, row = row0 + r;
            if (row < s.rows.end && b < a.batch) {
                float sum = 0.f;
#pragma unroll
                for (int v = 0; v < MMA_WARPS; ++v) sum += part[v][r][b];
                store_out(a.y, (size_t)b * a.ldy + row, sum, a.out_f32, a.accumulate);
                epi(row, b, sum);
            }
        }
        __syncthreads();  // part is written again by the next stage
    }
}
