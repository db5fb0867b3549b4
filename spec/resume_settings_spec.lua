-- A shorter or longer run stretches the recipe's schedule (warmup, decay,
-- evals follow max_iters unless given), and --resume continues the run it
-- resumes: its command line's length and schedule stay, every other
-- difference is printed, and a change of what the run is (max_iters given
-- anew, tokens per step) needs --allow_changes.
local train = require 'gptlua.train'

local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end

local function recipe(over)
  local r = { name = 'r', model = 'gpt2', data = 'char', n_layer = 1, n_head = 2, n_embd = 16, block_size = 8,
              batch_size = 4, max_iters = 8, warmup_iters = 2, lr_decay_iters = 8, eval_interval = 0, log_interval = 1,
              sample_length = 0, quiet = false, device = 'cpu', seed = 3, tensorboard = false, control = false,
              peak_flops = 1e12 }
  for k, v in pairs(over or {}) do r[k] = v end
  return r
end

-- runs f with the trainer's printed lines captured; returns f's results and the text
local function captured(f, ...)
  local out, write = {}, io.write
  io.write = function(...) for _, s in ipairs({ ... }) do out[#out + 1] = tostring(s) end end
  local res = { pcall(f, ...) }
  io.write = write
  return res, table.concat(out)
end

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end

describe('schedule lengths', function()
  it("follow the command line's max_iters unless given", function()
    local r = { max_iters = 1175, warmup_iters = 59, lr_decay_iters = 1175, eval_interval = 235, device = 'cpu' }
    local cfg, _, launch = train.resolve_config(r, { '--max_iters=500' })
    assert.same({ 25, 500, 100 }, { cfg.warmup_iters, cfg.lr_decay_iters, cfg.eval_interval })
    assert.same({ "warmup_iters 25 (the recipe's 59)", "lr_decay_iters 500 (the recipe's 1175)",
                  "eval_interval 100 (the recipe's 235)" }, launch.scaled)
    cfg = train.resolve_config(r, { '--max_iters=20' })
    assert.same({ 1, 20, 4 }, { cfg.warmup_iters, cfg.lr_decay_iters, cfg.eval_interval })
    cfg = train.resolve_config(r, { '--max_iters=500', '--warmup_iters=7', '--eval_interval=0' })
    assert.same({ 7, 500, 0 }, { cfg.warmup_iters, cfg.lr_decay_iters, cfg.eval_interval })
    cfg = train.resolve_config(r, {})
    assert.same({ 59, 1175, 235 }, { cfg.warmup_iters, cfg.lr_decay_iters, cfg.eval_interval })
    -- the shipped recipe: a shortened run decays to its floor at its own last step
    local sh = dofile('recipes/shakespeare.lua')
    cfg = train.resolve_config(sh, { '--max_iters=500', '--device=cpu' })
    assert.same({ 25, 500, 100 }, { cfg.warmup_iters, cfg.lr_decay_iters, cfg.eval_interval })
    local t = train.lr_schedule(cfg)
    assert.near(0.1, t(500), 1e-12)
  end)
end)

describe('--resume', function()
  it("continues the run with its own command line's length and schedule", function()
    local d1, d2 = tmpdir(), tmpdir()
    local full = train.main(recipe({ out_dir = d1, quiet = true }), { '--max_iters=6' })
    -- the same run stopped after step 3 (as Ctrl-C stops it), then resumed with the bare recipe
    local r = recipe({ out_dir = d2, quiet = true })
    r.on_log = function(t) if t.step == 3 then t.stop_signal = true end end
    train.main(r, { '--max_iters=6' })
    local res, out = captured(train.main, recipe({ out_dir = d2 }), { '--resume' })
    assert(res[1], res[2])
    has(out, "resume: the run's own lr_decay_iters 6, max_iters 6 (given again, they change)")
    local resumed = res[2]
    assert.equal(3, #resumed.losses)
    for i = 1, 3 do assert.equal(full.losses[3 + i], resumed.losses[i]) end
    os.execute('rm -rf ' .. d1 .. ' ' .. d2)
  end)

  it('prints every setting that differs and needs --allow_changes for a new max_iters or tokens per step', function()
    local d = tmpdir()
    local r = recipe({ out_dir = d, quiet = true })
    r.on_log = function(t) if t.step == 3 then t.stop_signal = true end end
    train.main(r, { '--max_iters=6' })
    local res = captured(train.main, recipe({ out_dir = d }), { '--resume', '--max_iters=10' })
    assert.is_false(res[1])
    assert.equal("resume: this changes what the run is: max_iters 6 -> 10; --allow_changes continues it so, "
      .. "or keep the run's values", res[2])
    res = captured(train.main, recipe({ out_dir = d }), { '--resume', '--batch_size=2', '--temperature=0.5' })
    assert.is_false(res[1])
    assert.equal('resume: this changes what the run is: tokens per step 32 -> 16 '
      .. "(--gradient_accumulation_steps=2 keeps 32); --allow_changes continues it so, or keep the run's values", res[2])
    local out
    res, out = captured(train.main, recipe({ out_dir = d, max_iters = 8 }),
      { '--resume', '--batch_size=2', '--gradient_accumulation_steps=2', '--temperature=0.5' })
    assert(res[1], res[2])
    has(out, "resume: settings that differ from the run's: batch_size 4 -> 2, gradient_accumulation_steps 1 -> 2, "
      .. 'temperature 0.8 -> 0.5')
    assert.equal(3, #res[2].losses)   -- the run's max_iters 6, not the recipe's 8
    -- a new max_iters, allowed: the run's schedule stretched to it
    local t = train.new(recipe({ out_dir = d }), { '--resume', '--max_iters=12', '--allow_changes',
      '--batch_size=2', '--gradient_accumulation_steps=2' })
    t:open_run()
    assert.same({ 12, 12, 4 }, { t.cfg.max_iters, t.cfg.lr_decay_iters, t.cfg.warmup_iters })
    os.execute('rm -rf ' .. d)
  end)
end)

describe('--resume with a new max_iters', function()
  it("keeps the schedule lengths the run's command line set, and stretches the others", function()
    local d = tmpdir()
    local r = recipe({ out_dir = d, quiet = true })
    r.on_log = function(t) if t.step == 3 then t.stop_signal = true end end
    train.main(r, { '--max_iters=6', '--lr_decay_iters=20' })
    local t = train.new(recipe({ out_dir = d, quiet = true }), { '--resume', '--max_iters=12', '--allow_changes' })
    t:open_run()
    -- lr_decay_iters: set by the run's command line; warmup_iters 2 (the recipe's, at 8 and at 6): 2 x 12 / 6
    assert.same({ 12, 20, 4 }, { t.cfg.max_iters, t.cfg.lr_decay_iters, t.cfg.warmup_iters })
    os.execute('rm -rf ' .. d)
  end)
end)

describe('an eval after --resume', function()
  it("reads the batches the run's own eval at that step read", function()
    local d1, d2 = tmpdir(), tmpdir()
    local function evals(dir)
      local out = {}
      for line in io.lines(dir .. '/metrics.jsonl') do
        local m = require('cjson').decode(line)
        if m.eval then out[#out + 1] = { m.step, m.val_loss, m.train_loss } end
      end
      return out
    end
    local over = { quiet = true, eval_interval = 2, eval_iters = 2 }
    over.out_dir = d1
    train.main(recipe(over), { '--max_iters=6' })
    over.out_dir = d2
    local r = recipe(over)
    r.on_log = function(t) if t.step == 3 then t.stop_signal = true end end
    train.main(r, { '--max_iters=6' })       -- checkpoints at step 2 (its eval) and 3 (stopped)
    train.main(recipe(over), { '--resume=' .. d2 .. '/r/checkpoints/step_0000002', '--max_iters=6' })
    -- the uninterrupted run's evals at 0, 2, 4, 6; the resumed one's (a new run: its checkpoint is not
    -- the latest of r) at 2, 4, 6
    local full, resumed = evals(d1 .. '/r'), evals(d2 .. '/r-2')
    assert.equal(4, #full)
    assert.equal(3, #resumed)
    for i = 1, 3 do assert.same(full[i + 1], resumed[i]) end
    os.execute('rm -rf ' .. d1 .. ' ' .. d2)
  end)
end)
