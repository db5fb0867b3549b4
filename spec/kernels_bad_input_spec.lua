-- kernels_bad_input_spec.lua — bad calls into the gl_ops.h kernels return
-- GL_ERR with a message naming the function, the argument and expected vs
-- got; none crashes or reads out of bounds.  Table-driven: each case is a
-- call and the exact text its error must contain.
local gl = require 'gptlua'
local lib, ffi = gl.lib, gl.ffi

local function t(shape, dtype) return gl.zeros(shape, { dtype = dtype or 'float32' }) end
local function ids(values, dtype) return gl.tensor(values, { dtype = dtype or 'int64' }) end

-- a struct that claims to live on cuda:0 but shares x's storage: enough to
-- reach the device checks (which must reject it before any kernel runs)
local function fake_cuda(x)
  local f = ffi.new('gl_tensor')
  ffi.copy(f, x.c, ffi.sizeof('gl_tensor'))
  f.device = 0
  return { c = f, keep = x }
end
local function freed(shape)
  local x = t(shape)
  x:free()
  return x
end
local function expanded(shape) return t({ 1, shape[2] }):expand(shape) end

local U, B, R = lib.GL_U_EXP, lib.GL_B_ADD, lib.GL_R_SUM

local cases = {
  -- handles, devices, output strides
  { 'freed input', function() return lib.gl_unary(U, t({ 3 }).c, freed({ 3 }).c, 0, 0) end,
    'gl_unary: x has been freed (its storage was released)' },
  { 'freed output', function() return lib.gl_softmax(freed({ 2, 3 }).c, t({ 2, 3 }).c, 0) end,
    'gl_softmax: out has been freed' },
  { 'nil input', function() return lib.gl_softmax(t({ 2, 3 }).c, nil, 0) end,
    'gl_softmax: x is nil, expected a tensor' },
  { 'nil required stat', function() return lib.gl_layernorm_backward(t({ 2, 3 }).c, nil, nil, t({ 2, 3 }).c,
      t({ 2, 3 }).c, nil, nil, t({ 2 }).c) end, 'gl_layernorm_backward: mean is nil, expected a tensor' },
  { 'zero-stride output', function() return lib.gl_unary(U, expanded({ 4, 3 }).c, t({ 4, 3 }).c, 0, 0) end,
    'gl_unary: out is a broadcast view (stride 0 in dim 1)' },
  { 'zero-stride matmul out', function() return lib.gl_matmul(expanded({ 4, 3 }).c, t({ 4, 2 }).c, t({ 2, 3 }).c, 1, 0) end,
    'gl_matmul: out is a broadcast view' },
  { 'zero-stride grad output', function() return lib.gl_embedding_backward(expanded({ 5, 3 }).c, t({ 2, 3 }).c,
      ids({ 0, 1 }).c) end, 'gl_embedding_backward: dtable is a broadcast view' },
  { 'mismatched devices', function() return lib.gl_unary(U, t({ 3 }).c, fake_cuda(t({ 3 })).c, 0, 0) end,
    'gl_unary: x is on cuda:0, expected cpu (the device of out)' },
  { 'mismatched devices in matmul', function() return lib.gl_matmul(t({ 2, 2 }).c, t({ 2, 2 }).c,
      fake_cuda(t({ 2, 2 })).c, 1, 0) end, 'gl_matmul: b is on cuda:0, expected cpu (the device of out)' },
  { 'mismatched devices in attention', function()
      local q = t({ 1, 1, 2, 4 })
      return lib.gl_attention_forward(t({ 1, 1, 2, 4 }).c, nil, q.c, fake_cuda(t({ 1, 1, 2, 4 })).c, q.c, 1, 0) end,
    'gl_attention_forward: k is on cuda:0, expected cpu (the device of out)' },

  -- elementwise
  { 'unary op out of range', function() return lib.gl_unary(99, t({ 3 }).c, t({ 3 }).c, 0, 0) end,
    'gl_unary: op is 99, expected 0..23' },
  { 'unary shape', function() return lib.gl_unary(U, t({ 3 }).c, t({ 4 }).c, 0, 0) end,
    'gl_unary: x has shape {4}, expected the shape of out {3}' },
  { 'unary backward int grad', function() return lib.gl_unary_backward(U, t({ 3 }).c, t({ 3 }, 'int32').c, t({ 3 }).c, 0, 0) end,
    'gl_unary_backward: dy has dtype int32, expected a floating dtype' },
  { 'binary op out of range', function() return lib.gl_binary(-1, t({ 3 }).c, t({ 3 }).c, t({ 3 }).c) end,
    'gl_binary: op is -1, expected 0..12' },
  { 'binary shape', function() return lib.gl_binary(B, t({ 2, 3 }).c, t({ 2, 3 }).c, t({ 3, 2 }).c) end,
    'gl_binary: b has shape {3,2}, expected the shape of out {2,3}' },
  { 'where shape', function() return lib.gl_where(t({ 3 }).c, t({ 2 }, 'bool').c, t({ 3 }).c, t({ 3 }).c) end,
    'gl_where: cond has shape {2}, expected the shape of out {3}' },

  -- reductions
  { 'reduce mask beyond dims', function() return lib.gl_reduce(R, t({ 1, 1 }).c, t({ 2, 3 }).c, 4) end,
    'gl_reduce: dims_mask 0x4 names dims beyond the 2 dims of x' },
  { 'reduce out shape', function() return lib.gl_reduce(R, t({ 2 }).c, t({ 2, 3 }).c, 2) end,
    'gl_reduce: out has shape {2}, expected {2,1} (x {2,3} reduced over dims_mask 0x2 keeps them as size 1)' },
  { 'reduce max over empty', function() return lib.gl_reduce(lib.GL_R_MAX, t({ 2, 1 }).c, gl.empty({ 2, 0 }).c, 2) end,
    'gl_reduce: cannot take the max over dim 2 of x, which has size 0' },
  { 'reduce op', function() return lib.gl_reduce(6, t({ 1 }).c, t({ 3 }).c, 1) end, 'gl_reduce: op is 6, expected 0..5' },
  { 'max_dim indices dtype', function() return lib.gl_reduce_max_dim(t({ 2, 1 }).c, t({ 2, 1 }, 'int32').c,
      t({ 2, 3 }).c, 1) end, 'gl_reduce_max_dim: indices has dtype int32, expected int64' },
  { 'max_dim dim range', function() return lib.gl_reduce_max_dim(t({ 2, 1 }).c, t({ 2, 1 }, 'int64').c,
      t({ 2, 3 }).c, 2) end, 'gl_reduce_max_dim: dim is 2, expected -2 <= dim < 2' },
  { 'sumsq NULL out', function() return lib.gl_sumsq(t({ 3 }).c, nil) end,
    'gl_sumsq: out is NULL, expected a pointer to a double' },

  -- matmul
  { 'matmul inner dims', function() return lib.gl_matmul(t({ 2, 5 }).c, t({ 2, 3 }).c, t({ 4, 5 }).c, 1, 0) end,
    'gl_matmul: b has shape {4,5}, expected {3,*} (K of a is 3)' },
  { 'matmul out shape', function() return lib.gl_matmul(t({ 3, 5 }).c, t({ 2, 3 }).c, t({ 3, 5 }).c, 1, 0) end,
    'gl_matmul: out has shape {3,5}, expected {2,5} (M of a is 2, N of b is 5)' },
  { 'matmul batch dims', function() return lib.gl_matmul(t({ 2, 2, 5 }).c, t({ 2, 2, 3 }).c, t({ 3, 3, 5 }).c, 1, 0) end,
    'gl_matmul: b has shape {3,3,5}, expected {2,3,*} (K of a is 3)' },
  { 'matmul dtype mix', function() return lib.gl_matmul(t({ 2, 2 }, 'float64').c, t({ 2, 2 }).c, t({ 2, 2 }, 'float64').c, 1, 0) end,
    'gl_matmul: a has dtype float32, expected float64 (the dtype of out)' },
  { 'matmul int', function() return lib.gl_matmul(t({ 2, 2 }, 'int32').c, t({ 2, 2 }, 'int32').c, t({ 2, 2 }, 'int32').c, 1, 0) end,
    'gl_matmul: out has dtype int32, expected a floating dtype' },
  { 'matmul vector', function() return lib.gl_matmul(t({ 2 }).c, t({ 2 }).c, t({ 2, 2 }).c, 1, 0) end,
    'gl_matmul: a has 1 dims, expected 2 to 8' },
  { 'matmul out aliases a', function() local a = t({ 3, 3 }); return lib.gl_matmul(a.c, a.c, t({ 3, 3 }).c, 1, 0) end,
    'gl_matmul: out overlaps the memory of a' },

  -- softmax and norms
  { 'softmax 0-d', function() return lib.gl_softmax(t({}).c, t({}).c, 0) end, 'gl_softmax: x has 0 dims, expected 1 to 8' },
  { 'softmax backward shape', function() return lib.gl_softmax_backward(t({ 2, 3 }).c, t({ 2, 3 }).c, t({ 2, 4 }).c, 0) end,
    'gl_softmax_backward: dy has shape {2,4}, expected the shape of y {2,3}' },
  { 'layernorm weight shape', function() return lib.gl_layernorm_forward(t({ 2, 3 }).c, t({ 2 }).c, t({ 2 }).c,
      t({ 2, 3 }).c, t({ 4 }).c, nil, 1e-5) end,
    'gl_layernorm_forward: weight has shape {4}, expected {3} (C, the last dim of x)' },
  { 'layernorm stat shape', function() return lib.gl_layernorm_forward(t({ 2, 3 }).c, t({ 3 }).c, t({ 2 }).c,
      t({ 2, 3 }).c, nil, nil, 1e-5) end,
    'gl_layernorm_forward: mean has shape {3}, expected {2} (the shape of x without its last dim)' },
  { 'layernorm stat dtype', function() return lib.gl_layernorm_forward(t({ 2, 3 }, 'bfloat16').c, t({ 2 }, 'bfloat16').c,
      t({ 2 }).c, t({ 2, 3 }, 'bfloat16').c, nil, nil, 1e-5) end,
    'gl_layernorm_forward: mean has dtype bfloat16, expected float32' },
  { 'layernorm empty rows', function() return lib.gl_layernorm_forward(gl.empty({ 2, 1 }).c, nil, nil, gl.empty({ 2, 0 }).c, nil, nil, 1e-5) end,
    'gl_layernorm_forward: x has an empty last dim (C = 0), expected C >= 1' },
  { 'layernorm eps', function() return lib.gl_layernorm_forward(t({ 2, 3 }).c, nil, nil, t({ 2, 3 }).c, nil, nil, -1) end,
    'gl_layernorm_forward: eps is -1, expected >= 0' },
  { 'rmsnorm dweight shape', function() return lib.gl_rmsnorm_backward(t({ 2, 3 }).c, t({ 2 }).c, t({ 2, 3 }).c,
      t({ 2, 3 }).c, t({ 3 }).c, t({ 2 }).c) end,
    'gl_rmsnorm_backward: dweight has shape {2}, expected {3} (C, the last dim of x)' },

  -- ids out of range: the value, its position and the limit
  { 'embedding id too large', function() return lib.gl_embedding_forward(t({ 3, 4 }).c, t({ 7, 4 }).c, ids({ 0, 7, 2 }).c) end,
    'gl_embedding_forward: ids[1] is 7, expected 0 <= ids < 7 (rows of table)' },
  { 'embedding negative id', function() return lib.gl_embedding_forward(t({ 2, 4 }).c, t({ 7, 4 }).c,
      ids({ -3, 1 }, 'int32').c) end, 'gl_embedding_forward: ids[0] is -3, expected 0 <= ids < 7 (rows of table)' },
  { 'embedding float ids', function() return lib.gl_embedding_forward(t({ 2, 4 }).c, t({ 7, 4 }).c, t({ 2 }).c) end,
    'gl_embedding_forward: ids has dtype float32, expected int32 or int64' },
  { 'embedding out shape', function() return lib.gl_embedding_forward(t({ 2, 5 }).c, t({ 7, 4 }).c, ids({ 1, 2 }).c) end,
    'gl_embedding_forward: out has shape {2,5}, expected {2,4} (ids.shape followed by C = 4 of table)' },
  { 'embedding backward id', function() return lib.gl_embedding_backward(t({ 5, 2 }).c, t({ 2, 2, 2 }).c,
      ids({ { 0, 1 }, { 4, 5 } }).c) end, 'gl_embedding_backward: ids[3] is 5, expected 0 <= ids < 5 (rows of dtable)' },
  { 'index_select idx', function() return lib.gl_index_select(t({ 2, 3 }).c, t({ 4, 3 }).c, 0, ids({ 1, 4 }).c) end,
    'gl_index_select: idx[1] is 4, expected 0 <= idx < 4 (size of x in dim)' },
  { 'gather into its own input', function() local x = t({ 2, 3 })
      return lib.gl_gather(x:narrow(2, 1, 2).c, x.c, 1, ids({ { 0, 1 }, { 1, 2 } }).c) end,
    'gl_gather: out overlaps the memory of x; the output must not alias this input' },
  { 'index_select dim', function() return lib.gl_index_select(t({ 2, 3 }).c, t({ 4, 3 }).c, 2, ids({ 1, 2 }).c) end,
    'gl_index_select: dim is 2, expected -2 <= dim < 2' },
  { 'gather idx', function() return lib.gl_gather(t({ 2, 2 }).c, t({ 2, 3 }).c, 1, ids({ { 0, 1 }, { 2, 3 } }).c) end,
    'gl_gather: idx[3] is 3, expected 0 <= idx < 3 (size of x in dim)' },
  { 'gather idx too wide', function() return lib.gl_gather(t({ 3, 2 }).c, t({ 2, 3 }).c, 1, ids({ { 0 }, { 1 }, { 2 } }).c) end,
    'gl_gather: idx has size 3 in dim 1, expected <= 2 (the size of x there)' },
  { 'scatter_add idx', function() return lib.gl_scatter_add(t({ 2, 3 }).c, 0, ids({ { 0, 2, 1 } }).c, t({ 1, 3 }).c) end,
    'gl_scatter_add: idx[1] is 2, expected 0 <= idx < 2 (size of out in dim)' },
  { 'index_add idx', function() return lib.gl_index_add(t({ 2, 3 }).c, 1, ids({ 5 }, 'int32').c, t({ 2, 1 }).c) end,
    'gl_index_add: idx[0] is 5, expected 0 <= idx < 3 (size of out in dim)' },
  { 'index_add src shape', function() return lib.gl_index_add(t({ 2, 3 }).c, 1, ids({ 1 }).c, t({ 2, 2 }).c) end,
    "gl_index_add: src has shape {2,2}, expected {2,1} (out's shape with dim 2 of size #idx = 1)" },
  { 'cross-entropy target', function() return lib.gl_cross_entropy_forward(t({ 2 }).c, t({ 2 }).c, t({ 2, 11 }).c,
      ids({ 3, 11 }).c, -100, 0) end,
    'gl_cross_entropy_forward: targets[1] is 11, expected 0 <= targets < 11 (vocab size of logits) or ignore_index -100' },
  { 'cross-entropy backward target', function() return lib.gl_cross_entropy_backward(t({ 2, 4 }).c, t({ 2, 4 }).c,
      ids({ -5, 1 }).c, t({ 2 }).c, -1, 0, 1, nil) end,
    'gl_cross_entropy_backward: targets[0] is -5, expected 0 <= targets < 4 (vocab size of logits) or ignore_index -1' },
  { 'cross-entropy backward scale_by', function() return lib.gl_cross_entropy_backward(t({ 2, 4 }).c, t({ 2, 4 }).c,
      ids({ 1, 1 }).c, t({ 2 }).c, -1, 0, 1, t({ 2 }).c) end,
    'gl_cross_entropy_backward: scale_by has 2 elements, expected 1' },
  { 'cross-entropy losses dtype', function() return lib.gl_cross_entropy_forward(t({ 2 }, 'bfloat16').c, nil,
      t({ 2, 4 }).c, ids({ 1, 1 }).c, -1, 0) end,
    'gl_cross_entropy_forward: losses has dtype bfloat16, expected float32 (float32, float64 for float64 logits)' },
  { 'cross-entropy targets shape', function() return lib.gl_cross_entropy_forward(t({ 2 }).c, nil, t({ 2, 4 }).c,
      ids({ 1, 1, 1 }).c, -1, 0) end,
    'gl_cross_entropy_forward: targets has shape {3}, expected {2} (N, the rows of logits)' },
  { 'cross-entropy softcap', function() return lib.gl_cross_entropy_forward(t({ 2 }).c, nil, t({ 2, 4 }).c,
      ids({ 1, 1 }).c, -1, -2) end, 'gl_cross_entropy_forward: softcap is -2, expected >= 0 (0 disables it)' },

  -- attention and rope
  { 'attention heads', function() return lib.gl_attention_forward(t({ 1, 3, 2, 4 }).c, nil, t({ 1, 3, 2, 4 }).c,
      t({ 1, 2, 2, 4 }).c, t({ 1, 2, 2, 4 }).c, 1, 0) end,
    'gl_attention_forward: q has 3 heads and k 2, expected H to be a multiple of Hkv >= 1' },
  { 'attention T > S', function() return lib.gl_attention_forward(t({ 1, 2, 5, 4 }).c, nil, t({ 1, 2, 5, 4 }).c,
      t({ 1, 2, 3, 4 }).c, t({ 1, 2, 3, 4 }).c, 1, 0) end,
    'gl_attention_forward: q has T = 5 queries and k S = 3 keys, expected T <= S' },
  { 'attention head dim', function() return lib.gl_attention_forward(t({ 1, 2, 2, 4 }).c, nil, t({ 1, 2, 2, 4 }).c,
      t({ 1, 2, 2, 3 }).c, t({ 1, 2, 2, 3 }).c, 1, 0) end,
    'gl_attention_forward: k has shape {1,2,2,3}, expected {1,*,*,4} ((B, Hkv, S, D) with B = 1, D = 4 of q)' },
  { 'attention lse', function() return lib.gl_attention_forward(t({ 1, 2, 2, 4 }).c, t({ 1, 2 }).c, t({ 1, 2, 2, 4 }).c,
      t({ 1, 2, 2, 4 }).c, t({ 1, 2, 2, 4 }).c, 1, 0) end,
    'gl_attention_forward: lse has shape {1,2}, expected {1,2,2} ((B, H, T) of q)' },
  { 'attention dtype', function() return lib.gl_attention_forward(t({ 1, 2, 2, 4 }).c, nil, t({ 1, 2, 2, 4 }).c,
      t({ 1, 2, 2, 4 }, 'float64').c, t({ 1, 2, 2, 4 }).c, 1, 0) end,
    'gl_attention_forward: k has dtype float64, expected float32 (the dtype of q)' },
  { 'attention backward dk shape', function() local q = t({ 1, 2, 2, 4 })
      return lib.gl_attention_backward(q.c, t({ 1, 1, 2, 4 }).c, t({ 1, 2, 2, 4 }).c, q.c, q.c, q.c, q.c, q.c,
        t({ 1, 2, 2 }).c, 1, 0) end,
    'gl_attention_backward: dk has shape {1,1,2,4}, expected the shape of k {1,2,2,4}' },
  { 'rope odd head dim', function() return lib.gl_rope(t({ 1, 2, 1, 3 }).c, t({ 1, 2, 1, 3 }).c, t({ 2, 1 }).c,
      t({ 2, 1 }).c, 0) end, 'gl_rope: x has head dim D = 3, expected an even D' },
  { 'rope table shape', function() return lib.gl_rope(t({ 1, 2, 1, 4 }).c, t({ 1, 2, 1, 4 }).c, t({ 3, 2 }).c,
      t({ 2, 2 }).c, 0) end, 'gl_rope: cos has shape {3,2}, expected {2,2} ((T, D/2) for x (B, T, H, D) = 2, 4)' },

  -- dropout and optimizers
  { 'dropout p', function() return lib.gl_dropout(t({ 3 }).c, t({ 3 }).c, 1.5, 1, 0) end,
    'gl_dropout: p is 1.5, expected 0 <= p < 1' },
  { 'adamw bf16 param', function() return lib.gl_adamw_update(t({ 4 }, 'bfloat16').c, t({ 4 }).c, t({ 4 }).c,
      t({ 4 }).c, 0, 4, 1e-3, 0.9, 0.95, 1e-8, 0, 1) end,
    'gl_adamw_update: param has dtype bfloat16, expected float32 or float64' },
  { 'adamw numel', function() return lib.gl_adamw_update(t({ 4 }).c, t({ 5 }).c, t({ 4 }).c, t({ 4 }).c, 0, 4,
      1e-3, 0.9, 0.95, 1e-8, 0, 1) end, 'gl_adamw_update: grad has 5 elements, expected 4 (the numel of param)' },
  { 'adamw slice', function() return lib.gl_adamw_update(t({ 4 }).c, t({ 4 }).c, t({ 4 }).c, t({ 4 }).c, 2, 3,
      1e-3, 0.9, 0.95, 1e-8, 0, 1) end,
    'gl_adamw_update: slice [start=2, start+len=5) is outside [0, 4), the numel of param' },
  { 'adamw non-contiguous', function() return lib.gl_adamw_update(t({ 2, 2 }).c, t({ 2, 2 }):t().c, t({ 2, 2 }).c,
      t({ 2, 2 }).c, 0, 4, 1e-3, 0.9, 0.95, 1e-8, 0, 1) end,
    'gl_adamw_update: grad is not contiguous, expected a flat contiguous tensor' },
  { 'adamw step', function() return lib.gl_adamw_update(t({ 4 }).c, t({ 4 }).c, t({ 4 }).c, t({ 4 }).c, 0, 4,
      1e-3, 0.9, 0.95, 1e-8, 0, 0) end, 'gl_adamw_update: step is 0, expected >= 1' },
  { 'momentum slice', function() return lib.gl_momentum_update(t({ 4 }).c, t({ 4 }).c, t({ 4 }).c, -1, 2, 0.9, 1) end,
    'gl_momentum_update: slice [start=-1, start+len=1) is outside [0, 4), the numel of buf' },
  { 'momentum int grad', function() return lib.gl_momentum_update(t({ 4 }).c, t({ 4 }).c, t({ 4 }, 'int64').c, 0, 4, 0.9, 1) end,
    'gl_momentum_update: grad has dtype int64, expected a floating dtype' },
}

describe('kernel argument validation', function()
  for _, c in ipairs(cases) do
    it('rejects ' .. c[1], function()
      lib.gl_clear_error()
      local rc = c[2]()
      assert.equal(-1, rc)
      local msg = ffi.string(lib.gl_last_error())
      assert.is_truthy(msg:find(c[3], 1, true), ('expected "%s" in "%s"'):format(c[3], msg))
    end)
  end
  it('leaves out-of-range ids unread and outputs untouched', function()
    local out = gl.full({ 2, 4 }, 3, { dtype = 'float32' })
    assert.equal(-1, lib.gl_embedding_forward(out.c, t({ 7, 4 }).c, ids({ 1, 1000000000 }).c))
    for _, v in ipairs(out:tolist()) do assert.equal(3, v) end
  end)
end)
