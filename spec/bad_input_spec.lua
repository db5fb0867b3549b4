-- Bad input never crashes: every call below raises a Lua error whose text
-- names the function, the argument and what was expected.
local gl = require 'gptlua'
local lib, ffi = gl.lib, gl.ffi

local function freed() local t = gl.zeros({ 3 }); t:free(); return t end

local cases = {
  { 'unknown dtype', function() gl.zeros({ 2 }, { dtype = 'float7' }) end, "empty: unknown dtype 'float7'" },
  { 'unknown device', function() gl.zeros({ 2 }, { device = 'tpu' }) end, "empty: unknown device 'tpu'" },
  { 'cuda without a GPU', function() gl.zeros({ 2 }, { device = 'cuda:0' }) end, 'cuda:0 requested but' },
  { 'negative size', function() gl.empty({ 2, -3 }) end, 'gl_empty: size of dim 2 must be >= 0, got -3' },
  { 'fractional size', function() gl.empty({ 2.5 }) end, 'empty: size of dim 1 must be an integer, got 2.5' },
  { 'too many dims', function() gl.empty({ 1, 1, 1, 1, 1, 1, 1, 1, 1 }) end, 'empty: at most 8 dims, got 9' },
  { 'element count overflow', function() gl.empty({ 2 ^ 40, 2 ^ 40 }) end, 'gl_empty: shape overflows 64-bit element count at dim 2' },
  { 'byte count overflow', function() gl.empty({ 2 ^ 61 }, { dtype = 'float64' }) end, 'overflow the byte count' },
  { 'view with the wrong count', function() gl.zeros({ 4, 4 }):view(3, 5) end, 'view: shape {3,5} has 15 elements, tensor has 16' },
  { 'view with two -1', function() gl.zeros({ 4, 4 }):view(-1, -1) end, 'view: only one dim can be -1' },
  { 'view of a non-contiguous tensor', function() gl.zeros({ 2, 3 }):t():view(6) end, 'view: tensor of shape {3,2} is not contiguous' },
  { 'transpose dim out of range', function() gl.zeros({ 2, 3 }):transpose(1, 3) end, 'transpose: dim 3 out of range for a 2-d tensor' },
  { 'narrow past the end', function() gl.zeros({ 5 }):narrow(1, 4, 3) end, 'narrow: range start=4 len=3 outside dim 1 of size 5' },
  { 'select out of range', function() gl.zeros({ 5 }):select(1, 6) end, 'select: index 6 out of range for dim 1 of size 5' },
  -- indices, dims and sizes pass one integer check (gptlua.check) instead of being truncated
  { 'narrow with a fractional start', function() gl.zeros({ 5 }):narrow(1, 2.5, 1) end, 'narrow: start must be a finite integer < 2^62, got 2.5' },
  { 'narrow with a fractional length', function() gl.zeros({ 5 }):narrow(1, 1, 1.5) end, 'narrow: length must be a finite integer < 2^62, got 1.5' },
  { 'narrow with a NaN start', function() gl.zeros({ 5 }):narrow(1, 0 / 0, 1) end, 'narrow: start must be a finite integer < 2^62, got' },
  { 'narrow with an infinite length', function() gl.zeros({ 5 }):narrow(1, 1, 1 / 0) end, 'narrow: length must be a finite integer < 2^62, got inf' },
  { 'narrow with a fractional dim', function() gl.zeros({ 5, 2 }):narrow(1.5, 1, 1) end, 'narrow: dim must be a finite integer < 2^62, got 1.5' },
  { 'select with a fractional index', function() gl.zeros({ 5 }):select(1, 2.5) end, 'select: index must be a finite integer < 2^62, got 2.5' },
  { 'select with a NaN index', function() gl.zeros({ 5 }):select(1, 0 / 0) end, 'select: index must be a finite integer < 2^62, got' },
  { 'select with a fractional dim', function() gl.zeros({ 5, 2 }):select(1.5, 1) end, 'select: dim must be a finite integer < 2^62, got 1.5' },
  { 'view with an infinite size', function() gl.zeros({ 4 }):view(1 / 0) end, 'view: size of dim 1 must be a finite integer < 2^62, got inf' },
  { 'view with a huge size', function() gl.zeros({ 4 }):view(2 ^ 70) end, 'view: size of dim 1 must be a finite integer < 2^62, got' },
  { 'reshape with a NaN size', function() gl.zeros({ 4 }):reshape({ 4, 0 / 0 }) end, 'reshape: size of dim 2 must be a finite integer < 2^62, got' },
  { 'expand with a fractional size', function() gl.zeros({ 1 }):expand(2.5) end, 'expand: size of dim 1 must be a finite integer < 2^62, got 2.5' },
  { 'unsqueeze with a fractional dim', function() gl.zeros({ 4 }):unsqueeze(1.5) end, 'unsqueeze: dim must be a finite integer < 2^62, got 1.5' },
  { 'transpose with a fractional dim', function() gl.zeros({ 2, 3 }):transpose(1.5, 2) end, 'transpose: dim must be a finite integer < 2^62, got 1.5' },
  { 'sum over a fractional dim', function() gl.zeros({ 2, 3 }):sum(1.5) end, 'sum: dim must be a finite integer < 2^62, got 1.5' },
  { 'split with a fractional size', function() gl.zeros({ 4 }):split(2.5) end, 'split: size must be a finite integer < 2^62, got 2.5' },
  { 'chunk into a fractional count', function() gl.zeros({ 4 }):chunk(2.5) end, 'chunk: n must be a finite integer < 2^62, got 2.5' },
  { 'chunk into 0 pieces', function() gl.zeros({ 4 }):chunk(0) end, 'chunk: n must be an integer >= 1, got 0' },
  { 'dropout with p = 1', function() gl.dropout(gl.zeros({ 4 }), 1, true) end, 'dropout: p must be in [0, 1), got 1' },
  { 'dropout with p = NaN', function() gl.dropout(gl.zeros({ 4 }), 0 / 0, true) end, 'dropout: p must be a finite number, got' },
  { 'gl_dropout with p = 1', function() gl.check(lib.gl_dropout(gl.zeros({ 4 }).c, gl.zeros({ 4 }).c, 1, 1, 0)) end,
    'gl_dropout: p is 1, expected 0 <= p < 1' },
  { 'expand of a non-1 dim', function() gl.zeros({ 2, 3 }):expand(4, 3) end, 'expand: cannot broadcast shape {2,3} to {4,3}' },
  { 'permute with a repeated dim', function() gl.zeros({ 2, 3 }):permute(1, 1) end, 'permute: dim 1 repeated' },
  { 'get with the wrong index count', function() gl.zeros({ 2, 3 }):get(1) end, 'get: expected 2 indices for a 2-d tensor, got 1' },
  { 'get out of range', function() gl.zeros({ 2, 3 }):get(1, 4) end, 'get: index 4 out of range for dim 2 of size 3' },
  { 'item of many elements', function() gl.zeros({ 2 }):item() end, 'item: tensor has 2 elements, expected exactly 1' },
  { 'ragged table', function() gl.tensor({ { 1, 2 }, { 3 } }) end, 'tensor: ragged nested table: dim 2 expected 2 entries, got 1' },
  { 'non-number in a table', function() gl.tensor({ 1, 'x' }) end, 'tensor: expected a number at depth 2, got string' },
  { 'use after free', function() freed():fill_(1) end, 'fill_: tensor was freed' },
  { 'copy from a freed tensor', function() gl.zeros({ 3 }):copy_(freed()) end, 'gl_copy: src has been freed' },
  { 'copy of mismatched shapes', function() gl.zeros({ 3 }):copy_(gl.zeros({ 4 })) end, 'copy_: cannot broadcast shape {4} to {3}' },
  { 'fill of a broadcast view', function() gl.zeros({ 1 }):expand(4):fill_(1) end, 'gl_fill: tensor is a broadcast view (stride 0 in dim 1)' },
  { 'as_strided past the storage', function() local t = gl.zeros({ 4 }); t:_as_strided({ 4 }, { 2 }, 0) end,
    'gl_as_strided: view reaches element 6, storage holds 4 elements' },
  { 'as_strided negative stride', function() local t = gl.zeros({ 4 }); t:_as_strided({ 2 }, { -1 }, 2) end,
    'gl_as_strided: stride of dim 1 must be >= 0, got -1' },
  { 'as_strided negative offset', function() local t = gl.zeros({ 4 }); t:_as_strided({ 1 }, { 1 }, -1) end,
    'gl_as_strided: offset must be >= 0, got -1' },
  { 'randn into an integer tensor', function() gl.zeros({ 3 }, { dtype = 'int32' }):normal_() end,
    'gl_rand_normal: tensor has dtype int32, expected a floating dtype' },
  { 'requires_grad on integers', function() gl.zeros({ 3 }, { dtype = 'int64' }):requires_grad_() end,
    'requires_grad_: only floating tensors can require gradients' },
  { 'invalid handle to the engine', function()
      local bogus = ffi.new('gl_tensor')
      gl.check(lib.gl_fill(bogus, 0))
    end, 'gl_fill: tensor is not a valid tensor handle' },
  { 'NULL tensor to the engine', function() gl.check(lib.gl_fill(nil, 0)) end, 'gl_fill: tensor is nil, expected a tensor' },
  { 'set_num_threads(0)', function() gl.set_num_threads(0) end, 'gl_set_num_threads: n must be >= 1, got 0' },
  { 'memory stats of a bad device', function() gl.memory_stats('gpu') end, "memory_stats: unknown device 'gpu'" },
  { 'arange with step 0', function() gl.arange(0, 5, 0) end, 'arange: step must not be 0' },
  { 'manual_seed negative', function() gl.manual_seed(-1) end, 'manual_seed: seed must be a non-negative number' },
  -- each class below once ended in a Lua internal or was accepted silently
  { 'as_strided with too few strides', function() gl.zeros({ 4 }):_as_strided({ 2, 2 }, { 1 }) end,
    'as_strided: stride has 1 entries, expected 2 (one per dim of shape {2,2})' },
  { 'as_strided with a fractional stride', function() gl.zeros({ 4 }):_as_strided({ 2 }, { 1.5 }) end,
    'as_strided: stride of dim 1 must be a finite integer, got 1.5' },
  { 'linear of a 0-d tensor', function() gl.linear(gl.tensor(1.0), gl.zeros({ 1, 1 })) end,
    'linear: x must be a Tensor with at least 1 dim (..., features), got a 0-d tensor' },
  { 'cross_entropy of 0-d logits', function() gl.cross_entropy(gl.tensor(1.0), gl.tensor(0, { dtype = 'int64' })) end,
    'cross_entropy: logits must be a Tensor with at least 1 dim (..., features), got a 0-d tensor' },
  { 'a model called with 1-d ids', function()
      local m = require('gptlua.models.gpt2').GPT({ vocab_size = 5, block_size = 4, n_layer = 1, n_head = 1, n_embd = 4 })
      m:forward(gl.tensor({ 1, 2 }, { dtype = 'int64' }))
    end, 'GPT2:forward: idx must be a (B, T) int32 or int64 Tensor of token ids with T >= 1, got a tensor of shape {2}' },
  { 'a model called with float ids', function()
      local m = require('gptlua.models.nanochat').GPT({ depth = 1, n_embd = 8, n_head = 1, vocab_size = 5, block_size = 4 })
      m:forward(gl.zeros({ 1, 2 }))
    end, 'Nanochat:forward: idx must be a (B, T) int32 or int64 Tensor of token ids with T >= 1, got dtype float32' },
  { 'generate from an empty prompt', function()
      local m = require('gptlua.models.gpt2').GPT({ vocab_size = 5, block_size = 4, n_layer = 1, n_head = 1, n_embd = 4 })
      m:generate(gl.zeros({ 1, 0 }, { dtype = 'int64' }), 2)
    end, 'GPT2:generate: idx must be a (B, T) int32 or int64 Tensor of token ids with T >= 1, got a tensor of shape {1,0}' },
  { 'from_merges with a string merge', function() require('gptlua.tokenizer').from_merges({ 'ab' }) end,
    "tokenizer.from_merges: merges[1] must be a pair {left, right} of ids in [0, 255] (the bytes and earlier merges), got the string 'ab'" },
  { 'from_merges with a fractional id', function() require('gptlua.tokenizer').from_merges({ { 97, 98 }, { 256.5, 99 } }) end,
    'tokenizer.from_merges: merges[2] must be a pair {left, right} of ids in [0, 256] (the bytes and earlier merges), got {256.5, 99}' },
  { 'from_merges with an id not yet made', function() require('gptlua.tokenizer').from_merges({ { 256, 98 } }) end,
    'tokenizer.from_merges: merges[1] must be a pair {left, right} of ids in [0, 255] (the bytes and earlier merges), got {256, 98}' },
  { 'checkpoint.save of a number', function()
      require('gptlua.checkpoint').save(os.tmpname() .. '.d', 1, { model = { w = 5 }, state = { config = {} } })
    end, "checkpoint.save: model['w'] must be a Tensor, got 5" },
  { 'save_safetensors of a string', function()
      require('gptlua.checkpoint').save_safetensors(os.tmpname(), { a = gl.zeros({ 1 }), b = 'x' })
    end, "checkpoint.save_safetensors: tensors['b'] must be a Tensor, got the string 'x'" },
  { 'layer_norm weight of another dtype', function() gl.layer_norm(gl.ones({ 2, 4 }), gl.ones({ 4 }, { dtype = 'float64' })) end,
    'gl_layernorm_forward: weight has dtype float64, expected float32 (the dtype of x)' },
  { 'layer_norm bias of another dtype', function()
      gl.layer_norm(gl.ones({ 2, 4 }), gl.ones({ 4 }), gl.zeros({ 4 }, { dtype = 'bfloat16' }))
    end, 'gl_layernorm_forward: bias has dtype bfloat16, expected float32 (the dtype of x)' },
  { 'rms_norm weight of another dtype', function() gl.rms_norm(gl.ones({ 2, 4 }), gl.ones({ 4 }, { dtype = 'bfloat16' })) end,
    'gl_rmsnorm_forward: weight has dtype bfloat16, expected float32 (the dtype of x)' },
  { 'nn.RMSNorm of another dtype than its input', function() require('gptlua.nn').RMSNorm(4, { weight = true })(gl.ones({ 2, 4 }, { dtype = 'float64' })) end,
    'gl_rmsnorm_forward: weight has dtype float32, expected float64 (the dtype of x)' },
  { 'add_rms_norm weight of another dtype', function()
      gl.add_rms_norm(gl.ones({ 2, 4 }), gl.ones({ 2, 4 }), gl.ones({ 4 }, { dtype = 'float64' }))
    end, 'gl_add_norm_forward: weight has dtype float64, expected float32 (the dtype of x)' },
  { 'backward with a gradient of another dtype', function()
      local x = gl.ones({ 3 }):requires_grad_()
      ;(x * 2):backward(gl.ones({ 3 }, { dtype = 'float64' }))
    end, "backward: grad must be {3} float32 on cpu (the output's shape, dtype and device), got {3} float64 on cpu" },
  { 'backward with a gradient of another shape', function()
      local x = gl.ones({ 3 }):requires_grad_()
      ;(x * 2):backward(gl.ones({ 1, 3 }))
    end, "backward: grad must be {3} float32 on cpu (the output's shape, dtype and device), got {1,3} float32 on cpu" },
  { 'backward with a gradient that is not a tensor', function()
      local x = gl.ones({ 3 }):requires_grad_()
      ;(x * 2):backward({ 1, 1, 1 })
    end, 'backward: grad must be a Tensor' },
  { 'a thread count far past the cores', function() gl.set_num_threads(2 ^ 31 - 1) end,
    ('gl_set_num_threads: n must be <= %d (4 threads for each of this machine\'s %d cores), got 2147483647')
      :format(4 * gl.num_cores(), gl.num_cores()) },
  { 'safetensors save to a missing directory', function()
      require('gptlua.checkpoint').save_safetensors('/nonexistent/dir/x.safetensors', { a = gl.zeros({ 1 }) })
    end, "gl_safetensors_save: cannot create '/nonexistent/dir/x.safetensors.tmp." },
}

describe('bad input', function()
  it('has at least 30 cases', function() assert.is_true(#cases >= 30) end)
  for _, c in ipairs(cases) do
    it('rejects ' .. c[1], function()
      local ok, err = pcall(c[2])
      assert.is_false(ok, 'expected an error')
      assert.truthy(tostring(err):find(c[3], 1, true), ('expected %q in %q'):format(c[3], tostring(err)))
    end)
  end
end)
