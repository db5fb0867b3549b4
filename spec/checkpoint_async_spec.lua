-- Asynchronous checkpoints (gptlua.checkpoint's writer, engine/ckpt_writer.c):
-- the step makes host copies and a thread writes the files.  The files are
-- the synchronous save's bytes; a process killed while its writer is in the
-- middle of a file leaves the previous checkpoint the latest, loading and
-- verifying; a run resumed from an asynchronous checkpoint ends where the
-- uninterrupted run ends.
local gl = require 'gptlua'
local ckpt = require 'gptlua.checkpoint'
local train = require 'gptlua.train'
local H = require 'support.mpi'
local ffi = gl.ffi

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end
local function read(p) local f = assert(io.open(p, 'rb')); local s = f:read('*a'); f:close(); return s end
local function recipe(over)
  local r = dofile('spec/dist/elastic_recipe.lua')
  r.quiet = true
  for k, v in pairs(over or {}) do r[k] = v end
  return r
end
local function params(t)
  local out = {}
  for _, np in ipairs(t.model:named_parameters()) do out[np[1]] = np[2]:clone() end
  return out
end
local function assert_same_params(a, b)
  for k, v in pairs(a) do assert.equal(0, v:sub(b[k]):abs():max():item(), k) end
end

describe('the checkpoint writer', function()
  it("writes a file's bytes as gl_safetensors_save does, strided and bf16 tensors too", function()
    local dir = H.tmpdir()
    gl.manual_seed(1)
    local t = { a = gl.randn({ 3, 5 }), b = gl.randn({ 4, 6 }):transpose(1, 2), c = gl.randn({ 7 }):to('bfloat16'),
                d = gl.arange(0, 10, 1, { dtype = 'int64' }) }
    ckpt.save_safetensors(dir .. '/sync.safetensors', t)
    local w = ckpt.writer()
    for round = 1, 2 do  -- the second job reuses the first one's staging
      w:add(('%s/async%d.safetensors'):format(dir, round), t)
      w:start({ tmp = dir, final = dir .. '/unused', dir = dir, step = 0, state = {} })
      assert.equal(0, gl.lib.gl_ckpt_writer_wait(w.c))
      local h = ffi.new('uint64_t[1]')
      assert.equal(0, gl.lib.gl_ckpt_writer_checksum(w.c, 0, h))
      assert.equal(ckpt.checksum(dir .. '/sync.safetensors'), string.format('%016x', h[0]):gsub('ULL', ''))
      assert.equal(read(dir .. '/sync.safetensors'), read(('%s/async%d.safetensors'):format(dir, round)))
    end
    w.job = nil   -- (a bare job: nothing to publish)
    w:close()
    os.execute('rm -rf ' .. dir)
  end)

  it('reports a write that fails as one line, and is usable again', function()
    local dir = H.tmpdir()
    local w = ckpt.writer()
    w:add(dir .. '/no/such/dir/x.safetensors', { a = gl.zeros({ 2 }) })
    w:start({ tmp = dir, final = dir .. '/unused', dir = dir, step = 0, state = {} })
    local ok, err = pcall(w.finish, w)
    assert.is_false(ok)
    has(tostring(err), 'gl_ckpt_writer_wait: the checkpoint writer failed: gl_safetensors_save')
    w:add(dir .. '/x.safetensors', { a = gl.zeros({ 2 }) })
    w:start({ tmp = dir, final = dir .. '/unused', dir = dir, step = 0, state = {} })
    assert.equal(0, gl.lib.gl_ckpt_writer_wait(w.c))
    w.job = nil
    w:close()
    os.execute('rm -rf ' .. dir)
  end)
end)

describe('checkpoint_async', function()
  it("writes the synchronous save's bytes, at every step it saves", function()
    local da, ds = H.tmpdir(), H.tmpdir()
    train.main(recipe({ out_dir = da }), { '--checkpoint_async=true' })
    train.main(recipe({ out_dir = ds }), { '--checkpoint_async=false' })
    local la, ls = ckpt.list(da .. '/elastic/checkpoints'), ckpt.list(ds .. '/elastic/checkpoints')
    assert.same({ 2, 4, 6, 8 }, { la[1].step, la[2].step, la[3].step, la[4].step })
    assert.equal(#ls, #la)
    for i, c in ipairs(la) do
      for _, f in ipairs({ 'model.safetensors', 'optim.safetensors' }) do
        assert.equal(read(ls[i].path .. '/' .. f), read(c.path .. '/' .. f), c.path .. '/' .. f)
      end
      local a, s = ckpt.load(c.path).state, ckpt.load(ls[i].path).state
      assert.same(s.files, a.files)
      assert.same({ s.step, s.rng, s.data, s.history, s.opt_step }, { a.step, a.rng, a.data, a.history, a.opt_step })
    end
    os.execute('rm -rf ' .. da .. ' ' .. ds)
  end)

  it("fsdp on 2 ranks: every rank's background files are the synchronous save's bytes", function()
    local da, ds = H.tmpdir(), H.tmpdir()
    for _, run in ipairs({ { da, 'true' }, { ds, 'false' } }) do
      local out, rc = H.sh(('%s -n 2 spec/dist/elastic_recipe.lua --out_dir=%s --dist=fsdp --checkpoint_async=%s')
        :format(H.EXE, run[1], run[2]), 120)
      assert.equal(0, rc, out)
    end
    for _, step in ipairs({ 2, 4, 6, 8 }) do
      local sub = ('/elastic/checkpoints/step_%07d'):format(step)
      local pa, ps = da .. sub, ds .. sub
      local files = ckpt.load(pa).state.files
      assert.same(ckpt.load(ps).state.files, files)
      for _, f in ipairs({ 'model.safetensors', 'optim.safetensors', 'optim.rank00000.safetensors',
                           'optim.rank00001.safetensors' }) do
        assert.is_not_nil(files[f], f)
        assert.equal(read(ps .. '/' .. f), read(pa .. '/' .. f), pa .. '/' .. f)
      end
      local left = io.popen('ls -a ' .. pa):read('*a')
      assert.is_nil(left:find('written', 1, true), left)   -- the ranks' markers are gone
    end
    os.execute('rm -rf ' .. da .. ' ' .. ds)
  end)

  it('a process killed while its writer is mid-file leaves the previous checkpoint, and the resumed run '
    .. 'ends where the uninterrupted one does', function()
    local dir, full_dir = H.tmpdir(), H.tmpdir()
    -- the writer's second job (step 4's checkpoint) kills the process after its first tensor
    local out, rc = H.sh(('env GPTLUA_TEST_CKPT_KILL=2 %s spec/dist/elastic_recipe.lua --out_dir=%s')
      :format(H.EXE, dir), 120)
    assert.equal(137, rc, out)   -- SIGKILL
    local cdir = dir .. '/elastic/checkpoints'
    local list = ckpt.list(cdir)
    assert.equal(1, #list, out)
    assert.equal(2, list[1].step)
    assert.equal(2, ckpt.load(list[1].path).state.step)   -- verifies every checksum
    local left = io.popen('ls -a ' .. cdir):read('*a')
    has(left, 'step_0000004.tmp')
    -- resumed: the temporary directory goes, and training ends on the uninterrupted run's parameters
    local _, resumed = train.main(recipe({ out_dir = dir }), { '--resume' })
    assert.equal(8, resumed.step)
    left = io.popen('ls -a ' .. cdir):read('*a')
    assert.is_nil(left:find('tmp', 1, true), left)
    local _, full = train.main(recipe({ out_dir = full_dir }), {})
    assert_same_params(params(full), params(resumed))
    os.execute('rm -rf ' .. dir .. ' ' .. full_dir)
  end)
end)

-- On a GPU the staging is page-locked memory, filled by copies on the copy
-- stream that the compute stream waits for; the thread waits for them with
-- an event.  Runs on a GPU and under the CUDA simulator (build/sim/gptlua).
describe('the checkpoint writer on a GPU #cuda', function()
  local twin = require 'support.cuda_twin'
  local gpu_it = twin.gpu_it(it, pending)

  gpu_it("writes device tensors' bytes as gl_safetensors_save does, from pinned staging it frees at close", function()
    local dir = H.tmpdir()
    gl.manual_seed(2)
    local t = { a = gl.randn({ 3, 5 }):to(twin.DEV), b = gl.randn({ 4, 6 }):to(twin.DEV):transpose(1, 2),
                c = gl.randn({ 7 }):to('bfloat16'):to(twin.DEV), d = gl.arange(0, 10, 1, { dtype = 'int64' }):to(twin.DEV),
                e = gl.randn({ 2, 2 }) }
    ckpt.save_safetensors(dir .. '/sync.safetensors', t)
    local pinned = tonumber(gl.lib.gl_cuda_pinned_bytes())
    local w = ckpt.writer()
    local a = t.a:clone()
    for round = 1, 2 do
      w:add(('%s/async%d.safetensors'):format(dir, round), t)
      w:start({ tmp = dir, final = dir .. '/unused', dir = dir, step = 0, state = {} })
      if round == 1 then assert.is_true(tonumber(gl.lib.gl_cuda_pinned_bytes()) > pinned) end
      -- the sources change at once; the files hold the values at add()
      t.a:add_(1)
      assert.equal(0, gl.lib.gl_ckpt_writer_wait(w.c))
      t.a:copy_(a)
      assert.equal(read(dir .. '/sync.safetensors'), read(('%s/async%d.safetensors'):format(dir, round)))
    end
    w.job = nil
    w:close()
    require('gptlua.cuda').synchronize()   -- the copies' holds on the staging are dropped
    assert.equal(pinned, tonumber(gl.lib.gl_cuda_pinned_bytes()))
    os.execute('rm -rf ' .. dir)
  end)

  gpu_it("a training run's background checkpoints are its synchronous ones' bytes", function()
    local da, ds = H.tmpdir(), H.tmpdir()
    local over = { device = 'cuda', max_iters = 4, log_interval = 0 }
    over.out_dir = da
    train.main(recipe(over), { '--checkpoint_async=true' })
    over.out_dir = ds
    train.main(recipe(over), { '--checkpoint_async=false' })
    for _, step in ipairs({ 2, 4 }) do
      for _, f in ipairs({ 'model.safetensors', 'optim.safetensors' }) do
        local p = ('/elastic/checkpoints/step_%07d/%s'):format(step, f)
        assert.equal(read(ds .. p), read(da .. p), p)
      end
    end
    os.execute('rm -rf ' .. da .. ' ' .. ds)
  end)
end)
