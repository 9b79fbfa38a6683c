"""CUDA source of the fused training attention kernels (``string.Template``: ``${name}``).

FlashAttention-2's algorithm (Dao, 2023) on Hopper's warpgroup MMA (``wgmma.mma_async``
m64n64k16, bf16/fp16 in, fp32 accumulate; each CTA one warpgroup), for head dimensions D = 32, 64,
80, 96 and 128 (the kernels' template parameter ``kDim``; see "Head dimensions" below):

* ``fwd``    one CTA per 64 query rows of one (batch, head): Q stays in registers, K/V tiles of 64
             keys stream through double-buffered shared memory (``cp.async``), the softmax is
             online (running max and sum in the log2 domain), and the dropout mask is regenerated
             from the Philox convention of ``tvm_evt/codegen/philox.py``, a tile at a time into
             shared memory (``mask_tile``: one thread per 32 elements of a row, so no draw is
             made twice; each backward kernel regenerates it the same way).  Writes O and
             the row log-sum-exp (natural log, fp32) that the backward pass recomputes P from.
* ``delta``  D = rowsum(dO * O), FlashAttention's backward statistic (eight lanes a row).
* ``dkdv``   one CTA per 64 keys: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ per query tile, dV += Pdᵀ dO and
             dK += dSᵀ Q with K and V in registers.  Under grouped-query attention (``kv_heads``
             < ``heads``: each key/value head read by heads / kv_heads query heads, as
             transformers' ``repeat_kv`` and SDPA's ``enable_gqa`` define it) the CTA walks the
             query tiles of every head of its group, so dK and dV add up over the group in
             registers; the forward and dQ kernels read their query head's key/value head.
* ``dq``     one CTA per 64 query rows: dQ += dS K, recomputing S and dP.  No atomics, so every
             gradient is deterministic (see ``BACKWARD_ENTRY`` for the atomic version it replaced).

Shared-memory tiles are 64 rows of one or two panels of 128 bytes (64 head columns), the 16-byte
chunks of a panel's rows XOR-swizzled by the row: the layout wgmma reads through a 128-byte-swizzle
descriptor, and conflict-free for ``ldmatrix``.  A warp owns 16 rows of every 64-row tile it
computes; the accumulator fragment of one product is re-packed as the A operand of the next
(P -> P V) without leaving registers.  wgmma against the mma.sync kernels it replaced (H100,
scripts/bench_attention.py --layout bshd, forward + backward ms, two runs each): BERT-Large
0.967-0.969 -> 0.931-0.936, GPT-2 1.038-1.049 -> 0.996-0.999, ViT-B/16 0.802-0.807 ->
0.768-0.769, BERT-Large without dropout 0.793-0.794 -> 0.735-0.747.

Head dimensions.  A tile's rows are D padded to whole panels, kHead = 64 (D = 32, 64) or 128
(D = 80, 96, 128): a panel is exactly one swizzle atom wide, so a descriptor, ``swz`` and
``ldmatrix`` addressing are those of a 64 x 64 tile, and the head never takes a second layout.
The true D is a compile-time constant everywhere else: global rows are D elements apart, the
copies zero-fill the padding columns (cp.async with 0 source bytes; nothing padded is ever in
global memory), a product over the head (S = Q Kᵀ, dPd = dO Vᵀ) issues only D / 16 k-steps, and
the stores skip the padding columns.  A product with the head as N (O += P V, dV += Pᵀ dO,
dK += dSᵀ Q, dQ += dS K) is one m64n64k16 chain a panel, into an accumulator a panel
(``acc[kPanels][8][4]``), rather than one n128 MMA: one instruction shape and one descriptor form
for every D, and the MMAs are not these kernels' bottleneck (below).  At D = 80 and 96 the second
panel's MMAs run partly on zeros; that was preferred to MMAs of n = 16 or 32 and a second
accumulator shape.  Head 64 compiles to the code it had before D was a parameter: the same PTX up
to shared-memory offsets and two unsigned shifts, no spills, and the same registers (dK/dV: 1
or 2 fewer).  Two panels double every tile: the kernels' tiles (forward 80 KB, dK/dV 96, dQ 64) outgrow
static shared memory's 48, so they take dynamic shared memory (``shared_storage`` / ``launch``),
and the forward and dQ kernels are compiled for two CTAs an SM (``min_blocks``).  dK/dV would need
K's and V's A fragments (2 x 32 registers a thread) beside the dK and dV accumulators (2 x 64) and
Sᵀ and dPᵀ (2 x 32): its MMAs read K and V from shared memory instead (wgmma's SS form;
``keys_in_smem``).  Registers and spills per kernel and D:
tests/test_flash_attention_codegen.py::test_ptxas_fits_every_head_dim_without_spills.

The elementwise work between the MMAs is the kernels' bottleneck (one warpgroup a CTA, two or
three CTAs an SM), so it is kept to a few instructions a score:
- one FMA against -LSE·log2(e), staged once per query;
- ``ex2.approx.ftz``;
- one compare against the row's (or key's) visible bound, only on the tiles where a row sees part
  of the tile: the diagonal one of causal attention, the last key tile where the keys leave it
  part-filled (``kRagged``: the entry knows the shapes);
- the keep bits read a word at a time;
- 1/(1-p) applied once, to O and to dV.
Each loop body has one copy of this code: with an unmasked fast copy beside the masked one (a
uniform branch per tile) every output came out wrong on H100 with nvcc 13.0, although each copy
alone was right.  Forward + backward, H100, alternating builds: BERT-Large 0.93-0.99 -> 0.85 ms,
GPT-2 0.99 -> 0.89-0.94, ViT-B/16 0.76-0.78 -> 0.72 (docs/bench/h100-2026-11-26-e).  The tiles
without a bound run in a loop of their own instead, beside the loop over the bounded ones
(GPT-2 0.78 -> 0.73, ViT-B/16 0.646 -> 0.636; docs/bench/h100-2026-11-27).

No load is consumed where it is issued: dK/dV had stored each next tile's LSE, D and keep bits to
shared memory right after loading them, so every tile waited out a global-memory latency.  It now
holds them in registers until the end of the tile before (``fetch`` / ``stage``): backward, H100,
BERT-Large 0.62-0.64 -> 0.51 ms, GPT-2 0.59 -> 0.52, ViT-B/16 0.49 -> 0.43 (docs/bench/h100-2026-11-26-f).
Overlapping the MMAs with the arithmetic inside a CTA (Pᵀ while dPᵀ runs, dSᵀ while dV runs, dQ's
atomics while the next Sᵀ runs) was slower (BERT 0.58 -> 0.61-0.64): two CTAs an SM already overlap.
"""
from string import Template

from .templates import FFI_EXPORT

HEADER = Template("""\
// Generated by tvm_evt.codegen ${version}: fused training attention (FlashAttention-2 on wgmma).
// ${symbol}: ${kind} B=${batch} H=${heads} Hkv=${kv_heads} Sq=${sq} Sk=${sk} D=${head_dim} ${dtype} scale=${scale}
//   causal=${causal} bias=${has_bias} dropout=${dropout} site=${site} layout=${layout}
// Do not edit: the build cache is keyed by this text.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
""")

