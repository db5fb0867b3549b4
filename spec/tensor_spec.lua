local gl = require 'gptlua'

describe('tensor creation', function()
  it('makes zeros, ones, full and arange', function()
    assert.same({ { 0, 0 }, { 0, 0 } }, gl.zeros({ 2, 2 }):totable())
    assert.same({ 1, 1, 1 }, gl.ones({ 3 }):totable())
    assert.same({ 7.5, 7.5 }, gl.full({ 2 }, 7.5, { dtype = 'float64' }):totable())
    assert.same({ 0, 1, 2, 3 }, gl.arange(4):totable())
    assert.same({ 2, 4, 6 }, gl.arange(2, 8, 2):totable())
  end)
  it('round-trips nested tables in every dtype', function()
    for _, dt in ipairs({ 'float32', 'float64', 'bfloat16', 'float16', 'int32', 'int64', 'uint16', 'uint8' }) do
      local t = gl.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, { dtype = dt })
      assert.equal(dt, t.dtype)
      assert.same({ 2, 3 }, t.shape)
      assert.same({ { 1, 2, 3 }, { 4, 5, 6 } }, t:totable())
    end
    assert.same({ 1, 0, 1 }, gl.tensor({ true, false, 5 }, { dtype = 'bool' }):totable())
  end)
  it('rounds bfloat16 to nearest even', function()
    local t = gl.tensor({ 1.00390625, 1.01171875, 3.14159 }, { dtype = 'bfloat16' })
    assert.same({ 1.0, 1.015625, 3.140625 }, t:totable())
  end)
  it('draws the same random numbers for the same seed and shape', function()
    local a = gl.randn({ 4, 5 }, { seed = 42 })
    local b = gl.randn({ 4, 5 }, { seed = 42, dtype = 'float64' })
    assert.is_true(a:max_abs_diff(b) < 1e-6)
    gl.manual_seed(7); local c = gl.rand({ 3 }); local d = gl.rand({ 3 })
    gl.manual_seed(7); local e = gl.rand({ 6 })
    assert.same(c:totable(), e:narrow(1, 1, 3):totable())
    assert.same(d:totable(), e:narrow(1, 4, 3):totable())
  end)
  it('has roughly standard normal statistics', function()
    local x = gl.randn({ 20000 }, { seed = 1, dtype = 'float64' }):tolist()
    local s, s2 = 0, 0
    for _, v in ipairs(x) do s = s + v; s2 = s2 + v * v end
    local mean, var = s / #x, s2 / #x - (s / #x) ^ 2
    assert.is_true(math.abs(mean) < 0.03, 'mean ' .. mean)
    assert.is_true(math.abs(var - 1) < 0.05, 'var ' .. var)
    local u = gl.rand({ 10000 }, { seed = 3 }):tolist()
    for _, v in ipairs(u) do assert.is_true(v >= 0 and v < 1) end
  end)
end)

