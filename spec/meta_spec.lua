-- The meta device (gptlua.meta, engine/alloc.c) and the fake world
-- (gptlua.dist.fake): tensors with a size and no data, charged to the
-- allocator's meta twin exactly as the real allocator charges them; ops
-- that run their Lua path with no kernel; reads refused by name; a fake
-- world whose collectives check sizes for N ranks, count the bytes one
-- rank sends per group, and refuse what they do not know.
local gl = require 'gptlua'
local meta = require 'gptlua.meta'
local fake = require 'gptlua.dist.fake'

local function settled()
  for _ = 1, 3 do collectgarbage() end
  return gl.memory_stats()
end

local function err(f) local ok, e = pcall(f); assert.is_false(ok, 'expected an error'); return tostring(e) end

describe('meta device', function()
  it('charges the size classes and caching of the real allocator, without memory', function()
    -- the same program, for real and on the meta device
    local function program()
      local out = {}
      for _, n in ipairs({ 1, 511, 513, 4000, 2 ^ 20 + 1, 3 * 2 ^ 21 + 5 }) do
        local t = gl.empty({ n }, { dtype = 'uint8' })
        out[#out + 1] = gl.memory_stats().allocated
        t:free()
      end
      local a = gl.randn({ 64, 32 })
      local b = (a:matmul(a:t()) + 1):sum()
      local kept = gl.zeros({ 300, 300 })
      a:free(); b:free()
      local st = gl.memory_stats()
      out[#out + 1] = st.allocated; out[#out + 1] = st.peak; out[#out + 1] = st.cache_hits
      out[#out + 1] = st.n_live
      kept:free()
      return out
    end
    local base = settled()
    gl.empty_cache()
    gl.reset_peak_memory()
    local real = program()
    for i = 1, 8 do real[i] = real[i] - base.allocated end  -- sizes, allocated, peak: over what was there
    real[9], real[10] = real[9] - base.cache_hits, real[10] - base.n_live
    local rss0 = tonumber(io.open('/proc/self/statm'):read('*l'):match('^%d+%s+(%d+)'))
    local planned = meta.run(function()
      local out = program()
      -- (the twin started empty)
      return out
    end)
    assert.same(real, planned)
    -- a plan of 40 GB: nothing real
    local big = meta.run(function()
      local t = gl.empty({ 10 * 2 ^ 30 }, { dtype = 'float32' })
      local u = t * 2
      return gl.memory_stats().peak
    end)
    assert.equal(80 * 2 ^ 30, big)
    local rss1 = tonumber(io.open('/proc/self/statm'):read('*l'):match('^%d+%s+(%d+)'))
    assert.is_true((rss1 - rss0) * 4096 < 64 * 2 ^ 20, 'resident size grew by ' .. (rss1 - rss0) * 4096)
  end)

  it('runs autograd, views and scopes on meta tensors as it does on real ones', function()
    local function program()
      local w = gl.randn({ 16, 8 }):requires_grad_()
      local x = gl.randn({ 4, 16 })
      gl.scope(function()
        local y = (x:matmul(w)):relu():sum()
        y:backward()
      end)
      local st = gl.memory_stats()
      return { w.grad.shape[1], w.grad.shape[2], st.allocated, st.peak, st.n_live }
    end
    local base = settled()
    gl.reset_peak_memory()
    local real = program()
    real[3], real[4], real[5] = real[3] - base.allocated, real[4] - base.allocated, real[5] - base.n_live
    assert.same(real, meta.run(program))
  end)

  it('refuses to read a meta tensor, naming it; the planner reads zeros', function()
    local e = err(function() meta.run(function() return gl.zeros({ 3, 4 }):sum():item() end) end)
    assert.truthy(e:find('gl_get_item: tensor is a meta tensor {} float32 (a shape without data): it has no values to read',
      1, true), e)
    for what, f in pairs({
      tolist = function(t) return t:tolist() end,
      get = function(t) return t:get(1, 1) end,
      tostring = function(t) return tostring(t) end,
      data_ptr = function(t) return t:data_ptr() end,
      norm = function(t) t.grad = gl.ones({ 3, 4 }); return require('gptlua.optim').clip_grad_norm({ t }, 0) end,
      save = function(t) return require('gptlua.checkpoint').save_safetensors('/nonexistent/meta.safetensors', { w = t }) end,
    }) do
      e = err(function() meta.run(function() return f(gl.ones({ 3, 4 })) end) end)
      assert.truthy(e:find('is a meta tensor {3,4} float32 (a shape without data)', 1, true) or
        e:find('is a meta tensor {} float32', 1, true), what .. ': ' .. e)
    end
    assert.equal(0, meta.run(function() return gl.ones({ 3 }):sum():item() end, { reads = 'zeros' }))
    -- a meta tensor outside its plan
    local t = meta.run(function() return gl.ones({ 2, 2 }) end)
    e = err(function() return t + 1 end)
    assert.truthy(e:find('is a meta tensor {2,2} float32 (a shape without data), usable only while planning', 1, true), e)
    assert.is_true(meta.is_meta(t))
    t = nil
    -- paused: real tensors with values, charged to the plan
    local v, peak = meta.run(function()
      local r = meta.paused(function() return gl.tensor({ 1, 2, 3 }) end)
      return meta.paused(function() return r:sum():item() end), gl.memory_stats().peak
    end)
    assert.equal(6, v)
    assert.equal(1024, peak)  -- the tensor and its sum: a 512-byte block each
    assert.truthy(err(function() meta.run(function() end, { reads = 'maybe' }) end)
      :find("meta.run: reads expected 'error' or 'zeros', got maybe", 1, true))
  end)
end)

describe('fake world', function()
  it('returns at once, with the sizes checked for N ranks, and counts the bytes per group', function()
    local w = fake.world(4, 1)
    local r = meta.run(function()
      local t = gl.zeros({ 8 })                       -- 32 bytes
      w:all_reduce(t)                                 -- 2*3/4*32 = 48
      local o = gl.zeros({ 2 })
      w:reduce_scatter(o, t)                          -- 3/4*32 = 24
      local h = w:all_gather_async(t, o)              -- 24
      assert.is_false(h:test())   -- (completes at wait: the latest a real one can)
      h:wait()
      w:broadcast(t, 1)                               -- root: 32
      w:broadcast(t, 0)                               -- not root: 0
      w:all_to_all(gl.zeros({ 8 }), t)                -- all but the own quarter: 24
      w:barrier()
      local s = w:split(0, 1, { size = 2, rank = 1 })
      s:all_reduce(gl.zeros({ 4 }, { dtype = 'bfloat16' }))  -- 2*1/2*8 = 8
      return s
    end)
    assert.equal(2, r.size); assert.equal(1, r.rank)
    local g = fake.traffic(w)
    assert.same({ size = 4, bytes = 48 + 24 + 24 + 32 + 24, calls = 7 }, { size = g.world.size, bytes = g.world.bytes,
      calls = g.world.calls })
    assert.same({ bytes = 48, calls = 1 }, g.world.by.all_reduce)
    assert.same({ bytes = 0, calls = 1 }, g.world.by.barrier)
    assert.equal(8, g['world.1[0]'].bytes)
    fake.reset(w)
    assert.equal(0, fake.traffic(w).world.bytes)
  end)

  it('fails loudly on what it cannot play', function()
    local w = fake.world(4, 1)
    assert.truthy(err(function() w:split(1) end)
      :find('split: a fake world sees one rank only: pass the new group as split(color, key, {size =, rank =})', 1, true))
    assert.truthy(err(function() w:reduce_scatter(gl.zeros({ 3 }), gl.zeros({ 8 })) end)
      :find("reduce_scatter: recv expected 2 elements (send's numel / ranks), got 3", 1, true))
    assert.truthy(err(function() w:all_gather(gl.zeros({ 6 }), gl.zeros({ 2 })) end)
      :find('all_gather: a tensor of 6 elements does not split evenly over 4 ranks', 1, true))
    assert.truthy(err(function() return w.gl_comm_handle end)
      :find("fake world: a Comm has no field 'gl_comm_handle'", 1, true))
    -- a collective added to Comm that the fake world was not taught
    local dist = require 'gptlua.dist'
    dist.Comm.all_reduce_twice = function(self, t) return dist.Comm.run_named(self, 'all_reduce_twice', t) end
    local run_named = function(self, name, t)
      return self.fake.run(self, name, { send = t, recv = t, result = t })
    end
    dist.Comm.run_named = run_named
    local e = err(function() w:all_reduce_twice(gl.zeros({ 4 })) end)
    dist.Comm.all_reduce_twice, dist.Comm.run_named = nil, nil
    assert.truthy(e:find("fake world: collective 'all_reduce_twice' is unknown to gptlua.dist.fake", 1, true), e)
    assert.truthy(err(function() fake.world(0) end):find('fake.world: size expected a positive integer, got 0', 1, true))
    assert.truthy(err(function() fake.world(4, 4) end):find('fake.world: rank expected an integer in 0..3, got 4', 1, true))
  end)
end)