KERNELS = r"""
#ifndef TVM_EVT_FLASH_KERNELS
#define TVM_EVT_FLASH_KERNELS
namespace tvm_evt_flash {

constexpr int kBlock = 64;    // query rows (or keys) of a CTA, and of each streamed tile
constexpr int kThreads = 128; // four warps, each owning 16 rows of a 64-row tile
constexpr int kPanelCols = 64;                 // head columns of a panel: 128 bytes, one swizzle atom
constexpr int kPanel = kBlock * kPanelCols;    // elements of a panel
// The head dimension ``dim`` (the kernels' template parameter kDim, a multiple of 16) is held in
// tiles of panels(dim) panels, its columns past dim zero; a product over the head takes dim / 16
// k-steps, one with the head as its N dimension one 64-column MMA a panel.
constexpr int panels(int dim) { return (dim + kPanelCols - 1) / kPanelCols; }
constexpr int tile_elems(int dim) { return kBlock * kPanelCols * panels(dim); }
// CTAs an SM the forward and dQ kernels are compiled for (__launch_bounds__' second argument).
// Head 64: three, where dQ fits 168 registers instead of 212 (24 bytes spilled).  H200,
// scripts/bench_attention.py --layout bshd: ViT dQ+dK+dV 0.703 -> 0.633 ms, GPT-2 0.777 -> 0.756,
// the forward 2-5 % faster; dK/dV at three (220 bytes spilled) was slower, so it keeps two.
// Heads of two panels: two.  The forward's 80 KB of tiles allow no more, and at three dQ spilled
// about 300 bytes (168 registers do not hold Q's, dO's and dQ's fragments beside S and dP).
constexpr int min_blocks(int dim) { return panels(dim) == 1 ? 3 : 2; }
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <bool B>
struct Bool {  // a compile-time flag passed to a generic lambda
  static constexpr bool value = B;
};

struct Params {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* o;     // backward: the forward output
  const uint16_t* dout;  // backward: dO
  uint16_t* out;         // forward: O
  float* lse;            // forward writes it, backward reads it ([B*H, Sq], natural log)
  float* delta;          // backward workspace: rowsum(dO * O)
  uint16_t* dq;
  uint16_t* dk;
  uint16_t* dv;
  const float* bias;     // [Sk] added to the scaled scores, or null
  const uint32_t* seed;  // uint32[2], the Philox key, or null
  uint32_t* mask_out;    // forward: the keep bits of every tile computed, for the backward pass (or null)
  const uint32_t* mask_in;  // backward: those bits (or null: regenerate them from the seed)
  int q_blocks, k_blocks;   // 64-row tiles of the queries and of the keys (the saved mask's grid)
  int sq, sk;
  int heads;             // query heads (q, o, dO, dQ, LSE, the keep bits)
  int kv_heads;          // key/value heads (k, v, dK, dV): each read by heads / kv_heads query heads
  int bshd;              // q, k, v, o, dO, O, dQ, dK, dV are [B, S, H, D] (else [B, H, S, D])
  float scale;           // softmax scale
  float scale_log2;      // scale * log2(e)
  float drop_scale;      // 1 / (1 - p)
  uint32_t threshold;    // keep iff its 16 philox bits >= threshold = round(p * 2^16)
  uint32_t site;
  int head_chunk;        // heads a chunk of the launch's CTAs covers (cta_of; set by launch_tiles)
};

// ---- Philox4x32-10, the convention of tvm_evt/codegen/philox.py: element i takes the 16 bits
// i % 2 of word (i % 8) / 2 of the draw with counter (lo32(i / 8), hi32(i / 8), site, 0) under key
// (seed[0], seed[1]); kept iff those bits >= threshold.
__device__ __forceinline__ uint4 philox_draw(uint64_t draw, uint32_t site, uint32_t k0, uint32_t k1) {
  uint32_t c0 = uint32_t(draw), c1 = uint32_t(draw >> 32), c2 = site, c3 = 0;
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;  // one wide multiply each
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c0 = n0; c1 = uint32_t(p1); c2 = n2; c3 = uint32_t(p0);
  }
  return make_uint4(c0, c1, c2, c3);
}

__device__ __forceinline__ uint32_t keep2(uint32_t word, uint32_t threshold) {  // bits of its two halves
  return uint32_t((word & 0xffffu) >= threshold) | uint32_t((word >> 16) >= threshold) << 1;
}
// keep bits (bit e for element first + e) of ``count`` <= 32 consecutive elements: the 4 draws
// covering them (5 when ``first`` is not a multiple of 8), 8 bits each, then shifted into place
__device__ __forceinline__ uint32_t keep_bits(uint64_t first, int count, uint32_t site, uint32_t k0, uint32_t k1,
                                              uint32_t threshold) {
  const uint64_t draw = first >> 3;
  const int skip = int(first & 7);
  uint64_t bits = 0;
#pragma unroll
  for (int d = 0; d < 5; ++d) {
    if (d == 4 && skip == 0) break;
    const uint4 w = philox_draw(draw + d, site, k0, k1);
    bits |= uint64_t(keep2(w.x, threshold) | keep2(w.y, threshold) << 2 | keep2(w.z, threshold) << 4 |
                     keep2(w.w, threshold) << 6) << (8 * d);
  }
  const uint32_t word = uint32_t(bits >> skip);
  return count >= 32 ? word : word & ((1u << count) - 1u);
}

// The keep mask of one 64 x 64 tile (queries m0.., keys n0..) as bits in shared memory,
// ``bits[2 * query + key / 32] >> key % 32``: each thread draws the 4 (or 5) Philox draws of 32
// consecutive elements of one row, so a tile costs the minimum number of draws whatever the
// fragment layout of the kernel that reads it.  The forward pass can save the bits (128 words a
// tile, [B*H, q_blocks, k_blocks, 128]) and the backward kernels read them instead of drawing.
constexpr int kMaskWords = kBlock * kBlock / 32;
// thread ``tid``'s word of the tile's mask: read (saved by the forward pass) or drawn (and saved)
__device__ __forceinline__ uint32_t mask_word(Params const& p, int bh, int m0, int n0, int tid) {
  const int r = tid >> 1, half = tid & 1;
  const int64_t tile = (int64_t(bh) * p.q_blocks + m0 / kBlock) * p.k_blocks + n0 / kBlock;
  if (p.mask_in) return p.mask_in[tile * kMaskWords + tid];  // the forward pass saved it
  uint32_t word = 0;
  const int count = min(32, p.sk - (n0 + half * 32));
  if (m0 + r < p.sq && count > 0)
    word = keep_bits((uint64_t(bh) * p.sq + m0 + r) * uint64_t(p.sk) + n0 + half * 32, count, p.site, p.seed[0],
                     p.seed[1], p.threshold);
  if (p.mask_out) p.mask_out[tile * kMaskWords + tid] = word;
  return word;
}
__device__ __forceinline__ void mask_tile(uint32_t* bits, Params const& p, int bh, int m0, int n0, int tid) {
  bits[tid] = mask_word(p, bh, m0, n0, tid);  // tid == 2 * row + half
}

// ---- conversions and shared-memory primitives
template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (kBf16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&h);
  }
  return r;
}

template <bool kBf16>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  if constexpr (kBf16) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&x));
  }
}

// element offset of 16-byte chunk ``chunk`` (0..7) of row ``row`` in a swizzled 64x64 panel
__device__ __forceinline__ int swz(int row, int chunk) { return row * kPanelCols + ((chunk ^ (row & 7)) << 3); }
// the same in a tile of panels: chunk c of a row is chunk c % 8 of panel c / 8
__device__ __forceinline__ int tile_swz(int row, int chunk) { return (chunk >> 3) * kPanel + swz(row, chunk & 7); }

// the first ``bytes`` (0..16) of a 16-byte chunk, the rest zero-filled
__device__ __forceinline__ void cp_async_bytes(void* smem, const void* gmem, int bytes) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  cp_async_bytes(smem, gmem, valid ? 16 : 0);  // zero-fill rows past the end
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// waits for this thread's copies and makes them visible to wgmma (the async proxy): a barrier after
// it gives the whole tile to the CTA's MMAs
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\nfence.proxy.async.shared::cta;\n" ::: "memory");
}

// the first element of head ``bh`` (batch * heads + head) of a tensor of ``s`` rows a head over
// ``heads`` heads, and the distance between its rows: [B, H, S, D] or, with ``p.bshd``, [B, S, H, D]
template <int kDim>
__device__ __forceinline__ int64_t head_base(Params const& p, int bh, int s, int heads) {
  return p.bshd ? (int64_t(bh / heads) * s * heads + bh % heads) * kDim : int64_t(bh) * s * kDim;
}
template <int kDim>
__device__ __forceinline__ int row_stride(Params const& p, int heads) { return p.bshd ? heads * kDim : kDim; }
// query head ``bh``'s first element in q, o, dO, dQ (Sq rows, ``p.heads`` heads); key/value head
// ``bhk`` (batch * kv_heads + head)'s in k, v, dK, dV (Sk rows, ``p.kv_heads`` heads)
template <int kDim>
__device__ __forceinline__ int64_t q_base(Params const& p, int bh) { return head_base<kDim>(p, bh, p.sq, p.heads); }
template <int kDim>
__device__ __forceinline__ int64_t kv_base(Params const& p, int bhk) {
  return head_base<kDim>(p, bhk, p.sk, p.kv_heads);
}
// the key/value head query head ``bh`` reads: grouped-query attention's heads / kv_heads query
// heads in a row share one (transformers' repeat_kv, SDPA's enable_gqa)
__device__ __forceinline__ int kv_head(Params const& p, int bh) {
  return bh / p.heads * p.kv_heads + bh % p.heads / (p.heads / p.kv_heads);
}
// Which tile and head a CTA computes.  A launch is a 1-D grid of tiles x heads CTAs (launch_tiles):
// the heads in chunks of p.head_chunk, each chunk's CTAs rank by rank (every head's tile of rank 0,
// then of rank 1, ...).  CTAs start in blockIdx order, so in a causal launch, which ranks its tiles
// longest first, the long tiles of a chunk's heads all start before any short one and the short ones
// fill the last wave; the chunk's heads are few enough for their keys and values to stay in L2.
struct Cta {
  int rank, head;
};
__device__ __forceinline__ Cta cta_of(Params const& p, int tiles) {
  const int heads = gridDim.x / tiles, first = int(blockIdx.x) / (p.head_chunk * tiles) * p.head_chunk;
  const int n = min(p.head_chunk, heads - first), local = int(blockIdx.x) - first * tiles;
  return {local / n, first + local % n};
}

// the first element of query row ``r`` = (bh, query) of a [Sq]-row tensor (q, o, dO, dQ)
template <int kDim>
__device__ __forceinline__ int64_t query_row(Params const& p, int64_t r) {
  return q_base<kDim>(p, int(r / p.sq)) + r % p.sq * row_stride<kDim>(p, p.heads);
}

// the key bias of keys [n0, n0 + 64) into shared memory (0 past the last key), with a tile's copies:
// read from global memory by each score, it had put a load latency in every tile's softmax
__device__ __forceinline__ void load_bias(float* dst, Params const& p, int n0, int tid) {
  if (tid < kBlock / 4) {
    const int first = n0 + 4 * tid, bytes = 4 * max(0, min(4, p.sk - first));
    cp_async_bytes(dst + 4 * tid, p.bias + (bytes ? first : 0), bytes);
  }
}

// rows [row0, row0 + 64) of a [rows, kDim] matrix (rows ``ld`` elements apart) into a swizzled
// tile (rows >= ``rows`` and the padding columns past kDim read as 0).  A row's chunks go to
// consecutive threads, so that a warp's copies are whole rows in global memory.
template <int kDim>
__device__ __forceinline__ void load_tile(uint16_t* tile, const uint16_t* src, int row0, int rows, int ld, int tid) {
  constexpr int kChunks = panels(kDim) * 8;  // 16-byte chunks of a tile row, padding included
#pragma unroll
  for (int it = 0; it < tile_elems(kDim) / 8 / kThreads; ++it) {
    const unsigned idx = it * kThreads + tid;  // (unsigned: a shift and a mask)
    const int r = idx / kChunks, c = idx % kChunks;
    bool valid = row0 + r < rows && (kDim % kPanelCols == 0 || c < kDim / 8);
    const uint16_t* g = src + (valid ? int64_t(row0 + r) * ld + c * 8 : 0);
    cp_async16(tile + tile_swz(r, c), g, valid);
  }
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
// A operand (16 rows from ``row0``, k columns 16*kk..) of a tile stored [M][K]
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const uint16_t* tile, int row0, int kk, int lane) {
  ldsm_x4(a, tile + (kk >> 2) * kPanel + swz(row0 + (lane & 15), 2 * (kk & 3) + (lane >> 4)));
}

// ---- Hopper's warpgroup MMA (wgmma.mma_async m64n64k16, fp32 accumulate).  A CTA is one
// warpgroup; warp w holds rows [16 w, 16 w + 16) of the 64 x 64 product, in the same fragments as
// mma.sync's m16n8k16 (acc[nt][e]: row g + 8 (e >> 1), column frag_col(nt, e, t)), and an A operand
// in registers has mma.sync's A fragments.  B is read by the tensor cores
// through a descriptor of a swizzled tile: its 128-byte rows are exactly the 128-byte-swizzle
// layout (``swz``), 8-row groups 1024 bytes apart, tiles 1024-byte aligned.  A tile stored [N][K]
// is "K-major" (a k-step of 16 moves 32 bytes along the row, and to the next panel every four), one
// stored [K][N] is "MN-major" (transposed by the instruction; a k-step moves 16 rows).  A descriptor
// covers one panel: N = 64, so a product with the head as N is one MMA a panel.
__device__ __forceinline__ uint64_t tile_desc(const uint16_t* tile) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
  return uint64_t((addr & 0x3FFFF) >> 4)  // start address, 16-byte units
         | uint64_t(1) << 16               // leading byte offset (unused by 128-byte swizzles)
         | uint64_t(1024 >> 4) << 32       // stride byte offset: 8 rows of 128 bytes
         | uint64_t(1) << 62;              // 128-byte swizzle
}
// the tile's k-step ``kk`` (16 of its K elements) as a descriptor (MN-major: of one panel)
template <bool kMnMajor>
__device__ __forceinline__ uint64_t step_desc(const uint16_t* tile, int kk) {
  return tile_desc(tile + (kMnMajor ? 16 * kk * kPanelCols : (kk >> 2) * kPanel + 16 * (kk & 3)));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// keeps the compiler from moving other instructions' accesses of an MMA's registers past
// ``wgmma_fence`` (before the MMA) or ``wgmma_wait`` (after it)
__device__ __forceinline__ void pin(float (&acc)[8][4]) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[nt][e])::"memory");
}
template <int kPanels>
__device__ __forceinline__ void pin(float (&acc)[kPanels][8][4]) {
#pragma unroll
  for (int n = 0; n < kPanels; ++n) pin(acc[n]);
}
template <int kSteps>
__device__ __forceinline__ void pin(uint32_t (&a)[kSteps][4]) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[kk][i])::"memory");
}

#define TVM_EVT_ACC32(c)                                                                                     \
  "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]),   \
      "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), \
      "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), \
      "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3]), \
      "+f"(c[7][0]), "+f"(c[7][1]), "+f"(c[7][2]), "+f"(c[7][3])
// scale-d is a predicate: true, so the MMA adds to the accumulators
#define TVM_EVT_ACCUMULATE "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
#define TVM_EVT_D32                                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"

// acc += A B, A in registers (mma.sync A fragments), B one k-step of a tile (descriptor)
template <bool kBf16, bool kMnMajorB>
__device__ __forceinline__ void wgmma_rs(float (&acc)[8][4], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (kBf16) {
    asm volatile(TVM_EVT_ACCUMULATE "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TVM_EVT_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
                 : TVM_EVT_ACC32(acc)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(int(kMnMajorB)));
  } else {
    asm volatile(TVM_EVT_ACCUMULATE "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " TVM_EVT_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
                 : TVM_EVT_ACC32(acc)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(int(kMnMajorB)));
  }
}
// acc += A B, A and B one k-step of K-major tiles in shared memory (descriptors)
template <bool kBf16>
__device__ __forceinline__ void wgmma_ss(float (&acc)[8][4], uint64_t a, uint64_t b) {
  if constexpr (kBf16) {
    asm volatile(TVM_EVT_ACCUMULATE "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TVM_EVT_D32
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : TVM_EVT_ACC32(acc)
                 : "l"(a), "l"(b));
  } else {
    asm volatile(TVM_EVT_ACCUMULATE "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " TVM_EVT_D32
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : TVM_EVT_ACC32(acc)
                 : "l"(a), "l"(b));
  }
}
#undef TVM_EVT_D32
#undef TVM_EVT_ACCUMULATE
#undef TVM_EVT_ACC32

// The products below are warpgroup-wide: every thread of the CTA calls them together, with the
// same shared-memory tiles.  ``issue_*`` only issue the k-steps of one product (64 x 64 x D or
// 64 x D x 64); the ``gemm_*`` wrappers fence, issue one or two products, and wait for them.

// acc (64 x 64) += A Bᵀ over the head: A the warps' 16-row fragments (a[kk]: k columns 16 kk..),
// B a tile stored [N][K]
template <bool kBf16, int kSteps>
__device__ __forceinline__ void issue_nk(float (&acc)[8][4], const uint32_t (&a)[kSteps][4], const uint16_t* tile) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) wgmma_rs<kBf16, false>(acc, a[kk], step_desc<false>(tile, kk));
}
// the same with A a tile stored [M][K] in shared memory
template <bool kBf16, int kSteps>
__device__ __forceinline__ void issue_nk(float (&acc)[8][4], const uint16_t* a_tile, const uint16_t* tile) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) wgmma_ss<kBf16>(acc, step_desc<false>(a_tile, kk), step_desc<false>(tile, kk));
}
// acc (64 x D: a 64-column panel each) += A B: A 64 x 64 as in issue_nk, B a tile stored [K][N]
template <bool kBf16, int kPanels>
__device__ __forceinline__ void issue_kn(float (&acc)[kPanels][8][4], const uint32_t (&a)[4][4], const uint16_t* tile) {
#pragma unroll
  for (int n = 0; n < kPanels; ++n)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<kBf16, true>(acc[n], a[kk], step_desc<true>(tile + n * kPanel, kk));
}
// the warps' 16 x 64 accumulator fragments re-packed as an A operand (P -> P V)
template <bool kBf16>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4][4], const float (&p)[8][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    a[kk][0] = pack2<kBf16>(p[2 * kk][0], p[2 * kk][1]);
    a[kk][1] = pack2<kBf16>(p[2 * kk][2], p[2 * kk][3]);
    a[kk][2] = pack2<kBf16>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[kk][3] = pack2<kBf16>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
  }
  pin(a);
}

template <bool kBf16, int kSteps>
__device__ __forceinline__ void gemm_nk(float (&acc)[8][4], const uint32_t (&a)[kSteps][4], const uint16_t* tile) {
  pin(acc);
  wgmma_fence();
  issue_nk<kBf16>(acc, a, tile);
  wgmma_commit();
  wgmma_wait();
  pin(acc);
}
// c0 += a0 t0ᵀ and c1 += a1 t1ᵀ, one wait for both (a0, a1: fragments, or tiles in shared memory)
template <bool kBf16, int kSteps, class A>
__device__ __forceinline__ void gemm_nk2(float (&c0)[8][4], A const& a0, const uint16_t* t0, float (&c1)[8][4],
                                         A const& a1, const uint16_t* t1) {
  pin(c0);
  pin(c1);
  wgmma_fence();
  issue_nk<kBf16, kSteps>(c0, a0, t0);
  issue_nk<kBf16, kSteps>(c1, a1, t1);
  wgmma_commit();
  wgmma_wait();
  pin(c0);
  pin(c1);
}
// acc += P B, B a tile stored [K][N]
template <bool kBf16, int kPanels>
__device__ __forceinline__ void gemm_pk(float (&acc)[kPanels][8][4], const float (&p)[8][4], const uint16_t* tile) {
  uint32_t a[4][4];
  pack_a<kBf16>(a, p);
  pin(acc);
  wgmma_fence();
  issue_kn<kBf16>(acc, a, tile);
  wgmma_commit();
  wgmma_wait();
  pin(acc);
}

// 2^x on the special-function unit (denormal results flushed to zero: probabilities below 2^-126)
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// fragment column of accumulator element (nt, e): 8 nt + 2 t (+1) (its row: g or g + 8)
__device__ __forceinline__ int frag_col(int nt, int e, int t) { return nt * 8 + 2 * t + (e & 1); }

// 16 x kDim fp32 fragments (a panel's each), scaled, into rows [row0, row0 + 16) of a [rows, kDim]
// matrix (rows ``ld`` apart); the padding columns are not stored
template <bool kBf16, int kDim>
__device__ __forceinline__ void store_rows(uint16_t* dst, const float (&acc)[panels(kDim)][8][4], float scale0,
                                           float scale1, int row0, int rows, int ld, int g, int t) {
#pragma unroll
  for (int n = 0; n < panels(kDim); ++n) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      int col = n * kPanelCols + nt * 8 + 2 * t;
      if (kDim % kPanelCols != 0 && col >= kDim) continue;  // (a column pair is all in or out: kDim % 16 == 0)
      if (row0 + g < rows)
        *reinterpret_cast<uint32_t*>(dst + int64_t(row0 + g) * ld + col) =
            pack2<kBf16>(acc[n][nt][0] * scale0, acc[n][nt][1] * scale0);
      if (row0 + g + 8 < rows)
        *reinterpret_cast<uint32_t*>(dst + int64_t(row0 + g + 8) * ld + col) =
            pack2<kBf16>(acc[n][nt][2] * scale1, acc[n][nt][3] * scale1);
    }
  }
}

// Of the first ``blocks`` key tiles, how many every row of the query tile at m0 sees whole, so that
// its scores need no bound: causal, those before the diagonal tile; ragged, all but the last.
template <bool kCausal, bool kRagged>
__device__ __forceinline__ int whole_key_tiles(Params const& p, int m0, int blocks) {
  int whole = blocks;
  if (kCausal) whole = min(whole, m0 / kBlock);
  if (kRagged) whole = min(whole, p.sk / kBlock);
  return whole;
}

// ---- shared memory: each kernel's tiles as a struct, static where it fits in 48 KB (every kernel
// of one panel does), else dynamic (``launch`` opts the kernel in) with its base rounded up to 1024
// bytes: the 128-byte swizzle is a function of address bits 4-9, so every tile starts 1024-aligned.
constexpr int kStaticSmem = 48 * 1024;
template <class S>
__device__ __forceinline__ S& shared_storage() {
  if constexpr (sizeof(S) <= kStaticSmem) {
    __shared__ S storage;
    return storage;
  } else {
    extern __shared__ uint8_t dynamic_smem[];
    const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(dynamic_smem));
    return *reinterpret_cast<S*>(dynamic_smem + ((1024u - (at & 1023u)) & 1023u));
  }
}
// the dynamic shared memory to launch a kernel of storage S with (0: static)
template <class S>
constexpr int dynamic_smem_bytes() { return sizeof(S) <= kStaticSmem ? 0 : int(sizeof(S)) + 1024; }

template <int kDim, bool kBias, bool kDropout>
struct FwdShared {
  alignas(1024) uint16_t q[tile_elems(kDim)];
  alignas(1024) uint16_t k[2][tile_elems(kDim)];
  alignas(1024) uint16_t v[2][tile_elems(kDim)];
  uint32_t mask[2][kDropout ? kMaskWords : 1];
  alignas(16) float bias[2][kBias ? kBlock : 4];
};

// ---- forward
// One key tile of the online softmax: the scores s (64 x 64, this thread's fragments) become the
// probabilities that multiply V (dropped ones zero; the kept ones not yet divided by 1 - p: the
// output is, once), and the running max / sum of the thread's two rows and its accumulator rows are
// updated.
template <bool kCausal, bool kBias, bool kDropout, bool kRagged, int kPanels>
__device__ __forceinline__ void fwd_softmax(float (&s)[8][4], float (&acc)[kPanels][8][4], float (&m_run)[2],
                                            float (&l_run)[2], Params const& p, const uint32_t* mask,
                                            const float* bias, const int (&row)[2], int n0, int warp, int g, int t) {
  // row r sees the tile's keys [0, visible[r]): those that exist and, causal, do not follow it.
  // Only causal attention or a key count that is not a multiple of the tile hides any.
  constexpr bool kBounded = kCausal || kRagged;
  int visible[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) visible[r] = (kCausal ? min(p.sk, row[r] + 1) : p.sk) - n0;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = frag_col(nt, e, t);
      // without a bias a score is scaled only in its exponent's FMA (the scale is positive, so the
      // row's max is the max of the unscaled scores, scaled)
      float x = kBias ? fmaf(bias[col], kLog2e, s[nt][e] * p.scale_log2) : s[nt][e];
      if (kBounded) x = col < visible[e >> 1] ? x : -INFINITY;
      s[nt][e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  }
  float base[2], corr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m_run[r], kBias ? quad_max(mx[r]) : quad_max(mx[r]) * p.scale_log2);
    base[r] = m_new == -INFINITY ? 0.f : m_new;  // a row with no visible key yet
    corr[r] = ex2(m_run[r] - base[r]);
    m_run[r] = m_new;
    l_run[r] *= corr[r];
  }
  // the keep bits of the thread's two rows (``mask_tile``'s layout: a row's 64 keys in two words),
  // shifted so that bit 8 (nt % 4) + (e & 1) of word nt / 4 is column 8 nt + 2 t + (e & 1)
  uint32_t keep[2][2] = {{~0u, ~0u}, {~0u, ~0u}};
  if (kDropout) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) keep[r][h] = mask[2 * (warp * 16 + g + 8 * r) + h] >> (2 * t);
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      const float pr = ex2(kBias ? s[nt][e] - base[r] : fmaf(s[nt][e], p.scale_log2, -base[r]));
      l_run[r] += pr;  // the softmax normaliser counts dropped probabilities too
      s[nt][e] = (keep[r][nt >> 2] >> (8 * (nt & 3) + (e & 1))) & 1u ? pr : 0.f;
#pragma unroll
      for (int n = 0; n < kPanels; ++n) acc[n][nt][e] *= corr[r];
    }
  }
}

template <int kDim, bool kBf16, bool kCausal, bool kBias, bool kDropout, bool kRagged>
__global__ void __launch_bounds__(kThreads, min_blocks(kDim)) flash_fwd(Params p) {
  constexpr int kPanels = panels(kDim), kSteps = kDim / 16;
  auto& sm = shared_storage<FwdShared<kDim, kBias, kDropout>>();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // causal: the last query tiles, which see the most keys, rank first (cta_of)
  const Cta cta = cta_of(p, p.q_blocks);
  const int m0 = (kCausal ? p.q_blocks - 1 - cta.rank : cta.rank) * kBlock, bh = cta.head;
  const int ld = row_stride<kDim>(p, p.heads), ldk = row_stride<kDim>(p, p.kv_heads);
  const uint16_t* Q = p.q + q_base<kDim>(p, bh);
  const uint16_t* K = p.k + kv_base<kDim>(p, kv_head(p, bh));
  const uint16_t* V = p.v + kv_base<kDim>(p, kv_head(p, bh));
  int blocks = (p.sk + kBlock - 1) / kBlock;
  if (kCausal) blocks = min(blocks, (m0 + kBlock - 1) / kBlock + 1);

  load_tile<kDim>(sm.q, Q, m0, p.sq, ld, tid);
  load_tile<kDim>(sm.k[0], K, 0, p.sk, ldk, tid);
  load_tile<kDim>(sm.v[0], V, 0, p.sk, ldk, tid);
  if (kBias) load_bias(sm.bias[0], p, 0, tid);
  cp_async_commit();
  if (kDropout) mask_tile(sm.mask[0], p, bh, m0, 0, tid);
  cp_async_wait_all();
  __syncthreads();
  uint32_t qf[kSteps][4];
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) load_a(qf[kk], sm.q, warp * 16, kk, lane);

  const int row[2] = {m0 + warp * 16 + g, m0 + warp * 16 + g + 8};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float acc[kPanels][8][4];  // O, a panel's columns each
#pragma unroll
  for (int n = 0; n < kPanels; ++n)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[n][nt][0] = acc[n][nt][1] = acc[n][nt][2] = acc[n][nt][3] = 0.f;

  // the key tiles every row sees whole run first, through a softmax without the bound (two loops,
  // each with one copy of the softmax: see below)
  const int whole = whole_key_tiles<kCausal, kRagged>(p, m0, blocks);
  auto key_tile = [&](auto bounded, int j) {
    constexpr bool kBounded = decltype(bounded)::value;
    const int buf = j & 1, n0 = j * kBlock;
    if (j + 1 < blocks) {
      load_tile<kDim>(sm.k[buf ^ 1], K, n0 + kBlock, p.sk, ldk, tid);
      load_tile<kDim>(sm.v[buf ^ 1], V, n0 + kBlock, p.sk, ldk, tid);
      if (kBias) load_bias(sm.bias[buf ^ 1], p, n0 + kBlock, tid);
    }
    cp_async_commit();
    // the next tile's mask, read after this tile's closing barrier.  It is drawn before S = Q Kᵀ:
    // drawn between that product's wgmma wait and the softmax (where the mma.sync kernel drew it),
    // the scores of every row came out wrong (H100, nvcc 13.0; tests/test_gpu_flash_attention.py)
    if (kDropout && j + 1 < blocks) mask_tile(sm.mask[buf ^ 1], p, bh, m0, n0 + kBlock, tid);
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    gemm_nk<kBf16>(s, qf, sm.k[buf]);

    // one copy of the softmax in a loop body: with a fast copy for unmasked tiles beside it (a
    // uniform branch), every output came out wrong (H100, nvcc 13.0), though each copy alone was right
    fwd_softmax<kCausal && kBounded, kBias, kDropout, kRagged && kBounded>(s, acc, m_run, l_run, p, sm.mask[buf],
                                                                           sm.bias[buf], row, n0, warp, g, t);
    gemm_pk<kBf16>(acc, s, sm.v[buf]);
    cp_async_wait_all();
    __syncthreads();
  };
  for (int j = 0; j < whole; ++j) key_tile(Bool<false>{}, j);
  if constexpr (kCausal || kRagged) {  // (otherwise whole == blocks)
    for (int j = whole; j < blocks; ++j) key_tile(Bool<true>{}, j);
  }

  float inv[2];
  uint16_t* O = p.out + q_base<kDim>(p, bh);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = quad_sum(l_run[r]);
    inv[r] = l > 0.f ? p.drop_scale / l : 0.f;  // the kept probabilities were not scaled
    if (t == 0 && row[r] < p.sq)
      p.lse[int64_t(bh) * p.sq + row[r]] = l > 0.f ? (m_run[r] + log2f(l)) * kLn2 : -INFINITY;
  }
  store_rows<kBf16, kDim>(O, acc, inv[0], inv[1], m0 + warp * 16, p.sq, ld, g, t);
}

// ---- backward: D = rowsum(dO * O), eight lanes a row, each loading 16-byte chunks of O and dO
// (one each at a head of 64; one warp a row, 4 bytes a lane, had run at a third of the memory
// bandwidth)
constexpr int kDeltaRows = kThreads / 8;  // rows a CTA
template <int kDim, bool kBf16>
__global__ void __launch_bounds__(kThreads) flash_delta(Params p, int rows) {
  const int part = threadIdx.x & 7;
  const int64_t r = int64_t(blockIdx.x) * kDeltaRows + (threadIdx.x >> 3);  // r: (bh, query)
  float x = 0.f;
  if (r < rows) {  // (no early return: the whole warp shuffles below)
    const int64_t row = query_row<kDim>(p, r);
#pragma unroll
    for (int i = 0; i < (kDim / 8 + 7) / 8; ++i) {  // the row's 16-byte chunks part, part + 8, ...
      const int chunk = part + 8 * i;
      if (kDim % kPanelCols != 0 && chunk >= kDim / 8) break;
      const uint4 o = *reinterpret_cast<const uint4*>(p.o + row + chunk * 8);
      const uint4 d = *reinterpret_cast<const uint4*>(p.dout + row + chunk * 8);
      const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 a = unpack2<kBf16>(ow[w]), b = unpack2<kBf16>(dw[w]);
        x += a.x * b.x + a.y * b.y;
      }
    }
  }
#pragma unroll
  for (int off = 1; off < 8; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  if (r < rows && part == 0) p.delta[r] = x;
}

// -LSE in log2 units, the offset of a query's scaled scores (-inf for a row with no visible key or
// no query: its probabilities are 0)
__device__ __forceinline__ float neg_lse_log2(float lse) { return lse == -INFINITY ? -INFINITY : -lse * kLog2e; }

// One query tile of dK/dV: from Sᵀ (s) and dPdᵀ = V dOᵀ (dp), this thread's fragments of the
// kept probabilities Pᵀ (into s; dropped ones 0, kept ones not yet divided by 1 - p) and of
// dSᵀ = Pᵀ (dPᵀ - D) (into dp, dPᵀ dropped and scaled like P).  Rows are the CTA's keys, columns
// the tile's queries: nlse and delta are the tile's -LSE log2(e) and D, mask its keep bits.
template <bool kCausal, bool kBias, bool kDropout, bool kRagged>
__device__ __forceinline__ void dkdv_scores(float (&s)[8][4], float (&dp)[8][4], Params const& p, const float* nlse,
                                            const float* delta, const uint32_t* mask, const float (&kb)[2],
                                            const int (&key)[2], int m0, int warp, int g, int t) {
  const int shift = (warp & 1) * 16 + g;  // key row g's bit in a query's mask word (row g + 8: 8 above)
  // key row r sees the tile's queries from first[r] on (a key past the end none; nlse hides
  // queries past the end)
  int first[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) first[r] = key[r] >= p.sk ? kBlock : kCausal ? key[r] - m0 : 0;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int c = nt * 8 + 2 * t;  // the fragment's queries: c and c + 1 of the tile
    const float2 nl = *reinterpret_cast<const float2*>(nlse + c);
    const float2 dl = *reinterpret_cast<const float2*>(delta + c);
    uint32_t word[2] = {~0u, ~0u};
    if (kDropout) {
      word[0] = mask[2 * c + (warp >> 1)] >> shift;
      word[1] = mask[2 * c + 2 + (warp >> 1)] >> shift;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = e & 1, r = e >> 1;
      float x = fmaf(s[nt][e], p.scale_log2, kBias ? (j ? nl.y : nl.x) + kb[r] : (j ? nl.y : nl.x));
      const float pr = !(kCausal || kRagged) || c + j >= first[r] ? ex2(x) : 0.f;
      const bool kept_e = !kDropout || ((word[j] >> (8 * r)) & 1u);
      s[nt][e] = kept_e ? pr : 0.f;
      const float dpe = kept_e ? dp[nt][e] : 0.f;
      dp[nt][e] = pr * (kDropout ? fmaf(dpe, p.drop_scale, -(j ? dl.y : dl.x)) : dpe - (j ? dl.y : dl.x));
    }
  }
}

// ---- backward: dK and dV, one CTA per 64 keys
// K and V are the A operands of Sᵀ = K Qᵀ and dPdᵀ = V dOᵀ, held in registers for a head of one
// panel.  For two, their 2 x 32 registers a thread would not fit beside the 2 x 64 of the dK and dV
// accumulators and the 2 x 32 of Sᵀ and dPᵀ, so the MMAs read them from shared memory (wgmma's SS
// form) and the CTA keeps them there.
constexpr bool keys_in_smem(int dim) { return panels(dim) > 1; }
template <int kElems>
struct KeyTiles {
  alignas(1024) uint16_t k[kElems];
  alignas(1024) uint16_t v[kElems];
};
template <>
struct KeyTiles<0> {};  // K and V in registers (loaded through the first query buffers)

template <int kDim, bool kDropout>
struct DkdvShared {
  alignas(1024) uint16_t q[2][tile_elems(kDim)];
  alignas(1024) uint16_t d[2][tile_elems(kDim)];  // dO tiles
  alignas(16) float lse[2][kBlock];               // -LSE * log2(e) of the tile's queries (-inf: no query)
  alignas(16) float delta[2][kBlock];
  uint32_t mask[2][kDropout ? kMaskWords : 1];
  KeyTiles<keys_in_smem(kDim) ? tile_elems(kDim) : 0> keys;
};

template <int kDim, bool kBf16, bool kCausal, bool kBias, bool kDropout, bool kRagged>
__global__ void __launch_bounds__(kThreads) flash_dkdv(Params p) {
  constexpr int kPanels = panels(kDim), kSteps = kDim / 16;
  constexpr bool kKeysInSmem = keys_in_smem(kDim);
  auto& sm = shared_storage<DkdvShared<kDim, kDropout>>();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // 64 keys of key/value head ``bhk``, and the ``group`` query heads that read it (one without
  // grouped-query attention), from ``bh0`` on: their query tiles run one head after the other
  // (causal: the first key tiles, which the most queries see, rank first: cta_of)
  const Cta cta = cta_of(p, p.k_blocks);
  const int n0 = cta.rank * kBlock, bhk = cta.head, group = p.heads / p.kv_heads;
  const int bh0 = bhk / p.kv_heads * p.heads + bhk % p.kv_heads * group;
  const int ld = row_stride<kDim>(p, p.heads), ldk = row_stride<kDim>(p, p.kv_heads);

  // K and V of this CTA: into shared memory, and from there into registers (through the first
  // query buffers) unless the MMAs read them there
  uint16_t *k_tile = sm.q[0], *v_tile = sm.d[0];
  if constexpr (kKeysInSmem) k_tile = sm.keys.k, v_tile = sm.keys.v;
  load_tile<kDim>(k_tile, p.k + kv_base<kDim>(p, bhk), n0, p.sk, ldk, tid);
  load_tile<kDim>(v_tile, p.v + kv_base<kDim>(p, bhk), n0, p.sk, ldk, tid);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  uint32_t kf[kSteps][4], vf[kSteps][4];
  if constexpr (!kKeysInSmem) {
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      load_a(kf[kk], k_tile, warp * 16, kk, lane);
      load_a(vf[kk], v_tile, warp * 16, kk, lane);
    }
    __syncthreads();
  }

  const int key[2] = {n0 + warp * 16 + g, n0 + warp * 16 + g + 8};
  float kb[2] = {0.f, 0.f};
  if (kBias) {
#pragma unroll
    for (int r = 0; r < 2; ++r) kb[r] = key[r] < p.sk ? p.bias[key[r]] * kLog2e : 0.f;
  }
  float dk[kPanels][8][4], dv[kPanels][8][4];
#pragma unroll
  for (int n = 0; n < kPanels; ++n)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[n][nt][e] = dv[n][nt][e] = 0.f;

  const int first = kCausal ? n0 / kBlock : 0;
  const int last = (p.sq + kBlock - 1) / kBlock, per_head = max(last - first, 0);
  // query tile ``i`` of query head bh0 + ``h``: its Q and dO (cp.async), and this thread's value of
  // its row statistics (-LSE log2(e) for tid < 64, else D) and word of its keep bits.  These two
  // are loaded into registers as the tile's copies are issued and stored to shared memory only
  // when the tile before it is done (``stage``): stored as soon as loaded, each tile waited on
  // their global-memory latency.
  auto load_queries = [&](int h, int i, int buf) {
    const int64_t base = q_base<kDim>(p, bh0 + h);
    load_tile<kDim>(sm.q[buf], p.q + base, i * kBlock, p.sq, ld, tid);
    load_tile<kDim>(sm.d[buf], p.dout + base, i * kBlock, p.sq, ld, tid);
  };
  float stat = 0.f;
  uint32_t keep = 0;
  auto fetch = [&](int h, int i) {
    const int64_t qo = int64_t(bh0 + h) * p.sq;  // LSE and delta rows of the head
    const int r = i * kBlock + (tid & 63);
    stat = r < p.sq ? (tid < 64 ? p.lse[qo + r] : p.delta[qo + r]) : (tid < 64 ? -INFINITY : 0.f);
    if (kDropout) keep = mask_word(p, bh0 + h, i * kBlock, n0, tid);
  };
  auto stage = [&](int buf) {
    if (tid < 64) sm.lse[buf][tid] = neg_lse_log2(stat);
    else sm.delta[buf][tid - 64] = stat;
    if (kDropout) sm.mask[buf][tid] = keep;
  };
  if (first < last) {
    load_queries(0, first, 0);
    fetch(0, first);
    stage(0);
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  // Query tiles that see all the CTA's keys need no bound: causal, all but the diagonal one
  // (the first); ragged, none in the CTA whose key tile passes the end.  The bounded ones run first.
  const int bounded_end = kRagged && n0 + kBlock > p.sk ? last : kCausal ? min(first + 1, last) : first;
  auto query_tile = [&](auto bounded, int h, int i) {
    constexpr bool kBounded = decltype(bounded)::value;
    const int u = h * per_head + i - first, buf = u & 1, m0 = i * kBlock;  // u: the tile's turn
    const bool next = u + 1 < group * per_head;  // the next tile: this head's next, or the next head's first
    if (next) {
      const int nh = i + 1 < last ? h : h + 1, ni = i + 1 < last ? i + 1 : first;
      load_queries(nh, ni, buf ^ 1);
      fetch(nh, ni);
    }
    cp_async_commit();

    float s[8][4], dp[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
    if constexpr (kKeysInSmem)  // Sᵀ = K Qᵀ, dPdᵀ = V dOᵀ
      gemm_nk2<kBf16, kSteps>(s, sm.keys.k, sm.q[buf], dp, sm.keys.v, sm.d[buf]);
    else
      gemm_nk2<kBf16, kSteps>(s, kf, sm.q[buf], dp, vf, sm.d[buf]);
    // Pdᵀ into s (P where kept, else 0: dV is divided by 1 - p once, when stored); dSᵀ into dp
    dkdv_scores<kCausal && kBounded, kBias, kDropout, kRagged && kBounded>(s, dp, p, sm.lse[buf], sm.delta[buf],
                                                                          sm.mask[buf], kb, key, m0, warp, g, t);
    uint32_t pa[4][4], da[4][4];  // Pdᵀ and dSᵀ as A operands
    pack_a<kBf16>(pa, s);
    pack_a<kBf16>(da, dp);
    pin(dv);
    pin(dk);
    wgmma_fence();
    issue_kn<kBf16>(dv, pa, sm.d[buf]);  // dV += Pdᵀ dO
    issue_kn<kBf16>(dk, da, sm.q[buf]);  // dK += dSᵀ Q
    wgmma_commit();
    wgmma_wait();
    pin(dv);
    pin(dk);
    if (next) stage(buf ^ 1);
    cp_async_wait_all();
    __syncthreads();
  };
  for (int h = 0; h < group; ++h) {  // dK and dV add up over the group's heads in registers
    if constexpr (kCausal || kRagged) {  // (otherwise bounded_end == first)
      for (int i = first; i < bounded_end; ++i) query_tile(Bool<true>{}, h, i);
    }
    for (int i = bounded_end; i < last; ++i) query_tile(Bool<false>{}, h, i);
  }
  store_rows<kBf16, kDim>(p.dk + kv_base<kDim>(p, bhk), dk, p.scale, p.scale, n0 + warp * 16, p.sk, ldk, g, t);
  store_rows<kBf16, kDim>(p.dv + kv_base<kDim>(p, bhk), dv, p.drop_scale, p.drop_scale, n0 + warp * 16, p.sk, ldk,
                          g, t);
}

// ---- backward: dQ, one CTA per 64 query rows
template <int kDim, bool kBias, bool kDropout>
struct DqShared {
  alignas(1024) uint16_t k[2][tile_elems(kDim)];
  alignas(1024) uint16_t v[2][tile_elems(kDim)];
  uint32_t mask[2][kDropout ? kMaskWords : 1];
  alignas(16) float bias[2][kBias ? kBlock : 4];
};

template <int kDim, bool kBf16, bool kCausal, bool kBias, bool kDropout, bool kRagged>
__global__ void __launch_bounds__(kThreads, min_blocks(kDim)) flash_dq(Params p) {
  constexpr int kPanels = panels(kDim), kSteps = kDim / 16;
  auto& sm = shared_storage<DqShared<kDim, kBias, kDropout>>();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const Cta cta = cta_of(p, p.q_blocks);  // causal: the last query tiles, which see the most keys, first
  const int m0 = (kCausal ? p.q_blocks - 1 - cta.rank : cta.rank) * kBlock, bh = cta.head;
  const int ld = row_stride<kDim>(p, p.heads), ldk = row_stride<kDim>(p, p.kv_heads);
  const int64_t qo = int64_t(bh) * p.sq;  // LSE and delta rows of this head
  const uint16_t* K = p.k + kv_base<kDim>(p, kv_head(p, bh));
  const uint16_t* V = p.v + kv_base<kDim>(p, kv_head(p, bh));

  load_tile<kDim>(sm.k[0], p.q + q_base<kDim>(p, bh), m0, p.sq, ld, tid);
  load_tile<kDim>(sm.v[0], p.dout + q_base<kDim>(p, bh), m0, p.sq, ld, tid);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  uint32_t qf[kSteps][4], df[kSteps][4];
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    load_a(qf[kk], sm.k[0], warp * 16, kk, lane);
    load_a(df[kk], sm.v[0], warp * 16, kk, lane);
  }
  __syncthreads();

  const int row[2] = {m0 + warp * 16 + g, m0 + warp * 16 + g + 8};
  float nlse[2], dlt[2];  // -LSE log2(e) (-inf: no query) and D of the thread's two rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    nlse[r] = neg_lse_log2(row[r] < p.sq ? p.lse[qo + row[r]] : -INFINITY);
    dlt[r] = row[r] < p.sq ? p.delta[qo + row[r]] : 0.f;
  }
  int blocks = (p.sk + kBlock - 1) / kBlock;
  if (kCausal) blocks = min(blocks, (m0 + kBlock - 1) / kBlock + 1);
  load_tile<kDim>(sm.k[0], K, 0, p.sk, ldk, tid);
  load_tile<kDim>(sm.v[0], V, 0, p.sk, ldk, tid);
  if (kBias) load_bias(sm.bias[0], p, 0, tid);
  cp_async_commit();
  if (kDropout) mask_tile(sm.mask[0], p, bh, m0, 0, tid);
  cp_async_wait_all();
  __syncthreads();

  uint32_t keep_next = 0;  // the next tile's keep bits (this thread's word), stored when this tile is done
  float acc[kPanels][8][4];  // dQ, a panel's columns each
#pragma unroll
  for (int n = 0; n < kPanels; ++n)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[n][nt][0] = acc[n][nt][1] = acc[n][nt][2] = acc[n][nt][3] = 0.f;
  // as in the forward pass, the key tiles every row sees whole first, without the bound
  const int whole = whole_key_tiles<kCausal, kRagged>(p, m0, blocks);
  auto key_tile = [&](auto bounded, int j) {
    constexpr bool kBounded = decltype(bounded)::value;
    const int buf = j & 1, n0 = j * kBlock;
    if (j + 1 < blocks) {
      load_tile<kDim>(sm.k[buf ^ 1], K, n0 + kBlock, p.sk, ldk, tid);
      load_tile<kDim>(sm.v[buf ^ 1], V, n0 + kBlock, p.sk, ldk, tid);
      if (kBias) load_bias(sm.bias[buf ^ 1], p, n0 + kBlock, tid);
      if (kDropout) keep_next = mask_word(p, bh, m0, n0 + kBlock, tid);
    }
    cp_async_commit();
    float s[8][4], dp[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
    gemm_nk2<kBf16, kSteps>(s, qf, sm.k[buf], dp, df, sm.v[buf]);  // S = Q Kᵀ, dPd = dO Vᵀ
    // dS = P (dP - D), dP = dPd dropped and scaled like P; as the forward's softmax: one compare
    // a score against its row's visible keys, the keep bits a word per row (``fwd_softmax``)
    int visible[2];
    uint32_t keep[2][2] = {{~0u, ~0u}, {~0u, ~0u}};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      visible[r] = (kCausal ? min(p.sk, row[r] + 1) : p.sk) - n0;
      if (kDropout) {
#pragma unroll
        for (int h = 0; h < 2; ++h) keep[r][h] = sm.mask[buf][2 * (warp * 16 + g + 8 * r) + h] >> (2 * t);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = frag_col(nt, e, t), r = e >> 1;
        float x = fmaf(s[nt][e], p.scale_log2, nlse[r]);
        if (kBias) x = fmaf(sm.bias[buf][col], kLog2e, x);
        const float pr = !kBounded || col < visible[r] ? ex2(x) : 0.f;
        const bool kept_e = (keep[r][nt >> 2] >> (8 * (nt & 3) + (e & 1))) & 1u;
        const float dpe = kept_e ? dp[nt][e] : 0.f;
        s[nt][e] = pr * (kDropout ? fmaf(dpe, p.drop_scale, -dlt[r]) : dpe - dlt[r]);  // dS
      }
    }
    gemm_pk<kBf16>(acc, s, sm.k[buf]);  // dQ += dS K
    if (kDropout && j + 1 < blocks) sm.mask[buf ^ 1][tid] = keep_next;
    cp_async_wait_all();
    __syncthreads();
  };
  for (int j = 0; j < whole; ++j) key_tile(Bool<false>{}, j);
  if constexpr (kCausal || kRagged) {  // (otherwise whole == blocks)
    for (int j = whole; j < blocks; ++j) key_tile(Bool<true>{}, j);
  }
  store_rows<kBf16, kDim>(p.dq + q_base<kDim>(p, bh), acc, p.scale, p.scale, m0 + warp * 16, p.sq, ld, g, t);
}

// ---- the FFI side
inline int fail(const char* kind, const char* format, ...) {
  char message[1024];
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof(message), format, args);
  va_end(args);
  TVMFFIErrorSetRaisedFromCStr(kind, message);
  return -1;
}

inline DLTensor* tensor_of(TVMFFIAny const& arg) {
  if (arg.type_index == kTVMFFIDLTensorPtr) return static_cast<DLTensor*>(arg.v_ptr);
  if (arg.type_index == kTVMFFITensor) return TVMFFITensorGetDLTensorPtr(arg.v_obj);
  return nullptr;
}

// 0 when ``t`` is a contiguous tensor of the given shape and dtype on cuda:device, else -1 (raised)
inline int check(DLTensor const* t, const char* kernel, const char* what, std::initializer_list<int64_t> shape,
                 int code, int bits, int device) {
  if (t->device.device_type != kDLCUDA || t->device.device_id != device)
    return fail("ValueError", "%s: %s must be on cuda:%d", kernel, what, device);
  if (t->dtype.code != code || t->dtype.bits != bits || t->dtype.lanes != 1)
    return fail("TypeError", "%s: %s has dtype code %d bits %d, expected code %d bits %d", kernel, what,
                int(t->dtype.code), int(t->dtype.bits), code, bits);
  if (t->ndim != int32_t(shape.size()))
    return fail("ValueError", "%s: %s has rank %d, expected %d", kernel, what, int(t->ndim), int(shape.size()));
  int64_t stride = 1;
  for (int i = int(shape.size()) - 1; i >= 0; --i) {
    int64_t dim = *(shape.begin() + i);
    if (t->shape[i] != dim)
      return fail("ValueError", "%s: %s dim %d is %lld, the kernel was generated for %lld", kernel, what, i,
                  (long long)t->shape[i], (long long)dim);
    if (dim != 1 && t->strides != nullptr && t->strides[i] != stride)
      return fail("ValueError", "%s: %s is not contiguous", kernel, what);
    stride *= dim;
  }
  if ((reinterpret_cast<uintptr_t>(t->data) + t->byte_offset) % 16)
    return fail("ValueError", "%s: %s is not 16-byte aligned", kernel, what);
  return 0;
}

template <class T>
T* data_of(DLTensor const* t) {
  return reinterpret_cast<T*>(static_cast<char*>(t->data) + t->byte_offset);
}

// launches ``kernel`` over ``tiles`` tiles of ``heads`` heads, a CTA each, as cta_of reads the grid, with
// the dynamic shared memory its storage S needs, opting it in to more than 48 KB (a static S needs
// none).  ``ranked`` (causal: the tiles' work differs): in chunks of the heads whose CTAs fill two waves
// of what the GPU holds at once; else a head's tiles one after the other (chunks of one head), whose
// keys and values then serve CTAs running side by side: on H200 the chunks made BERT-Large's
// 32 x 16 x 512 attention 3-4 % slower, while on Llama's causal 4 x 32 x 2048 at D 128 they took 12 %
// off the backward over 8 key/value heads, and 6 % off the forward and 1.5 % off the backward over 32
// (docs/bench/h200-2026-11-30h)
template <class S>
inline void launch_tiles(void (*kernel)(Params), int tiles, int heads, bool ranked, cudaStream_t stream, Params p) {
  constexpr int bytes = dynamic_smem_bytes<S>();
  if constexpr (bytes > 0) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  p.head_chunk = 1;
  if (ranked) {
    int device = 0, sms = 132, per_sm = 1;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, bytes);
    const int resident = sms * (per_sm > 0 ? per_sm : 1);
    p.head_chunk = std::max(1, std::min(heads, (2 * resident + tiles - 1) / tiles));
  }
  kernel<<<dim3(unsigned(tiles) * unsigned(heads)), kThreads, bytes, stream>>>(p);
}

inline int launched(const char* kernel) {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : fail("RuntimeError", "%s: launch failed: %s", kernel, cudaGetErrorString(err));
}
}  // namespace tvm_evt_flash
#endif  // TVM_EVT_FLASH_KERNELS
"""

