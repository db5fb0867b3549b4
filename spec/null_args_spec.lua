-- Every exported C function survives a NULL in each pointer argument.
--
-- The calls are generated, not written by hand: the header the FFI is
-- declared from (gl_cdef(), i.e. build/gl_cdef.h, the preprocessed
-- engine/gptlua.h) is parsed for every function, and each pointer parameter
-- in turn gets NULL while the others get valid-looking values (live tensors,
-- real tokenizers, shards, loaders, buffers).  The calls run in a child
-- process (this file, run as a script), which prints each call before making
-- it, so a segfault fails the spec and names the call instead of killing the
-- busted run.  Each call must return its type's error value (GL_ERR, NULL,
-- -1) with a message that starts with the function's name and names the
-- parameter (or says NULL/nil where it names it by role: "gl_fill: tensor
-- is nil").  Parameters whose contract is that NULL is fine are listed in
-- NULL_OK with the reason; they are still called (they must not crash).
local ffi = require 'ffi'

-- fn -> param -> why NULL is accepted there
local NULL_OK = {
  gl_tensor_free = { t = 'a destructor: free(NULL) is a no-op' },
  gl_safetensors_close = { f = 'a destructor: free(NULL) is a no-op' },
  gl_bpe_trainer_free = { tr = 'a destructor: free(NULL) is a no-op' },
  gl_tok_free = { t = 'a destructor: free(NULL) is a no-op' },
  gl_shard_writer_abort = { w = 'a destructor: free(NULL) is a no-op' },
  gl_shard_close = { s = 'a destructor: free(NULL) is a no-op' },
  gl_data_free = { p = 'a destructor: free(NULL) is a no-op' },
  gl_loader_free = { L = 'a destructor: free(NULL) is a no-op' },
  gl_comm_free = { c = 'a destructor: free(NULL) is a no-op' },
  gl_comm_free_world = { c = 'a destructor: free(NULL) is a no-op' },
  gl_work_free = { w = 'a destructor: free(NULL) is a no-op' },
  gl_cuda_event_destroy = { e = 'a destructor: free(NULL) is a no-op' },
  gl_ckpt_writer_free = { w = 'a destructor: free(NULL) is a no-op' },
  gl_ckpt_writer_add = { metadata_json = 'optional: NULL writes no __metadata__' },
  gl_cuda_graph_destroy = { g = 'a destructor: free(NULL) is a no-op' },
  gl_cuda_host_free = { ptr = 'a destructor: free(NULL) is a no-op' },
  gl_safetensors_save = { metadata_json = 'optional: NULL writes no __metadata__' },
  gl_bpe_trainer_new = { pattern = 'optional: NULL selects the GPT-4 pattern' },
  gl_tok_from_merges = { pattern = 'optional: NULL selects the GPT-4 pattern' },
  gl_tok_unicode_version = { t = "optional: NULL asks for this build's tables" },
  gl_tok_from_ranks = { pattern = 'optional: NULL selects the GPT-4 pattern' },
  gl_layernorm_backward = { weight = 'optional: no affine scale', dweight = 'optional: weight has no gradient',
    dbias = 'optional: bias has no gradient' },
  gl_layernorm_forward = { weight = 'optional: no affine scale', bias = 'optional: no bias',
    mean = 'optional output: statistics not kept', rstd = 'optional output: statistics not kept' },
  gl_rmsnorm_forward = { weight = 'optional: no affine scale', rstd = 'optional output: statistics not kept' },
  gl_rope_rmsnorm_forward = { rstd = 'optional output: statistics not kept' },
  gl_attention_forward = { lse = 'optional output: log-sum-exp not kept (inference)' },
  gl_attention_forward_seg = { lse = 'optional output: log-sum-exp not kept (inference)' },
  gl_adamw_update_multi = { outs = 'optional: no low-precision copies of the parameters to write' },
  gl_adamw_update_block = { outs = 'optional: no low-precision copies of the parameters to write' },
  gl_cross_entropy_forward = { lse = 'optional output: log-sum-exp not kept' },
  gl_cross_entropy_backward = { scale_by = 'optional: no factor on the device (1)' },
  gl_list_files = { prefix = 'optional: NULL matches every name', suffix = 'optional: NULL matches every name' },
  gl_matmul_epilogue = { bias = 'optional: no bias (GELU) / no bias gradient wanted', aux = 'optional with GL_EPI_GELU: the GELU input not kept' },
  gl_linear_backward = { dx = 'optional output: not wanted', dweight = 'optional output: not wanted',
    dbias = 'optional output: not wanted', dx_bias = 'optional output: not wanted',
    pre_gelu = 'optional: the layer\'s input was not a GELU\'s output' },
  gl_rmsnorm_backward = { weight = 'optional: no affine scale', dweight = 'optional: weight has no gradient' },
  gl_cuda_mem_info = { free_bytes = 'optional output', total_bytes = 'optional output' },
  gl_copy_async = { done = 'optional: NULL makes the compute stream wait for the copy' },
  gl_comm_alloc = { b = 'a communicator without a backend (the world of one)' },
  gl_moe_permute = { weights = 'optional: every row copied with weight 1' },
  gl_moe_combine = { weights = 'optional: every expert row summed with weight 1' },
}

-- never called: what they do with valid arguments is not a NULL check
local NOT_CALLED = {
  gl_dist_abort = 'ends the process by contract (msg may be NULL)',
}

-- Known gaps, each shown as a pending test until it is fixed: 'crash' ones
-- are not called, 'no error' and 'message' ones are called and must still
-- not crash.  None today (engine/mpi/comm.c checks its pointers too).
local OUTSIDE = {}

-- functions whose errors name another one
local REPORTS_AS = {
  gl_tok_decoded_len = 'gl_tok_decode',   -- its sizing pass, called first by decode
  gl_comm_run = 'gl_comm_start',          -- start + wait
}

-- Scalar arguments by parameter name (anything else: 0).  They make the
-- call valid-looking: a CPU device, 2-d shapes, one special token, ...
local SCALARS = {
  device = -1, dtype = 0, ndim = 2, n = 1, n_special = 1, n_merges = 1, len = 3, nbytes = 64,
  vocab_size = 300, prepend_id = -1, ignore_index = -1, scale = 1, eps = 1e-5, p = 0.25, step = 1,
  alpha = 1, timeout_s = 1, dims_mask = 1, hi = 1, std = 1, vocab_limit = 0, byte_offset = 0,
}

local functions   -- the header's functions (below)

-- ---------------------------------------------------------------- driver --
local function driver(out_path)
  local gl = require 'gptlua'
  local lib = gl.lib
  local out = assert(io.open(out_path, 'w'))
  local function say(s) out:write(s, '\n'); out:flush() end
  local dir = os.tmpname(); os.remove(dir); os.execute('mkdir -p ' .. dir)
  local mpi_ok, mpi = pcall(ffi.load, require('gptlua.ffi').libdir .. '/libgptlua_mpi.so')
  if not mpi_ok then mpi = nil end
  -- the TCP backend's own entry point (gl_dist_init_tcp); the rest it
  -- shares with the MPI library (engine/mpi/comm.c)
  local gloo_ok, gloo = pcall(ffi.load, require('gptlua.ffi').libdir .. '/libgptlua_gloo.so')
  if not gloo_ok then gloo = nil end
  local keep = {}   -- everything the calls point into stays alive
  local function hold(x) keep[#keep + 1] = x; return x end

  local function tensor(dtype, ndim)
    local sh = ffi.new('int64_t[2]', 2, 3)
    return hold(ffi.gc(lib.gl_empty(dtype or lib.GL_F32, -1, ndim or 2, sh), lib.gl_tensor_free))
  end
  local function strings(n)
    local a = hold(ffi.new('const char *[?]', n))
    for i = 0, n - 1 do a[i] = hold(ffi.new('char[?]', 16, '<|s' .. i .. '|>')) end
    return a
  end
  -- opaque handles: one real object of each
  local st_path = dir .. '/t.safetensors'
  do
    local names, ts = strings(1), hold(ffi.new('const gl_tensor *[1]'))
    ts[0] = tensor()
    assert(lib.gl_safetensors_save(st_path, 1, names, ts, nil) == 0, ffi.string(lib.gl_last_error()))
  end
  local shard_path = dir .. '/t.bin'
  do
    local w = lib.gl_shard_writer_open(shard_path, 300)
    local ids = tensor(lib.GL_I32, 1)
    lib.gl_fill(ids, 1)
    assert(lib.gl_shard_writer_append(w, ids) == 0 and lib.gl_shard_writer_close(w) == 0)
  end
  local handles = {
    gl_st_file = function() return lib.gl_safetensors_open(st_path) end,
    gl_tokenizer = function() return lib.gl_tok_char('hello world', 11, 0, nil) end,
    gl_bpe_trainer = function() return lib.gl_bpe_trainer_new(nil) end,
    gl_shard_writer = function() return lib.gl_shard_writer_open(dir .. '/w.bin', 300) end,
    gl_shard = function() return lib.gl_shard_open(shard_path, 0, 0) end,
    gl_loader = function()
      local cfg = ffi.new('gl_loader_config', { batch_size = 1, block_size = 2, rank = 0, world_size = 1,
        vocab_size = 300, prefetch = 2 })
      return lib.gl_loader_new(cfg)
    end,
    gl_comm = function() return mpi and mpi.gl_comm_alloc(nil, 'null_args') or nil end,
    gl_cuda_event = function() return lib.gl_cuda_event_create(0) end,  -- NULL without a GPU
    gl_ckpt_writer = function() return lib.gl_ckpt_writer_new() end,
    gl_work = function() return nil end,  -- needs an initialised world
  }
  local function numbers(ctype, name)
    local a = hold(ffi.new(ctype .. '[64]'))
    for i = 0, 63 do a[i] = 1 end
    if name == 'shape' then a[0], a[1] = 2, 3 elseif name == 'stride' then a[0], a[1] = 3, 1 end
    return a
  end
  local NUMERIC = { int64_t = true, int32_t = true, uint64_t = true, uint32_t = true, double = true,
    int = true, float = true }
  -- a valid-looking value for a pointer parameter
  local function pointer(ptype, name)
    local base = ptype:gsub('const', ''):gsub('[%*%s]', '')
    local depth = select(2, ptype:gsub('%*', ''))
    if base == 'gl_tensor' and depth == 1 then
      local int = name:match('ids') or name:match('target') or name:match('idx') or name:match('tokens')
        or name:match('indices') or name == 'cond'
      return tensor(int and lib.GL_I64 or lib.GL_F32)
    elseif base == 'gl_tensor' then
      local a = hold(ffi.new(ptype:gsub('%*%s*$', '') .. '[4]'))
      if ptype:match('const') then for i = 0, 3 do a[i] = tensor() end end
      return a
    elseif base == 'char' and depth == 2 then return strings(4)
    elseif base == 'char' and not ptype:match('const') then return hold(ffi.new('char[4096]'))
    elseif base == 'char' then
      if name == 'path' then return dir .. '/' .. name .. '.out' end
      if name == 'dir' then return dir end
      if name == 'metadata_json' then return '{"a":"b"}' end
      if name == 'fn' then return 'gl_tensor_check' end   -- gl_tensor_check reports as fn, arg
      if name == 'arg' then return 't' end
      return 'hello world'
    elseif depth == 2 then return hold(ffi.new(ptype:gsub('%*%s*$', '') .. '[4]'))  -- out-param
    elseif handles[base] then return handles[base]()
    elseif NUMERIC[base] then return numbers(base, name)
    elseif base == 'void' then return hold(ffi.new('char[4096]'))
    else return hold(ffi.new(base .. '[1]')) end   -- a struct to fill or read
  end

  for _, f in ipairs(functions(ffi.string(lib.gl_cdef()))) do
    local found, fnp = pcall(function() return lib[f.name] end)
    if not found and mpi then found, fnp = pcall(function() return mpi[f.name] end) end
    if not found and gloo then found, fnp = pcall(function() return gloo[f.name] end) end
    for i, p in ipairs(f.params) do
      if p.pointer then
        local gap = OUTSIDE[f.name .. '.' .. p.name]
        if NOT_CALLED[f.name] or (gap and gap[1] == 'crash') then say(('SKIP %s %s'):format(f.name, p.name))
        elseif not found then say(('ABSENT %s %s'):format(f.name, p.name))
        else
          local args = {}
          for j, q in ipairs(f.params) do
            if j == i then args[j] = nil
            elseif q.pointer then args[j] = pointer(q.type, q.name)
            else args[j] = SCALARS[q.name] or 0 end
          end
          say(('CALL %s %s'):format(f.name, p.name))
          lib.gl_clear_error()
          local r = fnp(unpack(args, 1, #f.params))
          local err
          if f.ret == 'void' then err = 'void'
          elseif f.ret:find('%*') then err = r == nil and 'error' or 'value'
          elseif f.ret == 'double' then err = r < 0 and 'error' or 'value'
          else err = tonumber(r) == -1 and 'error' or 'value' end
          say(('DONE %s %s %s %s'):format(f.name, p.name, err, ffi.string(lib.gl_last_error())))
        end
      end
    end
  end
  os.execute('rm -rf ' .. dir)
  out:close()
end

-- -------------------------------------------------------------- the list --
-- Functions and their parameters from the C declarations text.
function functions(text)
  text = text:gsub('/%*.-%*/', ''):gsub('//[^\n]*', ''):gsub('\n%s*#[^\n]*', '\n')
  local flat, depth = {}, 0
  for ch in text:gmatch('.') do   -- struct and enum bodies out
    if ch == '{' then depth = depth + 1 elseif ch == '}' then depth = depth - 1
    elseif depth == 0 then flat[#flat + 1] = ch end
  end
  text = table.concat(flat):gsub('%s+', ' ')
  local list = {}
  for decl in text:gmatch('[^;]+') do
    local ret, name, params = decl:match('^%s*(.-)%s*(gl_[%w_]+)%s*%((.*)%)%s*$')
    if ret and not decl:match('typedef') then
      local f = { name = name, ret = ret:gsub('%s*%*%s*', '*'), params = {} }
      if params ~= 'void' then
        for p in params:gmatch('[^,]+') do
          local arr = p:find('[', 1, true)
          local ty, pname = p:gsub('%[.*%]', ''):match('^%s*(.-)%s*([%w_]+)%s*$')
          if arr then ty = ty .. ' *' end
          f.params[#f.params + 1] = { type = ty, name = pname, pointer = ty:find('%*') ~= nil }
        end
      end
      list[#list + 1] = f
    end
  end
  return list
end

if describe == nil then   -- run as a script: the child process
  if arg and arg[1] == 'driver' then driver(arg[2]) end
  return
end

describe('exported C functions given NULL pointer arguments', function()
  local gl = require 'gptlua'
  local functions_list = functions(ffi.string(gl.lib.gl_cdef()))

  it('are all found in the header', function()
    assert.is_true(#functions_list > 150, 'parsed ' .. #functions_list .. ' functions')
    for fn, params in pairs(NULL_OK) do
      local f
      for _, g in ipairs(functions_list) do if g.name == fn then f = g end end
      assert.is_not_nil(f, fn .. ' is listed in NULL_OK but not declared')
      for pname in pairs(params) do
        local ok = false
        for _, p in ipairs(f.params) do if p.name == pname and p.pointer then ok = true end end
        assert.is_true(ok, fn .. ': NULL_OK names ' .. pname .. ', which is not a pointer parameter')
      end
    end
  end)

  it('return an error naming the function and the argument, and never crash', function()
    local out = os.tmpname()
    local me = debug.getinfo(1, 'S').source:gsub('^@', '')
    local cmd = ('%s %s driver %s > %s.log 2>&1'):format(GPTLUA.exe, me, out, out)
    local ok, _, code = os.execute(cmd)
    local status = type(ok) == 'number' and ok / 256 or code
    local lines = {}
    for l in io.lines(out) do lines[#lines + 1] = l end
    local log = io.open(out .. '.log'):read('*a')
    os.remove(out); os.remove(out .. '.log')
    local last = lines[#lines] or ''
    assert.is_true(status == 0, ('the driver died (status %s) at: %s\n%s'):format(tostring(status), last, log))
    local bad, called = {}, 0
    for _, l in ipairs(lines) do
      local fn, pname, kind, msg = l:match('^DONE (%S+) (%S+) (%S+) ?(.*)$')
      if fn then
        called = called + 1
        local why = NULL_OK[fn] and NULL_OK[fn][pname]
        local gap = OUTSIDE[fn .. '.' .. pname]
        if not why and not gap then
          local as = REPORTS_AS[fn] or fn
          local named = msg:sub(1, #as + 1) == as .. ':' and
            (msg:find('%f[%w_]' .. pname .. '%f[^%w_]') or msg:find('%f[%w]NULL%f[^%w]') or msg:find('%f[%w]nil%f[^%w]'))
          if kind ~= 'error' or not named then
            bad[#bad + 1] = ('%s(%s = NULL): %s, message %q'):format(fn, pname,
              kind == 'error' and 'error' or 'no error (returned ' .. kind .. ')', msg)
          end
        end
      end
    end
    assert.is_true(called > 200, 'only ' .. called .. ' calls made')
    assert.are.same({}, bad)
  end)

  for call, gap in pairs(OUTSIDE) do
    pending(('%s = NULL: %s (%s)'):format(call, gap[1], gap[2]))
  end
end)
