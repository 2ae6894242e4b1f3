// Decode attention and KV-cache writes: argument checks, then dispatch to the CPU or GPU backend.
#include "llmk/decode.h"

#include <cmath>
#include <string>
#include <tuple>

#include "core/backend.h"
#include "core/check.h"
#include "decode/decode_internal.h"
#include "llmk/rope.h"

namespace llmk {

using namespace detail;

namespace {

constexpr const char* kOp = "decode_attention";
constexpr int64_t kMaxTokens = 8;

// Checks the caches (and block table) against (batch, head_dim) and fills the layout. Returns Hkv.
int64_t check_cache(const char* op, KvCache& c, const TensorView& k_cache, const TensorView& v_cache,
                    const TensorView& block_table, const TensorView& ref, const char* ref_name,
                    int64_t batch, int64_t head_dim) {
  for (const TensorView* t : {&k_cache, &v_cache}) {
    const char* name = t == &k_cache ? "k_cache" : "v_cache";
    check_same_device(op, name, *t, ref_name, ref);
    check_same_dtype(op, name, *t, ref_name, ref);
    check_rank(op, name, *t, 4, 4);
    check_last_contiguous(op, name, *t);
  }
  check_same_shape(op, "v_cache", v_cache, "k_cache", k_cache);
  if (k_cache.shape[3] != head_dim)
    fail(ErrorKind::value, op,
         "k_cache: expected head dim " + std::to_string(head_dim) + " (the head dim of " + ref_name +
             ") in the last dim, got shape " + k_cache.shape_str());
  c.k = k_cache.data;
  c.v = v_cache.data;
  c.paged = block_table.defined();
  if (!c.paged) {
    if (k_cache.shape[0] != batch)
      fail(ErrorKind::value, op,
           "k_cache: expected a contiguous cache of shape " + shape_string({batch, -1, -1, head_dim}) +
               " (batch, kv_heads, max_seq_len, head_dim), got " + k_cache.shape_str());
    for (int d = 0; d < 3; ++d) {
      c.k_strides[d] = k_cache.strides[d];
      c.v_strides[d] = v_cache.strides[d];
    }
    c.capacity = k_cache.shape[2];
    return k_cache.shape[1];
  }
  check_same_device(op, "block_table", block_table, ref_name, ref);
  check_int(op, "block_table", block_table, false);
  check_rank(op, "block_table", block_table, 2, 2);
  check_last_contiguous(op, "block_table", block_table);
  if (block_table.shape[0] != batch)
    fail(ErrorKind::value, op,
         "block_table: expected shape " + shape_string({batch}, "max_blocks") + " (the batch of " + ref_name +
             "), got " + block_table.shape_str());
  c.block_size = k_cache.shape[1];
  if (c.block_size < 1 || c.block_size > 256)
    fail(ErrorKind::value, op,
         "k_cache: expected a paged cache (num_blocks, block_size, kv_heads, head_dim) with block_size "
         "1 to 256, got shape " + k_cache.shape_str());
  c.num_blocks = k_cache.shape[0];
  c.block_table = static_cast<const int32_t*>(block_table.data);
  c.table_stride = block_table.strides[0];
  c.max_blocks = block_table.shape[1];
  c.capacity = c.max_blocks * c.block_size;
  // paged strides are (block, slot, head)
  for (int d = 0; d < 3; ++d) {
    c.k_strides[d] = k_cache.strides[d];
    c.v_strides[d] = v_cache.strides[d];
  }
  return k_cache.shape[2];
}

KeyMask check_mask(const char* op, const TensorView& mask, const TensorView& q, int64_t batch, int64_t tokens) {
  check_same_device(op, "attn_mask", mask, "q", q);
  check_rank(op, "attn_mask", mask, 3, 3);
  const DType dt = mask.dtype;
  if (dt != DType::boolean && dt != DType::f32 && dt != q.dtype)
    fail(ErrorKind::type, op,
         std::string("attn_mask: expected dtype bool, float32 or q's ") + dtype_name(q.dtype) + ", got " +
             dtype_name(dt));
  if (mask.shape[0] != batch || (mask.shape[1] != 1 && mask.shape[1] != tokens))
    fail(ErrorKind::value, op,
         "attn_mask: expected shape " + shape_string({batch}, "1 or tokens, positions") + " with tokens = " +
             std::to_string(tokens) + " (q's), got " + mask.shape_str());
  KeyMask m;
  m.data = mask.data;
  m.dtype = dt;
  m.strides[0] = mask.strides[0];
  m.strides[1] = mask.shape[1] == 1 ? 0 : mask.strides[1];
  m.strides[2] = mask.strides[2];
  m.len = mask.shape[2];
  return m;
}

DecodeParams check_decode(const TensorView& out, const TensorView& q, const TensorView& k_cache,
                          const TensorView& v_cache, const TensorView* seq_lens,
                          const TensorView& block_table, const DecodeOptions& options) {
  const char* op = kOp;
  check_float(op, "q", q);
  check_rank(op, "q", q, 4, 4);
  check_last_contiguous(op, "q", q);
  DecodeParams p;
  p.batch = q.shape[0];
  p.tokens = q.shape[1];
  p.q_heads = q.shape[2];
  p.head_dim = q.shape[3];
  if (p.tokens < 1 || p.tokens > kMaxTokens)
    fail(ErrorKind::value, op,
         "q: expected (batch, tokens, heads, head_dim) with 1 to 8 tokens, got shape " + q.shape_str());
  p.kv_heads = check_cache(op, p.cache, k_cache, v_cache, block_table, q, "q", p.batch, p.head_dim);
  if (p.kv_heads < 1 || p.q_heads % p.kv_heads != 0)
    fail(ErrorKind::value, op,
         "q: expected a number of heads that is a multiple of the KV heads " + std::to_string(p.kv_heads) +
             " (GQA), got " + std::to_string(p.q_heads) + " heads in shape " + q.shape_str());
  if (out.defined()) {
    check_same_device(op, "out", out, "q", q);
    check_same_dtype(op, "out", out, "q", q);
    check_same_shape(op, "out", out, "q", q);
    check_last_contiguous(op, "out", out);
  }
  if (seq_lens) {
    check_same_device(op, "seq_lens", *seq_lens, "q", q);
    check_int(op, "seq_lens", *seq_lens, true);
    check_rank(op, "seq_lens", *seq_lens, 1, 1);
    if (seq_lens->shape[0] != p.batch)
      fail(ErrorKind::value, op,
           "seq_lens: expected shape " + shape_string({p.batch}) + " (the batch of q), got " + seq_lens->shape_str());
    p.seq_lens = seq_lens->data;
    p.seq_lens_stride = seq_lens->strides[0];
    p.seq_lens_i64 = seq_lens->dtype == DType::i64;
  }
  if (!std::isfinite(options.scale) || options.scale < 0.f)
    fail(ErrorKind::value, op, "scale: expected a finite value >= 0 (0: 1/sqrt(head_dim)), got " +
                                   std::to_string(options.scale));
  p.scale = options.scale > 0.f ? options.scale : 1.f / std::sqrt(static_cast<float>(p.head_dim));
  if (options.attn_mask.defined()) p.mask = check_mask(op, options.attn_mask, q, p.batch, p.tokens);
  p.q = q.data;
  p.out = out.data;
  for (int d = 0; d < 3; ++d) {
    p.q_strides[d] = q.strides[d];
    p.out_strides[d] = out.defined() ? out.strides[d] : 0;
  }
  p.dtype = q.dtype;
  p.device = q.device;
  if (p.device.kind == DeviceKind::gpu) {
    if (p.dtype == DType::f32)
      fail(ErrorKind::not_implemented, op, "q: the GPU path supports float16 and bfloat16, got float32");
    if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
      fail(ErrorKind::not_implemented, op,
           "q: the GPU path supports head dims 64, 128 and 256, got " + std::to_string(p.head_dim));
    const KvCache& c = p.cache;
    for (const void* ptr : {c.k, c.v})
      if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
        fail(ErrorKind::not_implemented, op, "k_cache/v_cache: the GPU path needs 16-byte aligned caches");
    for (int d = 0; d < 3; ++d)
      if (c.k_strides[d] % 8 != 0 || c.v_strides[d] % 8 != 0)
        fail(ErrorKind::not_implemented, op,
             "k_cache/v_cache: the GPU path needs strides that are multiples of 8 elements, got k_cache "
             "strides " + std::to_string(c.k_strides[0]) + ", " + std::to_string(c.k_strides[1]) + ", " +
                 std::to_string(c.k_strides[2]));
  }
  return p;
}

}  // namespace

int decode_attention_num_splits(TensorView q, TensorView k_cache, TensorView block_table,
                                const DecodeOptions& options) {
  DecodeParams p = check_decode(TensorView{}, q, k_cache, k_cache, nullptr, block_table, options);
  if (p.device.kind == DeviceKind::cpu) return 1;
  int splits = 1;
  run_on(kOp, p.device, [] {}, [&] { splits = decode_plan_gpu(p, options).num_splits; });
  return splits;
}

std::size_t decode_attention_workspace_size(TensorView q, TensorView k_cache, TensorView block_table,
                                            const DecodeOptions& options) {
  DecodeParams p = check_decode(TensorView{}, q, k_cache, k_cache, nullptr, block_table, options);
  if (p.device.kind == DeviceKind::cpu) return 0;
  std::size_t bytes = 0;
  run_on(kOp, p.device, [] {}, [&] { bytes = decode_plan_gpu(p, options).workspace_bytes; });
  return bytes;
}

void decode_attention(TensorView out, TensorView q, TensorView k_cache, TensorView v_cache,
                      TensorView seq_lens, TensorView block_table, const DecodeOptions& options,
                      void* workspace, std::size_t workspace_bytes, Stream stream) {
  if (!out.defined()) fail(ErrorKind::value, kOp, "out: expected a tensor, got none");
  DecodeParams p = check_decode(out, q, k_cache, v_cache, &seq_lens, block_table, options);
  p.stream = stream;
  p.workspace = workspace;
  p.workspace_zeroed = options.workspace_zeroed;
  if (p.batch == 0 || p.q_heads == 0) return;
  run_on(
      kOp, p.device,
      [&] {
        // The CPU can read the lengths and the table: bad values throw here.
        const KvCache& c = p.cache;
        for (int64_t b = 0; b < p.batch; ++b) {
          const int64_t len = seq_len_at(p, b);
          if (len < 0 || len > c.capacity)
            fail(ErrorKind::value, kOp,
                 "seq_lens: expected values in [0, " + std::to_string(c.capacity) +
                     "] (the cache capacity), got " + std::to_string(len) + " for sequence " +
                     std::to_string(b));
          if (!c.paged) continue;
          for (int64_t i = 0; i * c.block_size < len; ++i) {
            const int64_t blk = c.block_table[b * c.table_stride + i];
            if (blk < 0 || blk >= c.num_blocks)
              fail(ErrorKind::value, kOp,
                   "block_table: expected block indices in [0, " + std::to_string(c.num_blocks) +
                       ") (the cache's blocks), got " + std::to_string(blk) + " at [" + std::to_string(b) +
                       ", " + std::to_string(i) + "]");
          }
        }
        decode_attention_cpu(p);
      },
      [&] {
        const DecodePlan plan = decode_plan_gpu(p, options);
        if (plan.workspace_bytes > 0 && (workspace == nullptr || workspace_bytes < plan.workspace_bytes))
          fail(ErrorKind::value, kOp,
               "workspace: expected " + std::to_string(plan.workspace_bytes) +
                   " bytes (decode_attention_workspace_size), got " + std::to_string(workspace_bytes) +
                   (workspace ? " bytes" : " bytes at a null pointer"));
        if (plan.workspace_bytes > 0 && reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
          fail(ErrorKind::value, kOp, "workspace: expected a 16-byte aligned pointer");
        p.num_splits = plan.num_splits;
        p.split_len = plan.split_len;
        p.rows_per_block = plan.rows_per_block;
        p.warp_kernel = plan.warp_kernel;
        p.mma_kernel = plan.mma_kernel;
        p.mask_prefetch = plan.mask_prefetch;
        p.mask_skip = plan.mask_skip;
        p.tma = plan.tma;
        decode_attention_gpu(p);
      });
}

namespace {

// write_kv_cache's checks and parameters (op: the name in errors); false when there is nothing to do.
bool kv_write_params(const char* op, KvWriteParams& p, TensorView k_cache, TensorView v_cache, TensorView k,
                     TensorView v, TensorView positions, TensorView block_table, Stream stream, TensorView advance) {
  check_float(op, "k", k);
  check_rank(op, "k", k, 4, 4);
  check_last_contiguous(op, "k", k);
  check_same_device(op, "v", v, "k", k);
  check_same_dtype(op, "v", v, "k", k);
  check_same_shape(op, "v", v, "k", k);
  check_last_contiguous(op, "v", v);
  p.batch = k.shape[0];
  p.tokens = k.shape[1];
  p.kv_heads = k.shape[2];
  p.head_dim = k.shape[3];
  const int64_t hkv = check_cache(op, p.cache, k_cache, v_cache, block_table, k, "k", p.batch, p.head_dim);
  if (hkv != p.kv_heads)
    fail(ErrorKind::value, op,
         "k: expected " + std::to_string(hkv) + " heads (the KV heads of k_cache), got shape " + k.shape_str());
  check_same_device(op, "positions", positions, "k", k);
  check_int(op, "positions", positions, true);
  check_rank(op, "positions", positions, 2, 2);
  if (positions.shape[0] != p.batch || positions.shape[1] != p.tokens)
    fail(ErrorKind::value, op,
         "positions: expected shape " + shape_string({p.batch, p.tokens}) + " (batch and tokens of k), got " +
             positions.shape_str());
  p.k_cache = k_cache.data;
  p.v_cache = v_cache.data;
  p.k = k.data;
  p.v = v.data;
  for (int d = 0; d < 3; ++d) {
    p.k_strides[d] = k.strides[d];
    p.v_strides[d] = v.strides[d];
  }
  p.positions = positions.data;
  p.positions_int64 = positions.dtype == DType::i64;
  p.pos_strides[0] = positions.strides[0];
  p.pos_strides[1] = positions.strides[1];
  if (advance.defined()) {
    check_same_device(op, "advance", advance, "k", k);
    check_int(op, "advance", advance, true);
    if (advance.numel() != 1)
      fail(ErrorKind::value, op, "advance: expected one element (a length counter), got shape " + advance.shape_str());
    p.advance = advance.data;
    p.advance_int64 = advance.dtype == DType::i64;
  }
  p.dtype = k.dtype;
  p.device = k.device;
  p.stream = stream;
  // nothing to write: done, unless a counter is to advance by T anyway
  const bool empty = p.batch == 0 || p.kv_heads == 0 || p.head_dim == 0;
  return !(p.tokens == 0 || (empty && p.advance == nullptr));
}

}  // namespace

void write_kv_cache(TensorView k_cache, TensorView v_cache, TensorView k, TensorView v,
                    TensorView positions, TensorView block_table, Stream stream, TensorView advance) {
  const char* op = "write_kv_cache";
  KvWriteParams p;
  if (!kv_write_params(op, p, k_cache, v_cache, k, v, positions, block_table, stream, advance)) return;
  run_on(op, p.device, [&] { write_kv_cache_cpu(p); }, [&] { write_kv_cache_gpu(p); });
}

void rope_write_kv_cache(TensorView q_out, TensorView k_out, TensorView k_cache, TensorView v_cache,
                         TensorView q, TensorView k, TensorView v, TensorView cos, TensorView sin,
                         TensorView positions, Stream stream, TensorView advance) {
  const char* op = "rope_write_kv_cache";
  KvWriteParams p;
  const bool work = kv_write_params(op, p, k_cache, v_cache, k, v, positions, {}, stream, advance);
  check_rank(op, "q", q, 4, 4);
  check_last_contiguous(op, "q", q);
  check_same_device(op, "q", q, "k", k);
  check_same_dtype(op, "q", q, "k", k);
  if (q.shape[0] != p.batch || q.shape[1] != p.tokens || q.shape[3] != p.head_dim)
    fail(ErrorKind::value, op,
         "q: expected shape (" + std::to_string(p.batch) + ", " + std::to_string(p.tokens) + ", heads, " +
             std::to_string(p.head_dim) + ") (batch, tokens and head dim of k), got " + q.shape_str());
  if (p.head_dim % 2 != 0)
    fail(ErrorKind::value, op, "k: expected an even head dim (rotate-half pairs), got shape " + k.shape_str());
  for (const auto& [name, out, in_name, in] : {std::tuple<const char*, TensorView, const char*, TensorView>{
                                                   "q_out", q_out, "q", q},
                                               {"k_out", k_out, "k", k}}) {
    check_same_device(op, name, out, in_name, in);
    check_same_dtype(op, name, out, in_name, in);
    check_same_shape(op, name, out, in_name, in);
    check_last_contiguous(op, name, out);
  }
  for (const auto& [name, t] : {std::pair<const char*, TensorView>{"cos", cos}, {"sin", sin}}) {
    check_same_device(op, name, t, "k", k);
    check_same_dtype(op, name, t, "k", k);
    check_rank(op, name, t, 3, 3);
    check_last_contiguous(op, name, t);
    if (t.shape[0] != p.batch || t.shape[1] != p.tokens || t.shape[2] != p.head_dim / 2)
      fail(ErrorKind::value, op,
           std::string(name) + ": expected shape " + shape_string({p.batch, p.tokens, p.head_dim / 2}) +
               " (batch, tokens, head dim / 2 of k), got " + t.shape_str());
  }
  p.q = q.data;
  p.q_out = q_out.data;
  p.k_out = k_out.data;
  p.q_heads = q.shape[2];
  p.cos = cos.data;
  p.sin = sin.data;
  for (int d = 0; d < 3; ++d) {
    p.q_strides[d] = q.strides[d];
    p.q_out_strides[d] = q_out.strides[d];
    p.k_out_strides[d] = k_out.strides[d];
  }
  for (int d = 0; d < 2; ++d) {
    p.cos_strides[d] = cos.strides[d];
    p.sin_strides[d] = sin.strides[d];
  }
  if (!work) return;
  run_on(
      op, p.device,
      [&] {  // the CPU: rope's own path into q_out and k_out, then write_kv_cache's with k_out
        rope_cos_sin(q_out, k_out, q, k, cos, sin, RopeStyle::neox, false, stream);
        KvWriteParams rotated = p;
        rotated.k = k_out.data;
        for (int d = 0; d < 3; ++d) rotated.k_strides[d] = k_out.strides[d];
        write_kv_cache_cpu(rotated);
      },
      [&] { write_kv_cache_gpu(p); });
}

namespace detail {
unsigned decode_mma_flags() {
#if defined(LLMK_WITH_GPU)
  return decode_mma_flags_gpu();
#else
  return 0;
#endif
}
}  // namespace detail

}  // namespace llmk