# The argument checks that open both entries (``run`` in the entry's namespace, over this file's
# ``tvm_evt_flash`` helpers rather than the CUTLASS prelude's), and their q, k, v parameters
ENTRY_OPEN = """
namespace ${namespace} {
using namespace tvm_evt_flash;
constexpr const char* kKernel = "${symbol}";

int run(TVMFFIAny const* args, int32_t num_args) {
  if (num_args != ${num_args})
    return fail("TypeError", "%s: expects ${num_args} tensors, got %d", kKernel, int(num_args));
  DLTensor* tensors[${num_args}];
  for (int i = 0; i < ${num_args}; ++i) {
    tensors[i] = tensor_of(args[i]);
    if (!tensors[i]) return fail("TypeError", "%s: argument %d is not a tensor", kKernel, i);
  }
${bind}
  const int device = q->device.device_id;
${checks}
  Params p{};
  p.q = data_of<const uint16_t>(q);
  p.k = data_of<const uint16_t>(k);
  p.v = data_of<const uint16_t>(v);
"""

# The parameters both entries set alike (after their tensors), then the stream to launch on
PARAMS = """\
${optional}
  p.sq = ${sq};
  p.sk = ${sk};
  p.heads = ${heads};
  p.kv_heads = ${kv_heads};
  p.bshd = ${bshd};
  p.q_blocks = (${sq} + kBlock - 1) / kBlock;
  p.k_blocks = (${sk} + kBlock - 1) / kBlock;
  p.scale = ${scale}f;
  p.scale_log2 = ${scale_log2}f;
  p.drop_scale = ${drop_scale}f;
  p.threshold = ${threshold}u;
  p.site = ${site}u;
  cudaSetDevice(device);
  cudaStream_t stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
"""

