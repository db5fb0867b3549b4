-- The step block's entry points (gptlua.step_block, engine/ops_step.c,
-- engine/cpu/optim.c, kernels/optim.cu, kernels/reduce.cu) on the CPU and
-- the GPU (or the simulator, also in its race mode: make test's RACE_SPECS):
-- the sum of squares, norm, clip and skip, AdamW and Muon's momentum and
-- axpy from the block, and their argument checks.  The trainer's use of
-- them, graphed against op by op: spec/cuda_train_graph_optim_spec.lua.
local gl = require 'gptlua'
local ffi = require 'ffi'
local twin = require 'support.cuda_twin'
local HAVE_GPU, pair, compare = twin.HAVE_GPU, twin.pair, twin.compare
local lib = gl.lib

local gpu_it = twin.gpu_it(it, pending)
local function K(rc) if rc ~= 0 then error(ffi.string(lib.gl_last_error()), 2) end end
local function err(f)
  local ok, e = pcall(f)
  assert.is_false(ok, 'expected an error')
  return tostring(e)
end

describe('the step block: AdamW and the norm from the block #cuda', function()
  gpu_it('the step block on the CPU and the GPU: sum of squares, norm, clip, skip, AdamW', function()
    local sizes = { 4096, 1, 4097, 33 }
    local k = #sizes
    for _, gdt in ipairs({ 'float32', 'bfloat16' }) do
      for _, case in ipairs({ { 'clipped', 0.5, 1 }, { 'not clipped', 0, 1 }, { 'skipped', 0.5, 0 / 0 } }) do
        local ins = {}
        for i, n in ipairs(sizes) do
          ins['p' .. i], ins['g' .. i] = pair({ n }), pair({ n }, { dtype = gdt })
          ins['m' .. i], ins['v' .. i] = pair({ n }), pair({ n }, { dist = { 0, 1 } })
        end
        compare(ins, function(S)
          local block = gl.zeros({ 30 }, { dtype = 'float64' })
          local host = S.gpu and gl.empty_pinned({ 30 }, { dtype = 'float64' }) or gl.zeros({ 30 }, { dtype = 'float64' })
          local h = ffi.cast('double *', host:data_ptr())
          for j = 0, 29 do h[j] = 0 end
          h[lib.GL_STEP_MAX_NORM], h[8], h[9] = case[2], case[3], 2.5  -- two micro-step losses
          for grp = 0, 1 do  -- two groups' AdamW slots at 10 and 18
            local s, lr, wd, b1, b2, t = 10 + 8 * grp, grp == 0 and 1e-3 or 3e-3, grp == 0 and 0.1 or 0, 0.9, 0.95, 3
            local v = { lr * wd, lr / (1 - b1 ^ t), b1, b2, 1 - b1, 1 - b2, 1e-8, 1 / (1 - b2 ^ t) }
            for j = 1, 8 do h[s + j - 1] = v[j] end
          end
          block = block:to(S.device)
          K(lib.gl_step_block_copy(block.c, host.c))
          local P, G, M, V = ffi.new('gl_tensor *[?]', k), ffi.new('const gl_tensor *[?]', k),
                             ffi.new('gl_tensor *[?]', k), ffi.new('gl_tensor *[?]', k)
          local O, slots = ffi.new('gl_tensor *[?]', k), ffi.new('int64_t[?]', k)
          local res, outs = {}, {}
          for i = 1, k do
            local p, m, v = S['p' .. i]:clone(), S['m' .. i]:clone(), S['v' .. i]:clone()
            P[i - 1], G[i - 1], M[i - 1], V[i - 1] = p.c, S['g' .. i].c, m.c, v.c
            slots[i - 1] = i % 2 == 0 and 10 or 18
            if i % 2 == 1 then outs[i] = S.out({ sizes[i] }, i == 1 and 'float32' or 'bfloat16'); O[i - 1] = outs[i].c end
            res[#res + 1], res[#res + 2], res[#res + 3] = p, m, v
          end
          K(lib.gl_step_sumsq(block.c, k, G))
          K(lib.gl_step_finalize(block.c, 8, 2))
          K(lib.gl_adamw_update_block(k, P, G, M, V, O, block.c, slots))
          K(lib.gl_step_block_copy(host.c, block.c))
          if S.gpu then require('gptlua.cuda').synchronize('cuda:0') end
          local hv = {}
          for j = 0, 4 do hv[j] = h[j] end
          if case[1] == 'skipped' then  -- nothing written
            assert.are.equal(1, hv[lib.GL_STEP_SKIP])
            for i = 1, k do
              assert.are.equal(0, res[3 * i - 2]:max_abs_diff(S['p' .. i]), 'parameter ' .. i .. ' untouched')
              assert.are.equal(0, res[3 * i - 1]:max_abs_diff(S['m' .. i]), 'm ' .. i .. ' untouched')
            end
          else
            assert.are.equal(0, hv[lib.GL_STEP_SKIP])
            assert.are.equal(1.75, hv[lib.GL_STEP_LOSS])
            assert.are.equal(math.sqrt(hv[lib.GL_STEP_SUMSQ]), hv[lib.GL_STEP_NORM])
            local want = case[2] > 0 and case[2] / (hv[lib.GL_STEP_NORM] + 1e-6) or 1
            assert.are.equal(want, hv[lib.GL_STEP_CLIP_SCALE])
          end
          local rounded = 0  -- each output holds its parameter, rounded (skipped: not written)
          for i, o in pairs(case[1] == 'skipped' and {} or outs) do
            rounded = math.max(rounded, o:to('float64'):max_abs_diff(res[3 * i - 2]:to(o.dtype):to('float64')))
          end
          local skipped = case[1] == 'skipped'  -- (its sum and scale are NaN: compared as skipped above)
          return rounded, skipped and 0 or hv[lib.GL_STEP_SUMSQ], skipped and 0 or hv[lib.GL_STEP_CLIP_SCALE], unpack(res)
        end, 'float32', ('step block, %s grads, %s'):format(gdt, case[1]),
        -- (the block's AdamW takes float32 parameters only: the twin is the reference; the sum of squares of 8227)
        { ref64 = false, n = { 1, 8227 } })
      end
    end
  end)
end)

describe("the step block's Muon kernels #cuda", function()
  gpu_it('momentum and axpy from the block on the CPU and the GPU, clipped and skipped', function()
    for _, gdt in ipairs({ 'float32', 'bfloat16' }) do
      for _, skip in ipairs({ 0, 1 }) do
        local ins = { buf = pair({ 4097 }), g = pair({ 4097 }, { dtype = gdt }), y = pair({ 4097 }), x = pair({ 4097 }) }
        compare(ins, function(S)
          local blk = gl.zeros({ 16 }, { dtype = 'float64' })
          local h = ffi.cast('double *', blk:data_ptr())
          h[lib.GL_STEP_SKIP], h[lib.GL_STEP_CLIP_SCALE], h[8], h[9], h[10] = skip, 0.37, 0.9, 1 - 0.9, -0.02
          blk = blk:to(S.device)
          local buf, y, out = S.buf:clone(), S.y:clone(), S.out({ 4097 })
          for nesterov = 0, 1 do K(lib.gl_momentum_update_block(out.c, buf.c, S.g.c, blk.c, 8, nesterov)) end
          K(lib.gl_axpy_block(y.c, S.x.c, blk.c, 10))
          if skip == 1 then  -- buf and y kept; out zeroed (the update temporary Newton-Schulz reads)
            assert.are.equal(0, buf:max_abs_diff(S.buf))
            assert.are.equal(0, y:max_abs_diff(S.y))
            assert.are.equal(0, out:to('cpu'):abs():max():item())
            return buf, y, out
          end
          return buf, y, out
        end, 'float32', ('Muon block kernels, %s grads, skip %d'):format(gdt, skip),
        { ref64 = false, n = 2 })  -- (float32 and bfloat16 grads only: the twin is the reference)
      end
    end
  end)
end)

describe('the step block: argument checks', function()
  local function block(n, dtype) return gl.zeros({ n }, { dtype = dtype or 'float64' }) end
  local function adamw_args(b, slot, pdt)
    local p, g, m, v = gl.zeros({ 5 }, { dtype = pdt }), gl.zeros({ 5 }), gl.zeros({ 5 }), gl.zeros({ 5 })
    local keep = { p, g, m, v }
    return keep, ffi.new('gl_tensor *[1]', { p.c }), ffi.new('const gl_tensor *[1]', { g.c }),
      ffi.new('gl_tensor *[1]', { m.c }), ffi.new('gl_tensor *[1]', { v.c }), ffi.new('int64_t[1]', { slot })
  end

  it('refuses a block of another dtype, too small, or not contiguous', function()
    assert.matches('gl_step_finalize: block has dtype float32, expected float64 %(the step block%)',
      err(function() K(lib.gl_step_finalize(block(16, 'float32').c, 8, 1)) end))
    assert.matches('gl_step_finalize: block has 4 elements, expected at least 8 %(GL_STEP_HEADER%)',
      err(function() K(lib.gl_step_finalize(block(4).c, 8, 1)) end))
    local strided = gl.zeros({ 16, 2 }, { dtype = 'float64' }):select(2, 1)
    assert.matches('gl_step_sumsq: block is not contiguous, expected a contiguous float64 tensor',
      err(function() K(lib.gl_step_sumsq(strided.c, 0, nil)) end))
  end)

  it('refuses slots outside the block', function()
    assert.matches('gl_step_finalize: loss_at is 7, expected 8 <= loss_at <= 15 %(1 slots in a block of 16%)',
      err(function() K(lib.gl_step_finalize(block(16).c, 7, 1)) end))
    assert.matches('gl_step_finalize: nloss is 0, expected >= 1',
      err(function() K(lib.gl_step_finalize(block(16).c, 8, 0)) end))
    local b = block(16)
    local keep, P, G, M, V, S = adamw_args(b, 9)
    assert.matches('gl_adamw_update_block: slots%[0%] is 9, expected 8 <= slots%[0%] <= 8 %(8 slots in a block of 16%)',
      err(function() K(lib.gl_adamw_update_block(1, P, G, M, V, nil, b.c, S)) end))
    assert.is_truthy(keep)
  end)

  it('refuses parameters that are not float32, and a pageable host block on a GPU', function()
    local b = block(16)
    local keep, P, G, M, V, S = adamw_args(b, 8, 'float64')
    assert.matches('gl_adamw_update_block: params%[0%] has dtype float64, expected float32',
      err(function() K(lib.gl_adamw_update_block(1, P, G, M, V, nil, b.c, S)) end))
    assert.is_truthy(keep)
    -- on the CPU the copy is a plain one; the numels must agree
    assert.matches('gl_step_block_copy: src has 8 elements, expected 16 %(the numel of dst%)',
      err(function() K(lib.gl_step_block_copy(block(16).c, block(8).c)) end))
    if HAVE_GPU then
      local d = gl.zeros({ 16 }, { dtype = 'float64', device = 'cuda:0' })
      assert.matches('gl_step_block_copy: src is in pageable host memory, expected pinned memory',
        err(function() K(lib.gl_step_block_copy(d.c, block(16).c)) end))
      local keep2, P2, G2, M2, V2, S2 = adamw_args(b, 8)
      assert.matches('gl_adamw_update_block: block is on cuda:0 and params%[0%] on cpu',
        err(function() K(lib.gl_adamw_update_block(1, P2, G2, M2, V2, nil, d.c, S2)) end))
      assert.is_truthy(keep2)
    end
  end)

  it("refuses Muon's block kernels' bad arguments", function()
    local b, y, x = block(16), gl.zeros({ 5 }), gl.zeros({ 6 })
    assert.matches('gl_axpy_block: x has 6 elements, expected 5 %(the numel of y%)',
      err(function() K(lib.gl_axpy_block(y.c, x.c, b.c, 8)) end))
    assert.matches('gl_axpy_block: slot is 16, expected 8 <= slot <= 15',
      err(function() K(lib.gl_axpy_block(y.c, y.c, b.c, 16)) end))
    local buf, g64 = gl.zeros({ 5 }), gl.zeros({ 5 }, { dtype = 'float64' })
    assert.matches('gl_momentum_update_block: grad has dtype float64, expected float32 or bfloat16',
      err(function() K(lib.gl_momentum_update_block(buf.c, buf.c, g64.c, b.c, 8, 1)) end))
    assert.matches('gl_momentum_update_block: slot is 15, expected 8 <= slot <= 14',
      err(function() K(lib.gl_momentum_update_block(buf.c, buf.c, buf.c, b.c, 15, 1)) end))
    assert.matches('gl_momentum_update_block: block has dtype float32, expected float64',
      err(function() K(lib.gl_momentum_update_block(buf.c, buf.c, buf.c, block(16, 'float32').c, 8, 1)) end))
  end)

  it('updates like gl_adamw_update_multi on the CPU when the rates agree', function()
    local b = block(16)
    local h = ffi.cast('double *', b:data_ptr())
    local lr, wd, b1, b2, eps, t = 1e-2, 0.1, 0.9, 0.95, 1e-8, 1
    local bc1, bc2 = 1 - b1 ^ t, 1 - b2 ^ t
    local v = { lr * wd, lr / bc1, b1, b2, 1 - b1, 1 - b2, eps, 1 / bc2 }
    for j = 1, 8 do h[7 + j] = v[j] end
    h[lib.GL_STEP_CLIP_SCALE] = 1
    local p1, g = gl.randn({ 300 }, { seed = 1 }), gl.randn({ 300 }, { seed = 2 })
    local p2, m1, v1, m2, v2 = p1:clone(), gl.zeros({ 300 }), gl.zeros({ 300 }), gl.zeros({ 300 }), gl.zeros({ 300 })
    K(lib.gl_adamw_update_block(1, ffi.new('gl_tensor *[1]', { p1.c }), ffi.new('const gl_tensor *[1]', { g.c }),
      ffi.new('gl_tensor *[1]', { m1.c }), ffi.new('gl_tensor *[1]', { v1.c }), nil, b.c, ffi.new('int64_t[1]', { 8 })))
    K(lib.gl_adamw_update_multi(1, ffi.new('gl_tensor *[1]', { p2.c }), ffi.new('const gl_tensor *[1]', { g.c }),
      ffi.new('gl_tensor *[1]', { m2.c }), ffi.new('gl_tensor *[1]', { v2.c }), nil, ffi.new('double[1]', { lr }),
      ffi.new('double[1]', { wd }), b1, b2, eps, t))
    assert.are.equal(0, p1:max_abs_diff(p2))
    assert.are.equal(0, v1:max_abs_diff(v2))
    -- the skip flag: nothing written
    h[lib.GL_STEP_SKIP] = 1
    local before = p1:clone()
    K(lib.gl_adamw_update_block(1, ffi.new('gl_tensor *[1]', { p1.c }), ffi.new('const gl_tensor *[1]', { g.c }),
      ffi.new('gl_tensor *[1]', { m1.c }), ffi.new('gl_tensor *[1]', { v1.c }), nil, b.c, ffi.new('int64_t[1]', { 8 })))
    assert.are.equal(0, p1:max_abs_diff(before))
  end)
end)