describe('views', function()
  local t
  before_each(function() t = gl.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }) end)
  it('transpose, permute and t share storage', function()
    assert.same({ { 1, 4 }, { 2, 5 }, { 3, 6 } }, t:t():totable())
    assert.is_false(t:t():is_contiguous())
    local p = gl.arange(24, { dtype = 'float32' }):view(2, 3, 4):permute(3, 1, 2)
    assert.same({ 4, 2, 3 }, p.shape)
    assert.equal(13, p:get(2, 2, 1))
    assert.equal(1, p:get(2, 1, 1))
  end)
  it('view, reshape, -1 inference and the error for a bad count', function()
    assert.same({ 3, 2 }, t:view(3, 2).shape)
    assert.same({ 6 }, t:view(-1).shape)
    assert.same({ { 1, 4, 2 }, { 5, 3, 6 } }, t:t():reshape(2, 3):totable())
    assert.has_error(function() t:view(4, 4) end, 'view: shape {4,4} has 16 elements, tensor has 6')
  end)
  it('narrow, select, expand, squeeze, unsqueeze', function()
    assert.same({ { 2, 3 }, { 5, 6 } }, t:narrow(2, 2, 2):totable())
    assert.same({ 4, 5, 6 }, t:select(1, 2):totable())
    assert.same({ 3, 6 }, t:select(2, -1):totable())
    local e = gl.tensor({ 1, 2 }):view(2, 1):expand(2, 3)
    assert.same({ { 1, 1, 1 }, { 2, 2, 2 } }, e:totable())
    assert.same({ 1, 2, 3 }, t:unsqueeze(1).shape)
    assert.same({ 2, 3, 1 }, t:unsqueeze(-1).shape)
    assert.same({ 2, 3 }, t:unsqueeze(1):squeeze().shape)
    assert.same({ 1, 3 }, t:narrow(1, 1, 1).shape)
  end)
  it('view_dtype reinterprets the same bytes, bounds-checked', function()
    local f = gl.tensor({ 1.0, -2.0 }, { dtype = 'float32' })
    local i = f:view_dtype('int32', { 2 })
    assert.same({ 1065353216, -1073741824 }, i:totable())
    local b = f:view_dtype('uint8', { 8 })
    assert.equal(128, b:get(3)); assert.equal(63, b:get(4))
    assert.has_error(function() f:view_dtype('float64', { 2 }) end,
      'gl_view_dtype: 2 elements of float64 need 16 bytes, 8 are available')
    assert.has_error(function() gl.empty_pinned({ 2 }) end)
  end)
  it('contiguous copies strided data and clone is independent', function()
    local c = t:t():contiguous()
    assert.is_true(c:is_contiguous())
    assert.same({ { 1, 4 }, { 2, 5 }, { 3, 6 } }, c:totable())
    local k = t:clone(); k:set(99, 1, 1)
    assert.equal(1, t:get(1, 1))
  end)
  it('copy_ converts dtypes and broadcasts', function()
    local d = gl.zeros({ 2, 3 }, { dtype = 'float64' })
    d:copy_(gl.tensor({ 1, 2, 3 }, { dtype = 'int32' }))
    assert.same({ { 1, 2, 3 }, { 1, 2, 3 } }, d:totable())
    assert.equal('float64', d:to('float32'):to('float64').dtype)
  end)
end)

