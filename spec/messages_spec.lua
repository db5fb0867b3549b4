-- Unclear messages (issue 14): every public Lua function checks its
-- arguments, so a wrong one raises one line that names the function, the
-- argument and what was expected, at the caller's line — never a Lua
-- internal ("attempt to index a nil value", "bad argument #1 to 'ipairs'").
--
-- Three parts: the calls the issue lists, written out; every gl.* op and
-- Tensor method driven through its declared signature (gl.signatures) with
-- a wrong value in each position; every other public entry (gl.*, nn modules,
-- optimizers, schedules, models) with a wrong argument.  A last spec makes
-- sure no gl.* function is left out of all of them.
local gl = require 'gptlua'
local nn = require 'gptlua.nn'
local optim = require 'gptlua.optim'
local gpt2 = require 'gptlua.models.gpt2'
local nanochat = require 'gptlua.models.nanochat'

local THIS = 'messages_spec.lua:'

-- asserts that fn fails with one line naming `name` (and `arg`), reported at
-- this file's line, with no Lua internals in it
local function rejects(fn, name, arg)
  local ok, err = pcall(fn)
  assert.is_false(ok, name .. ': expected an error')
  err = tostring(err)
  assert.is_nil(err:find('\n'), 'not one line: ' .. err)
  assert.is_nil(err:find('attempt to', 1, true), 'a Lua internal: ' .. err)
  assert.is_nil(err:find('bad argument', 1, true), 'a Lua internal: ' .. err)
  local want = arg and (name .. ': ' .. arg) or name
  assert.truthy(err:find(want, 1, true), ('expected %q in %q'):format(want, err))
  assert.truthy(err:find(THIS, 1, true), 'the error does not point at the caller: ' .. err)
  return err
end

local function x22() return gl.zeros({ 2, 2 }) end

describe('messages: the calls of issue 14', function()
  local cases = {
    { 'matmul', function() gl.matmul(x22(), 5) end, 'matmul: b must be a Tensor, got 5' },
    { 'matmul', function() x22():matmul('a') end, "matmul: b must be a Tensor, got the string 'a'" },
    { 'softmax', function() gl.softmax({}) end, 'softmax: x must be a Tensor, got table' },
    { 'embedding', function() gl.embedding(gl.zeros({ 2 }, { dtype = 'int64' }), nil) end,
      'embedding: weight must be a Tensor, got nil' },
    { 'cross_entropy', function() gl.cross_entropy(x22(), { 1, 2 }) end, 'cross_entropy: targets must be a Tensor, got table' },
    { 'cat', function() gl.cat({ x22(), 5 }) end, 'cat: tensors[2] must be a Tensor, got 5' },
    { 'cat', function() gl.cat(x22()) end, 'cat: tensors must be a list of Tensors, got Tensor' },
    { 'load_state_dict', function() nn.Linear(2, 2):load_state_dict({ weight = 5, bias = gl.zeros({ 2 }) }) end,
      "load_state_dict: state dict entry 'weight' must be a Tensor, got 5" },
    { 'load_state_dict', function() nn.Linear(2, 2):load_state_dict(5) end,
      'load_state_dict: state_dict must be a table, got 5' },
    { 'AdamW', function() optim.AdamW({ x22() }, 5) end, 'AdamW: opts must be a table, got 5' },
    { 'AdamW', function() optim.AdamW({ 5 }) end, 'AdamW: group 1 entry 1 must be a Tensor or a {name, Tensor} pair, got 5' },
    { 'AdamW', function() optim.AdamW({ x22() }, { betas = 0.9 }) end, 'AdamW: betas must be a pair {beta1, beta2}, got 0.9' },
    { 'backward', function() gl.backward(5) end, 'backward: root must be a Tensor, got 5' },
    { 'backward', function() x22():backward(5) end, 'backward: grad must be a Tensor, got 5' },
    { 'checkpoint', function() gl.checkpoint(5) end, 'checkpoint: fn must be a function, got 5' },
    -- operators: the operand checks of tensor.lua's metamethods or the op's own signature
    { 'add', function() return x22() + 'a' end, "must be a Tensor or a number, got the string 'a'" },
    { 'mul', function() return {} * x22() end, 'must be a Tensor or a number, got table' },
    { 'sum', function() x22():sum(0 / 0) end, 'sum: dim must be a finite integer < 2^62, got nan' },
    { 'Linear', function() nn.Linear(2, 1 / 0) end, 'Linear: out_features must be a finite integer < 2^62, got inf' },
  }
  for _, c in ipairs(cases) do
    it(c[3], function()
      local err = rejects(c[2], c[1])
      assert.truthy(err:find(c[3], 1, true), ('expected %q in %q'):format(c[3], err))
    end)
  end
end)

