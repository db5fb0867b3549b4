-- The optimizer's groups by name: each key sets the rate it names, under
-- both built-in optimizers, on the command line and live (set{}); a key the
-- chosen optimizer ignores is refused in one line; the log and metrics
-- name every group's rate.
local train = require 'gptlua.train'
local control = require 'gptlua.control'
local cjson = require 'cjson'

local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end

local function recipe(over)
  local r = { name = 'g', model = 'nanochat', optimizer = 'nanochat', data = 'char', n_layer = 1, n_head = 2,
              n_embd = 16, block_size = 8, batch_size = 2, max_iters = 4, eval_interval = 0, log_interval = 1,
              sample_length = 0, warmup_iters = 0, lr_decay_iters = 4, quiet = true, device = 'cpu', seed = 5,
              tensorboard = false, control = false, journal = false }
  for k, v in pairs(over or {}) do r[k] = v end
  return r
end

local function err_of(f, ...)
  local ok, e = pcall(f, ...)
  assert.is_false(ok, 'expected an error')
  return tostring(e)
end

local function groups_by_name(opt)
  local out = {}
  for _, g in ipairs(opt.groups) do out[g.name] = out[g.name] or g end
  return out
end

describe('optimizer groups', function()
  it('refuses a key the chosen optimizer ignores, naming the keys it reads', function()
    assert.equal("config: --learning_rate is a key of optimizer 'adamw'; this run's optimizer 'nanochat' ignores it "
      .. '(its rates: --matrix_lr, --embedding_lr, --unembedding_lr, --scalar_lr; its floor: --final_lr_frac)',
      err_of(train.resolve_config, recipe(), { '--learning_rate=3e-4' }))
    assert.equal("config: --matrix_lr is a key of optimizer 'nanochat'; this run's optimizer 'adamw' ignores it "
      .. '(its rate: --learning_rate; its floor: --min_lr)',
      err_of(train.resolve_config, recipe(), { '--optimizer=adamw', '--matrix_lr=0.01' }))
    -- what each optimizer reads is taken
    assert.equal(3e-4, (train.resolve_config(recipe(), { '--optimizer=adamw', '--learning_rate=3e-4' })).learning_rate)
    assert.equal(0.01, (train.resolve_config(recipe(), { '--matrix_lr=0.01' })).matrix_lr)
    -- a recipe with its own optimizer reads any key
    local r = recipe({ build_optimizer = function(cfg, model) return require('gptlua.optim').AdamW(model:parameters(),
      { lr = cfg.learning_rate }) end })
    assert.equal(3e-4, (train.resolve_config(r, { '--learning_rate=3e-4' })).learning_rate)
  end)

  it("names nanochat's groups, sets each from its key, and moves only that key's groups live", function()
    local t = train.new(recipe(), { '--matrix_lr=0.01', '--embedding_lr=0.3' })
    local scale = (16 / 768) ^ -0.5
    local g = groups_by_name(t.optimizer)
    assert.equal(0.01, g.matrix.initial_lr)
    assert.near(0.3 * scale, g.embedding.initial_lr, 1e-15)
    assert.near(0.004 * scale, g.unembedding.initial_lr, 1e-15)
    assert.equal(0.004, t.cfg.scalar_lr)   -- 0: the classic variant's rate, written into cfg
    -- set{} changes exactly the groups its key names
    control.apply(t, { kind = 'set', values = { embedding_lr = 0.1 } })
    assert.near(0.1 * scale, g.embedding.initial_lr, 1e-15)
    assert.equal(0.01, g.matrix.initial_lr)
    assert.near(0.004 * scale, g.unembedding.initial_lr, 1e-15)
    control.apply(t, { kind = 'set', values = { matrix_lr = 0.03 } })
    assert.equal(0.03, g.matrix.initial_lr)
    assert.near(0.1 * scale, g.embedding.initial_lr, 1e-15)
    -- and refuses learning_rate, which this optimizer does not read
    assert.equal("control: set: learning_rate is a key of optimizer 'adamw'; this run's optimizer 'nanochat' ignores it "
      .. '(its rates: matrix_lr, embedding_lr, unembedding_lr, scalar_lr; its floor: final_lr_frac)',
      err_of(control.validate_set, { learning_rate = 3e-4 }, t.cfg, t.hooks))
  end)

  it("names nanochat's current groups with their keys and factors", function()
    local t = train.new(recipe({ muon_variant = 'current', n_embd = 32, nanochat = { version = 'v2' } }), {})
    local scale = (t.cfg.n_embd / 768) ^ -0.5
    local g = groups_by_name(t.optimizer)
    assert.equal(0.5, t.cfg.scalar_lr)
    assert.near(0.2 * scale * 0.5, g.value_embeds.initial_lr, 1e-15)
    assert.equal('embedding_lr', g.value_embeds.lr_key)
    assert.near(0.5 * 0.01, g.resid_lambdas.initial_lr, 1e-15)
    control.apply(t, { kind = 'set', values = { scalar_lr = 1 } })
    assert.near(0.01, g.resid_lambdas.initial_lr, 1e-15)
    assert.near(1, g.x0_lambdas.initial_lr, 1e-15)
  end)

  it("learning_rate is AdamW's peak for every group, live too", function()
    local t = train.new(recipe({ optimizer = 'adamw', model = 'gpt2' }), { '--learning_rate=3e-4' })
    local g = groups_by_name(t.optimizer)
    assert.equal(3e-4, g.decay.initial_lr)
    assert.equal(3e-4, g.no_decay.initial_lr)
    control.apply(t, { kind = 'set', values = { learning_rate = 2e-3 } })
    assert.equal(2e-3, g.decay.initial_lr)
    assert.equal(2e-3, g.no_decay.initial_lr)
    assert.same({ { 'lr', g.decay.lr } }, train.group_rates(t.optimizer))
  end)

  it('logs every group under its name, and the cosine ends at final_lr_frac of each peak', function()
    local d = tmpdir()
    local out = {}
    local r = recipe({ out_dir = d, quiet = false, final_lr_frac = 0.25, lr_decay_iters = 3, max_iters = 4 })
    local write = io.write
    io.write = function(...) for _, s in ipairs({ ... }) do out[#out + 1] = tostring(s) end end
    local ok, e = pcall(function() train.main(r, {}) end)
    io.write = write
    assert(ok, e)
    local log = table.concat(out)
    assert.truthy(log:find('| lr embedding 1.39e+00 unembedding 2.77e-02 matrix 2.00e-02 |', 1, true), log)
    local recs = {}
    for line in io.lines(d .. '/g/metrics.jsonl') do
      local m = cjson.decode(line)
      if m.loss then recs[#recs + 1] = m end
    end
    assert.equal(4, #recs)
    local scale = (16 / 768) ^ -0.5
    for _, m in ipairs(recs) do
      assert.is_nil(m.lr)   -- no one rate: nanochat's groups differ
      assert.near(0.02 * m.lr_mult, m.lr_matrix, 1e-15)
      assert.near(0.2 * scale * m.lr_mult, m.lr_embedding, 1e-12)
      assert.near(0.004 * scale * m.lr_mult, m.lr_unembedding, 1e-12)
    end
    assert.equal(1, recs[1].lr_mult)          -- step 0: no warmup, the peak
    assert.near(0.25, recs[4].lr_mult, 1e-15) -- step 3 = lr_decay_iters: the floor
    os.execute('rm -rf ' .. d)
  end)
end)