describe('element access and printing', function()
  it('gets, sets and reads items', function()
    local t = gl.zeros({ 2, 2 })
    t:set(3.5, 2, 1)
    assert.equal(3.5, t:get(2, 1))
    assert.equal(3.5, t:get(-1, 1))
    assert.equal(4, gl.tensor({ 4 }):item())
  end)
  it('prints shape, dtype and values, eliding large tensors', function()
    local s = tostring(gl.tensor({ { 1, 2 }, { 3, 4 } }))
    assert.truthy(s:find('1.0000', 1, true))
    assert.truthy(s:find('shape={2,2}', 1, true))
    assert.truthy(s:find('dtype=float32', 1, true))
    local big = tostring(gl.zeros({ 100, 100 }))
    assert.truthy(big:find('...', 1, true))
    assert.is_true(#big < 2000)
    assert.truthy(tostring(gl.arange(3)):find('[0, 1, 2]', 1, true))
  end)
end)

describe('memory', function()
  it('reuses cached blocks: a tight create/drop loop runs at steady memory', function()
    collectgarbage(); collectgarbage()
    for i = 1, 50 do local x = gl.empty({ 64, 64 }); x:free() end
    local before = gl.memory_stats()
    for i = 1, 2000 do local x = gl.empty({ 64, 64 }); x:free() end
    local after = gl.memory_stats()
    assert.equal(before.reserved, after.reserved)
    assert.equal(before.allocated, after.allocated)
    assert.is_true(after.cache_hits - before.cache_hits >= 2000)
  end)
  it('stays bounded when the GC frees tensors', function()
    collectgarbage(); collectgarbage()
    local r0 = gl.memory_stats().reserved
    for i = 1, 3000 do local x = gl.zeros({ 256 }) end
    collectgarbage(); collectgarbage()
    local st = gl.memory_stats()
    assert.is_true(st.reserved - r0 < 4 * 1024 * 1024, 'reserved grew by ' .. (st.reserved - r0))
  end)
  it('frees explicitly and reports use after free', function()
    local x = gl.zeros({ 10 })
    local st0 = gl.memory_stats().allocated
    x:free()
    assert.is_true(gl.memory_stats().allocated < st0)
    local ok, err = pcall(function() x:fill_(1) end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('fill_: tensor was freed', 1, true), err)
  end)
  it('raises "tensor was freed" for every use of a freed tensor, printing included', function()
    local x = gl.ones({ 2, 3 })
    x:free()
    local uses = {
      print = function() return tostring(x) end, add = function() return x + 1 end,
      radd = function() return 2 * x end, neg = function() return -x end, pow = function() return x ^ 2 end,
      method = function() return x:sum() end, get = function() return x:get(1, 1) end,
      view = function() return x:view(6) end, tolist = function() return x:tolist() end,
      operand = function() return gl.ones({ 2, 3 }) + x end,
    }
    for name, use in pairs(uses) do
      local ok, err = pcall(use)
      assert.is_false(ok, name)
      assert.truthy(tostring(err):find('tensor was freed', 1, true), name .. ': ' .. tostring(err))
    end
    -- an op handed it directly: the engine's own check names the op and argument
    local ok, err = pcall(gl.matmul, gl.ones({ 3, 2 }), x)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('gl_matmul: b has been freed', 1, true), tostring(err))
    -- metadata and flags stay: FSDP keeps parameters freed between uses
    assert.same({ 2, 3 }, x:size())
    assert.equal(6, x:numel())
    assert.is_true(x:is_freed())
    x:free()
  end)
  it('guards freed tensors; live ones find methods through the class and rows by number', function()
    local x = gl.ones({ 2 })
    assert.equal(gl.Tensor.sum, x.sum)
    assert.equal(1, x[2])
    -- a tensor the scope released, and an op's temporary released by Tensor.release
    local kept
    gl.scope(function() kept = gl.ones({ 2 }) * 3; return nil end)
    local ok, err = pcall(function() return kept:sum() end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('sum: tensor was freed', 1, true), tostring(err))
    assert.equal(gl.Tensor, getmetatable(kept))  -- still a Tensor to every identity check
    local v = x:view(2)
    gl.Tensor.release(v)
    gl.Tensor.release(v)  -- twice is harmless
    ok, err = pcall(function() return v:tolist() end)
    assert.truthy(not ok and tostring(err):find('tolist: tensor was freed', 1, true), tostring(err))
    assert.same({ 1, 1 }, x:tolist())  -- the base keeps its storage
    -- rebind gives a freed tensor storage again (FSDP's gather), and the guard goes
    gl.Tensor.rebind(v, gl.full({ 2 }, 5):keep().c)
    assert.same({ 5, 5 }, v:tolist())
    assert.equal(gl.Tensor, debug.getmetatable(v))  -- the live metatable again, not Freed
  end)
  it('says which operand of an operator is not a Tensor or a number, and what it was', function()
    local x = gl.ones({ 2 })
    local cases = {
      { function() return x + 'a' end, "add: b must be a Tensor or a number, got the string 'a'" },
      { function() return {} * x end, 'mul: a must be a Tensor or a number, got table' },
      { function() return x - true end, 'sub: b must be a Tensor or a number, got true' },
      { function() return x / nil end, 'div: b must be a Tensor or a number, got nil' },
    }
    for _, c in ipairs(cases) do
      local ok, err = pcall(c[1])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(c[2], 1, true), tostring(err))
      assert.truthy(tostring(err):find('tensor_spec.lua:%d+:'), 'points at the expression: ' .. tostring(err))
    end
    assert.same({ 3, 3 }, (x + 2):tolist())
  end)
  it('counts peak and empties the cache', function()
    gl.reset_peak_memory()
    local p0 = gl.memory_stats().peak
    local x = gl.empty({ 1024, 1024 })
    assert.is_true(gl.memory_stats().peak >= p0 + 4 * 1024 * 1024)
    x:free()
    gl.empty_cache()
    local st = gl.memory_stats()
    assert.equal(st.allocated, st.reserved)
  end)
end)