-- a valid value and a wrong value of each argument kind
local VALID = {
  tensor = x22, tensor1 = x22, ids = function() return gl.zeros({ 1, 2 }, { dtype = 'int64' }) end,
  tensor_dict = function() return { a = x22() } end, scalar = function() return 1 end, number = function() return 1 end, real = function() return 1 end,
  integer = function() return 1 end, count = function() return 1 end, size = function() return 1 end,
  dims = function() return 1 end, opts = function() return {} end, table = function() return {} end,
  shape = function() return { 2 } end, tensors = function() return { x22() } end, boolean = function() return true end,
  string = function() return 'float32' end, device = function() return 'cpu' end,
  ['function'] = function() return function() end end, callable = function() return function() end end,
  module = function() return nn.Linear(2, 2) end, any = function() return nil end,
}
local WRONG = {
  tensor = 'a', tensor1 = 'a', ids = 'a', tensor_dict = 5, scalar = 'a', number = 'a', real = 'a', integer = 2.5, count = 0, size = -1, dims = 'a', opts = 5,
  table = 5, shape = "a", tensors = 5, boolean = 'a', string = 5, device = 5, ['function'] = 5, callable = 5, module = 5,
}

local function parse(sig)
  local list = {}
  for item in sig:gmatch('[^,]+') do
    local name, kind, opt = item:match('^%s*([%w_%.%[%]]+)%s*:%s*([%w_]+)(%??)%s*$')
    list[#list + 1] = { name = name, kind = kind, opt = opt == '?' }
  end
  return list
end

-- every position of every signature, with the earlier arguments valid
local function drive(label, fns, sigs)
  describe(label, function()
    local names = {}
    -- (init.lua also declares helpers that gptlua.ops may export; only the
    -- ones that exist are wrapped and driven)
    for name in pairs(sigs) do if fns[name] ~= nil then names[#names + 1] = name end end
    table.sort(names)
    for _, name in ipairs(names) do
      it(name .. ' names the argument that is wrong', function()
        local list = parse(sigs[name])
        local tried = 0
        for i, a in ipairs(list) do
          assert.truthy(VALID[a.kind], 'unknown kind ' .. tostring(a.kind))
          if a.kind ~= 'any' then
            local args = {}
            for j = 1, i - 1 do args[j] = VALID[list[j].kind]() end
            args[i] = WRONG[a.kind]
            local err = rejects(function() local r = fns[name](unpack(args, 1, i)); return r end, name, a.name)
            assert.truthy(err:find('must be', 1, true), err)
            tried = tried + 1
          end
        end
        assert.is_true(tried > 0)
      end)
    end
  end)
end

drive('messages: every gl op with a wrong argument', gl, gl.signatures.ops)
drive('messages: every Tensor method with a wrong argument', gl.Tensor, gl.signatures.methods)

describe('messages: the other public entries', function()
  local p = function() return gl.zeros({ 2, 2 }):requires_grad_() end
  local tiny = { n_layer = 1, n_head = 2, n_embd = 8, block_size = 8, vocab_size = 16 }
  local cases = {
    { 'empty', function() gl.empty('a') end },
    { 'empty_pinned', function() gl.empty_pinned({ 2.5 }) end },
    { 'tensor', function() gl.tensor({ 1 }, 5) end },
    { 'scope', function() gl.scope(5) end },
    { 'no_grad', function() gl.no_grad('a') end },
    { 'set_grad_enabled', function() gl.set_grad_enabled('yes') end },
    { 'set_default_dtype', function() gl.set_default_dtype(5) end },
    { 'set_default_dtype', function() gl.set_default_dtype('float7') end },
    { 'set_num_threads', function() gl.set_num_threads('a') end },
    { 'memory_stats', function() gl.memory_stats(5) end },
    { 'reset_peak_memory', function() gl.reset_peak_memory('gpu') end },
    { 'empty_cache', function() gl.empty_cache('gpu') end },
    { 'plan', function() gl.plan({}, 5) end },
    { 'check', function() gl.check('a') end },
    { 'Linear', function() nn.Linear(0, 2) end },
    { 'Embedding', function() nn.Embedding('a', 2) end },
    { 'LayerNorm', function() nn.LayerNorm(2, 5) end },
    { 'RMSNorm', function() nn.RMSNorm(nil) end },
    { 'Dropout', function() nn.Dropout(1) end },
    { 'ModuleList', function() nn.ModuleList(5) end },
    { 'ModuleList:append', function() nn.ModuleList():append(5) end },
    { 'Module:param', function() nn.Module():param('w', 5) end },
    { 'Module:add', function() nn.Module():add('m', 5) end },
    { 'Linear:forward', function() nn.Linear(2, 2)(5) end },
    { 'Linear:forward', function() local m = nn.Linear(2, 2); m.forward(x22()) end },
    { 'Embedding:forward', function() nn.Embedding(4, 2)('a') end },
    { 'LayerNorm:forward', function() nn.LayerNorm(2)({}) end },
    { 'RMSNorm:forward', function() nn.RMSNorm(2)(nil) end },
    { 'Dropout:forward', function() nn.Dropout(0.1)(5) end },
    { 'Sequential:forward', function() nn.Sequential({ nn.Linear(2, 2) })(5) end },
    { 'GPT2', function() gpt2.GPT(5) end },
    { 'GPT2:forward', function() gpt2.GPT(tiny)(5) end },
    { 'GPT2:forward', function() gpt2.GPT(tiny)(gl.zeros({ 1, 2 }, { dtype = 'int64' }), 'a') end },
    { 'GPT2:generate', function() gpt2.GPT(tiny):generate({ 1, 2 }, 3) end },
    { 'Nanochat', function() nanochat.GPT('a') end },
    { 'Nanochat:forward', function() nanochat.GPT({ depth = 1, n_embd = 8, n_head = 2, vocab_size = 16, block_size = 8 })(5) end },
    { 'AdamW', function() optim.AdamW(5) end },
    { 'AdamW', function() optim.AdamW({ { params = 5 } }) end },
    { 'AdamW', function() optim.AdamW({ p() }, { lr = 'a' }) end },
    { 'Muon', function() optim.Muon({ p() }, 5) end },
    { 'Muon', function() optim.Muon({ p() }, { ns_steps = 2.5 }) end },
    { 'Combined', function() optim.Combined(5) end },
    { 'step', function() optim.AdamW({ p() }).step(5) end },
    { 'load_state_dict', function() optim.AdamW({ p() }):load_state_dict(5) end },
    { 'optimizer load_state_dict', function() optim.AdamW({ p() }):load_state_dict({ step = 1 }) end },
    { 'optimizer load_state_dict', function()
        optim.AdamW({ p() }):load_state_dict({ step = 1, tensors = { ['adamw.g1.1.m'] = 5, ['adamw.g1.1.v'] = 5 } })
      end },
    { 'set_lr_mult', function() optim.AdamW({ p() }):set_lr_mult('a') end },
    { 'newton_schulz', function() optim.newton_schulz(5) end },
    { 'nanochat', function() optim.nanochat(5) end },
    { 'clip_grad_norm', function() optim.clip_grad_norm(5) end },
    { 'clip_grad_norm', function() optim.clip_grad_norm({ p() }, 'a') end },
    { 'schedules.linear_warmup', function() optim.schedules.linear_warmup('a') end },
    { 'schedules.cosine', function() optim.schedules.cosine(1, nil) end },
    { 'schedules.wsd', function() optim.schedules.wsd(1, 10, 'a') end },
    { 'schedules.muon_momentum', function() optim.schedules.muon_momentum('a') end },
  }
  for _, c in ipairs(cases) do
    it(c[1] .. ' rejects a wrong argument by name', function() rejects(c[2], c[1]) end)
  end
end)

describe('messages: checkpoint, tokenizer, data and dist entry points and their option fields', function()
  local ckpt = require 'gptlua.checkpoint'
  local tok = require 'gptlua.tokenizer'
  local data = require 'gptlua.data'
  local dist = require 'gptlua.dist'
  local chars = tok.char('abc')
  local function loader() return data.loader({ tokens = { 1, 2, 3, 4, 5, 6, 7, 8 }, batch_size = 1, block_size = 2 }) end
  local cases = {
    { 'checkpoint.save', function() ckpt.save(5, 1, {}) end, 'dir must be a string, got 5' },
    { 'checkpoint.save', function() ckpt.save('/tmp', 'a', {}) end, "step must be a finite integer size in [0, 2^62), got the string 'a'" },
    { 'checkpoint.load', function() ckpt.load(5) end, 'path must be a string, got 5' },
    { 'checkpoint.save_safetensors', function() ckpt.save_safetensors('/tmp/x.safetensors', 5) end, 'tensors must be a table of names to Tensors, got 5' },
    { 'checkpoint.load_safetensors', function() ckpt.load_safetensors(nil) end, 'path must be a string, got nil' },
    { 'checkpoint.checksum', function() ckpt.checksum({}) end, 'path must be a string, got table' },
    { 'tokenizer.train', function() tok.train('abc', 'x') end, "vocab_size must be a finite integer < 2^62, got the string 'x'" },
    { 'tokenizer.train', function() tok.train('abc', 300, 5) end, 'opts must be a table, got 5' },
    { 'tokenizer.from_merges', function() tok.from_merges(5) end, 'merges must be a table, got 5' },
    { 'Tokenizer:encode', function() chars:encode('a', 5) end, 'opts must be a table, got 5' },
    { 'Tokenizer:token_bytes', function() chars:token_bytes('x') end, "id must be a finite integer < 2^62, got the string 'x'" },
    { 'data.read_shard', function() data.read_shard(5) end, 'path must be a string, got 5' },
    { 'data.shard_writer', function() data.shard_writer('/tmp/x.bin', 'x') end, "vocab_size must be a finite integer < 2^62, got the string 'x'" },
    { 'data.list_files', function() data.list_files(5) end, 'dir must be a string, got 5' },
    { 'data.prepare', function() data.prepare(5) end, 'opts must be a table of options, got 5' },
    { 'data.prepare', function() data.prepare({ input = 'a', out = 5 }) end, 'out must be a string, got 5' },
    { 'data.loader', function() data.loader({ tokens = { 1 }, batch_size = 0, block_size = 2 }) end, 'batch_size must be an integer >= 1, got 0' },
    { 'data.loader', function() data.loader({ tokens = { 1 }, batch_size = 1, block_size = 2, bos_id = 'x' }) end,
      "bos_id must be a finite integer < 2^62, got the string 'x'" },
    { 'data.loader', function() data.loader({ tokens = { 1 }, batch_size = 1, block_size = 2, vocab_size = 'x' }) end,
      "vocab_size must be a finite integer size in [0, 2^62), got the string 'x'" },
    { 'Loader:set_state', function() loader():set_state(5) end, 'state must be a table, got 5' },
    { 'dist.init', function() dist.init({ backend = 5 }) end, 'backend must be a string, got 5' },
    { 'dist.init', function() dist.init(5) end, 'opts must be a table of options, got 5' },
    { 'dist.init', function() dist.init({ timeout = 'x' }) end, "timeout must be a number, got the string 'x'" },
    { 'dist.policy', function() dist.policy(5) end, 'name must be a string, got 5' },
  }
  for _, c in ipairs(cases) do
    it(c[1] .. ': ' .. c[3], function() rejects(c[2], c[1], c[3]) end)
  end
end)

describe('messages: coverage', function()
  -- gl.* functions that take no arguments, or accept any value
  local FREE = { cuda_available = true, default_device = true, get_num_threads = true, num_cores = true, blas_info = true,
                 get_default_dtype = true, is_grad_enabled = true, get_rng_state = true, is_tensor = true }
  local OTHERS = { empty = true, empty_pinned = true, tensor = true, scope = true, no_grad = true,
                   set_grad_enabled = true, set_default_dtype = true, set_num_threads = true, memory_stats = true,
                   reset_peak_memory = true, empty_cache = true, plan = true, backward = true, checkpoint = true,
                   check = true }
  it('every gl function has a signature or a spec above', function()
    local missing = {}
    for k, v in pairs(gl) do
      if type(v) == 'function' and not (gl.signatures.ops[k] or FREE[k] or OTHERS[k]) then missing[#missing + 1] = k end
    end
    table.sort(missing)
    assert.are.same({}, missing)
  end)
  it('every Tensor method has a signature', function()
    local statics = { empty = true, full = true, scope = true, wrap = true, from_table = true, shape_arg = true,
                      infer_shape = true, contiguous_strides = true, norm_dim = true, dtype_id = true,
                      device_id = true, set_default_dtype = true, get_default_dtype = true, __tostring = true,
                      __index = true, release = true, rebind = true, format = true, footer = true }
    local missing = {}
    for k, v in pairs(gl.Tensor) do
      if type(v) == 'function' and not (statics[k] or k:match('^__') or gl.signatures.ops[k] or gl.signatures.methods[k]) then
        missing[#missing + 1] = k
      end
    end
    table.sort(missing)
    assert.are.same({}, missing)
  end)
  it('the valid arguments of the driven specs are accepted', function()
    -- the checks must not refuse what the library itself passes
    assert.are.equal(4, gl.matmul(x22(), x22()):numel())
    assert.are.equal(2, gl.sum(x22(), { 1 }, true):dim())
    assert.are.equal(2, gl.clamp(x22(), -math.huge, math.huge):dim())
    assert.are.equal(1, gl.checkpoint(setmetatable({}, { __call = function(_, a) return a end }), x22()):dim() - 1)
  end)
end)

describe('messages: the engine adds context to an error without garbling it', function()
  -- engine code wraps a failure as gl_error("split: %s", gl_last_error());
  -- formatting into the buffer it reads from once printed "split: split:
  -- onnecting group ..." for "split: gloo: connecting group ..."
  it('a message formatted from the last error keeps the whole of it', function()
    local ffi = require 'ffi'
    pcall(ffi.cdef, 'int gl_error(const char *fmt, ...);')
    local lib = gl.lib
    lib.gl_error('gloo: connecting group %s', 'world.1[0]')
    lib.gl_error('split: %s', lib.gl_last_error())
    assert.equal('split: gloo: connecting group world.1[0]', ffi.string(lib.gl_last_error()))
    lib.gl_error('%s: staging buffer: %s', 'all_reduce', lib.gl_last_error())
    assert.equal('all_reduce: staging buffer: split: gloo: connecting group world.1[0]', ffi.string(lib.gl_last_error()))
  end)
end)
