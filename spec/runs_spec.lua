-- Runs, checkpoints and progress numbers (issue 15): a new run never mixes
-- with an earlier one of the same name (name-2, --resume, --overwrite),
-- keep_last keeps what was just saved, a checkpoint at every eval, metrics
-- records carry the time and the run's id, the progress numbers count
-- training steps only, the MFU peak is fixed per device, and
-- recipes/sample.lua takes a run directory.
-- checkpoint.mkdir_p makes directories without a child process.
local ffi = require 'ffi'
local cjson = require 'cjson'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local progress = require 'gptlua.progress'

pcall(ffi.cdef, 'int raise(int sig);')

local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end
local function read(p) local f = assert(io.open(p, 'rb')); local s = f:read('*a'); f:close(); return s end
local function records(p)
  local out = {}
  for line in io.lines(p) do out[#out + 1] = cjson.decode(line) end
  return out
end
local function steps(dir)
  local out = {}
  for _, c in ipairs(ckpt.list(dir)) do out[#out + 1] = c.step end
  return out
end

local function recipe(over)
  local r = { name = 't', model = 'gpt2', data = 'char', n_layer = 1, n_head = 2, n_embd = 16, block_size = 16,
              batch_size = 4, max_iters = 4, eval_interval = 0, log_interval = 1, sample_length = 0,
              warmup_iters = 2, lr_decay_iters = 6, quiet = true, device = 'cpu', learning_rate = 3e-3,
              peak_flops = 1e12 }
  for k, v in pairs(over or {}) do r[k] = v end
  return r
end

-- a trainer whose printed lines are collected in t.lines
local function trainer(over, args)
  local t = train.new(recipe(over), args or {})
  t.cfg.quiet = false
  t.lines = {}
  function t:print(...) self.lines[#self.lines + 1] = table.concat({ ... }) end
  return t
end
local function output(t) return table.concat(t.lines, '\n') end

describe('run directories', function()
  it('gives a second run of a name its own directory, and --overwrite replaces the first', function()
    local d = tmpdir()
    local a = trainer({ out_dir = d, max_iters = 2 })
    assert.equal(d .. '/t', a:run().run_dir)
    local metrics_a = read(d .. '/t/metrics.jsonl')
    local b = trainer({ out_dir = d, max_iters = 3, n_embd = 32 })
    assert.equal(d .. '/t-2', b:run().run_dir)
    assert.truthy(output(b):find(('run directory %s/t exists: this run writes %s/t-2 '):format(d, d), 1, true), output(b))
    assert.equal(metrics_a, read(d .. '/t/metrics.jsonl'))
    assert.same({ 2 }, steps(d .. '/t/checkpoints'))
    assert.same({ 3 }, steps(d .. '/t-2/checkpoints'))
    -- every record names its run and its time; two runs, two ids
    local ra, rb = records(d .. '/t/metrics.jsonl'), records(d .. '/t-2/metrics.jsonl')
    for _, r in ipairs(ra) do
      assert.equal(a.run_id, r.run)
      assert.is_true(math.abs(r.time - os.time()) < 600, tostring(r.time))
    end
    assert.equal(b.run_id, rb[1].run)
    assert.truthy(a.run_id:match('^t%-%d%d%d%d%d%d%d%dT%d%d%d%d%d%d%-%x%x%x%x%x%x$'), a.run_id)
    assert.are_not.equal(a.run_id, b.run_id)
    -- --overwrite: the directory holds the new run only
    local c = trainer({ out_dir = d, max_iters = 1 }, { '--overwrite' })
    assert.equal(d .. '/t', c:run().run_dir)
    assert.same({ 1 }, steps(d .. '/t/checkpoints'))
    for _, r in ipairs(records(d .. '/t/metrics.jsonl')) do assert.equal(c.run_id, r.run) end
    -- the same trainer run again goes on in its directory, as the same run
    c.cfg.max_iters = 2
    assert.equal(d .. '/t', c:run().run_dir)
    assert.same({ 1, 2 }, steps(d .. '/t/checkpoints'))
    for _, r in ipairs(records(d .. '/t/metrics.jsonl')) do assert.equal(c.run_id, r.run) end
    assert.truthy(select(2, pcall(train.new, recipe({ out_dir = d }), { '--overwrite', '--resume' }))
      :find('resume and overwrite exclude each other', 1, true))
    assert.truthy(select(2, pcall(train.new, recipe({ out_dir = d, name = '../x' }), {}))
      :find("config: name must be a directory name of letters, digits, _ . - (not starting with . or -), got the string '../x'", 1, true))
    os.execute('rm -rf ' .. d)
  end)

  it('resumes the interrupted run of another config, not the finished one, and marks the resume', function()
    local d = tmpdir()
    trainer({ out_dir = d, max_iters = 8 }):run()            -- a finished run: checkpoints 8 (keep_last 2)
    local b = trainer({ out_dir = d, max_iters = 100, n_embd = 32 })
    b.hooks.on_log = function(t) if t.step == 3 then ffi.C.raise(2) end end   -- Ctrl-C during step 3
    local res = b:run()
    assert.is_true(res.interrupted)
    assert.equal(d .. '/t-2', res.run_dir)
    assert.same({ 3 }, steps(d .. '/t-2/checkpoints'))
    -- --resume with B's config continues B in its directory, with its id
    local b2 = trainer({ out_dir = d, max_iters = 5, n_embd = 32 }, { '--resume' })
    local r2 = b2:run()
    assert.equal(d .. '/t-2', r2.run_dir)
    assert.equal(2, #r2.losses)
    assert.equal(b.run_id, b2.run_id)
    local recs = records(d .. '/t-2/metrics.jsonl')
    local mark
    for _, r in ipairs(recs) do if r.resumed then mark = r end end
    assert.is_not_nil(mark, 'no resume record')
    assert.equal(3, mark.step)
    assert.equal(d .. '/t-2/checkpoints/step_0000003', mark.from)
    assert.equal(b.run_id, recs[#recs].run)
    assert.truthy(output(b2):find('done: step 5, 2 steps run in', 1, true), output(b2))
    -- --resume with A's config: A is finished, and says so instead of training
    local a2 = trainer({ out_dir = d, max_iters = 8 }, { '--resume' })
    local r3 = a2:run()
    assert.is_true(r3.finished)
    assert.equal(0, #r3.losses)
    assert.truthy(output(a2):find(('run %s/t is already at step 8 of max_iters 8: nothing to train'):format(d), 1, true),
      output(a2))
    assert.same({ 8 }, steps(d .. '/t/checkpoints'))
    os.execute('rm -rf ' .. d)
  end)

  it('resumed from an older checkpoint, starts a new run from it in its own directory', function()
    local d = tmpdir()
    trainer({ out_dir = d, max_iters = 4, checkpoint_interval = 2 }):run()
    local t = trainer({ out_dir = d, max_iters = 3 }, { '--resume=' .. d .. '/t/checkpoints/step_0000002' })
    local res = t:run()
    assert.equal(d .. '/t-2', res.run_dir)
    assert.equal(1, #res.losses)
    assert.same({ 2, 4 }, steps(d .. '/t/checkpoints'))
    assert.same({ 3 }, steps(d .. '/t-2/checkpoints'))
    -- a run directory as the path: its latest checkpoint, and that run goes on
    local t3 = trainer({ out_dir = d, max_iters = 5 }, { '--resume=' .. d .. '/t-2' })
    local r3 = t3:run()
    assert.equal(d .. '/t-2', r3.run_dir)
    assert.equal(2, #r3.losses)
    os.execute('rm -rf ' .. d)
  end)

  it('keep_last never deletes the checkpoint just saved, whatever the other steps', function()
    local d = tmpdir()
    local t = train.new(recipe({ out_dir = d }), {})
    local parts = { model = t.model:state_dict(), optim = {}, state = { config = t.cfg } }
    for _, s in ipairs({ 10, 20, 30 }) do ckpt.save(d, s, parts, 2) end
    assert.same({ 20, 30 }, steps(d))
    ckpt.save(d, 5, parts, 2)
    assert.same({ 5, 30 }, steps(d))
    os.execute('rm -rf ' .. d)
  end)

  it('saves a checkpoint at every eval by default (nanoGPT), not at step 0', function()
    local d = tmpdir()
    trainer({ out_dir = d, max_iters = 6, eval_interval = 2, eval_iters = 1, keep_last = 0 }):run()
    assert.same({ 2, 4, 6 }, steps(d .. '/t/checkpoints'))
    trainer({ out_dir = d, name = 'n', max_iters = 6, eval_interval = 2, eval_iters = 1, keep_last = 0,
              always_save_checkpoint = false, learning_rate = 0 }):run()
    assert.same({ 6 }, steps(d .. '/n/checkpoints'))   -- lr 0: val never improves after step 0
    os.execute('rm -rf ' .. d)
  end)
end)

describe('progress numbers', function()
  it('count training steps only: evals stay out of ms/step, and the ETA adds the evals to come', function()
    local d = tmpdir()
    local clock = 0
    local saved = train.clock
    train.clock = function() return clock end
    local t = trainer({ out_dir = d, max_iters = 6, eval_interval = 3, eval_iters = 1, log_interval = 2 })
    local evaluate, step = t.evaluate, t.train_step
    function t:evaluate() clock = clock + 100; return evaluate(self) end
    function t:train_step() clock = clock + 1; return step(self) end
    local ok, err = pcall(t.run, t)
    train.clock = saved
    assert.is_true(ok, err)
    local n = 0
    for _, r in ipairs(records(d .. '/t/metrics.jsonl')) do
      if r.ms_per_step then n = n + 1; assert.equal(1000, r.ms_per_step) end
    end
    assert.equal(3, n)
    local out = output(t)
    -- at step 2: 4 steps (4 s) and 2 evals (step 3, final: 200 s) to go
    assert.truthy(out:find('step     2/6 | .* | 1000.0 ms/step | .* | ETA 3m24s'), out)
    assert.truthy(out:find('done: step 6, 6 steps run in 5m06s (6s of steps at 1000.0 ms/step, 5m00s of evals', 1, true), out)
    os.execute('rm -rf ' .. d)
  end)

  it('divide by a fixed peak: the table for GPUs, a CPU calibration cached once, or peak_flops', function()
    assert.equal(989e12, progress.gpu_peak('NVIDIA H100 80GB HBM3'))
    assert.equal(756e12, progress.gpu_peak('NVIDIA H100 PCIe'))
    assert.equal(312e12, progress.gpu_peak('NVIDIA A100-SXM4-80GB'))
    assert.is_nil(progress.gpu_peak('Some Card'))
    local d = tmpdir()
    local path = d .. '/gptlua/peak_flops.json'
    local v1, src1 = progress.cpu_peak(path)
    assert.equal('cpu, calibrated now and cached in ' .. path, src1)
    local v2, src2 = progress.cpu_peak(path)
    assert.is_true(math.abs(v1 - v2) < 1e-9 * v1, v1 .. ' ' .. v2)
    assert.equal('cpu, calibrated once, ' .. path, src2)
    local f = io.open(path, 'wb'); f:write('{not json'); f:close()   -- a damaged cache is calibrated again
    local _, src3 = progress.cpu_peak(path)
    assert.equal('cpu, calibrated now and cached in ' .. path, src3)
    assert.equal('/x/gptlua/peak_flops.json', progress.cache_path(function(k) return ({ XDG_CACHE_HOME = '/x' })[k] end))
    assert.equal('/h/.cache/gptlua/peak_flops.json', progress.cache_path(function(k) return ({ HOME = '/h' })[k] end))
    local t = trainer({ out_dir = d, max_iters = 1, peak_flops = 5e12 })
    t:run()
    assert.truthy(output(t):find('MFU against a peak of 5 TFLOP/s per device (peak_flops)', 1, true), output(t))
    os.execute('rm -rf ' .. d)
  end)
end)

describe('recipes/sample.lua --ckpt', function()
  it('takes a run directory, its checkpoints/ or one checkpoint, and names a directory without any', function()
    local d = tmpdir()
    trainer({ out_dir = d, max_iters = 2, checkpoint_interval = 1, keep_last = 0 }):run()
    local function sample(p)
      local h = io.popen(('cd %s && %s recipes/sample.lua --ckpt=%s --n=20 --prompt=A 2>&1; echo "exit=$?"')
        :format(GPTLUA.root, GPTLUA.exe, p))
      local out = h:read('*a'); h:close()
      return out
    end
    for _, p in ipairs({ d .. '/t', d .. '/t/checkpoints', d .. '/t/checkpoints/step_0000001' }) do
      local out = sample(p)
      assert.truthy(out:find('exit=0', 1, true), p .. ': ' .. out)
      assert.truthy(out:find('^A'), out)
    end
    os.execute('mkdir -p ' .. d .. '/empty')
    local out = sample(d .. '/empty')
    assert.truthy(out:find(('sample: no checkpoint in %s/empty (expected a run directory, its checkpoints/ or a checkpoint)\n')
      :format(d), 1, true), out)
    assert.truthy(out:find('exit=1', 1, true), out)
    os.execute('rm -rf ' .. d)
  end)
end)

describe('checkpoint.mkdir_p', function()
  -- it calls mkdir(2) itself: system('mkdir -p') ignored SIGINT while its
  -- child ran, so a Ctrl-C landing in the first metrics write was lost (the
  -- train_spec SIGINT case hung).  No PATH: no child process can be run.
  it('makes the parents without running a process, and says why it cannot', function()
    pcall(ffi.cdef, 'int setenv(const char *name, const char *value, int overwrite);')
    local d, path = tmpdir(), os.getenv('PATH')
    ffi.C.setenv('PATH', '/nonexistent', 1)
    local ok, err = pcall(ckpt.mkdir_p, d .. '/a/b/c')
    ffi.C.setenv('PATH', path, 1)
    assert.is_true(ok, err)
    assert.truthy(io.open(d .. '/a/b/c/.', 'rb'))
    ckpt.mkdir_p(d .. '/a/b/c')  -- exists: nothing to do
    io.open(d .. '/file', 'wb'):close()
    ok, err = pcall(ckpt.mkdir_p, d .. '/file/x')
    assert.equal(('cannot create directory %s/file/x: Not a directory'):format(d), err)
    ok, err = pcall(ckpt.mkdir_p, d .. '/file')
    assert.equal(('cannot create directory %s/file: Not a directory'):format(d), err)
    os.execute('rm -rf ' .. d)
  end)
end)