# One entry per partition: the shapes, dtype and flags are baked in and checked against the
# arguments.  ``${tensors}`` binds the DPS arguments (inputs, then outputs) by name.
FORWARD_ENTRY = Template(
    ENTRY_OPEN
    + """  p.out = data_of<uint16_t>(out);
  p.lse = data_of<float>(lse);
"""
    + PARAMS
    + """  launch_tiles<FwdShared<${head_dim}, ${has_bias}, ${has_dropout}>>(
      flash_fwd<${head_dim}, ${bf16}, ${causal}, ${has_bias}, ${has_dropout}, ${ragged}>, p.q_blocks,
      ${batch_heads}, ${causal}, stream, p);
  return launched(kKernel);
}
}  // namespace ${namespace}

"""
    + FFI_EXPORT
)

# The backward: D, then dK/dV and dQ as two kernels that each recompute S and dP.  With dropout, dQ
# used to be added up by the dK/dV kernel instead (dSᵀ K to an fp32 workspace by float2 atomics, then
# converted): one pass over S and dP instead of two, which won while dK/dV waited on a global load a
# tile.  Once it did not, its 16 KB of atomics a tile were its bottleneck (ncu: their operand reads
# stalled the warps, and the next tile's copies queued behind them), and the two kernels won (H100,
# scripts/bench_attention.py --layout bshd, backward ms): BERT-Large 0.552-0.555 -> 0.437-0.440,
# GPT-2 0.523-0.524 -> 0.474, ViT-B/16 0.428 -> 0.414 (docs/bench/h100-2026-11-26-f).
BACKWARD_ENTRY = Template(
    ENTRY_OPEN
    + """  p.o = data_of<const uint16_t>(o);
  p.dout = data_of<const uint16_t>(dout);
  p.lse = data_of<float>(lse);
  p.dq = data_of<uint16_t>(dq);
  p.dk = data_of<uint16_t>(dk);
  p.dv = data_of<uint16_t>(dv);
"""
    + PARAMS
    + """  const int rows = ${batch_heads} * ${sq};
  if (cudaMallocAsync(reinterpret_cast<void**>(&p.delta), sizeof(float) * rows, stream) != cudaSuccess)
    return fail("RuntimeError", "%s: cannot allocate %d floats of workspace", kKernel, rows);
  flash_delta<${head_dim}, ${bf16}><<<(rows + kDeltaRows - 1) / kDeltaRows, kThreads, 0, stream>>>(p, rows);
  launch_tiles<DkdvShared<${head_dim}, ${has_dropout}>>(
      flash_dkdv<${head_dim}, ${bf16}, ${causal}, ${has_bias}, ${has_dropout}, ${ragged}>, p.k_blocks,
      ${batch_kv_heads}, ${causal}, stream, p);
  launch_tiles<DqShared<${head_dim}, ${has_bias}, ${has_dropout}>>(
      flash_dq<${head_dim}, ${bf16}, ${causal}, ${has_bias}, ${has_dropout}, ${ragged}>, p.q_blocks,
      ${batch_heads}, ${causal}, stream, p);
  int status = launched(kKernel);
  cudaFreeAsync(p.delta, stream);
  return status;
}
}  // namespace ${namespace}

"""
    + FFI_EXPORT
)
