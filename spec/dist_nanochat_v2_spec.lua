-- nanochat v2 (value embeddings with gates, smear, backout, lambdas, sliding
-- windows, QK scale, padded vocabulary) under tensor, context and pipeline
-- parallelism, float64, each equal to one process.  One mpirun launch per
-- world size runs every case of that size (spec/dist/nanochat_v2.lua): one
-- forward and backward (loss, every gradient, sampling) of tp 2, tp 2 + sp,
-- cp 2 (Ulysses, with windows; ring, whose kernels take no window, with
-- window_pattern 'L'), pp 2 (1F1B; the backout block on either stage),
-- dp 2 x tp 2 + sp and tp 2 x cp 2 in both modes; then 5 trainer steps
-- (losses, clipped norms, final parameters) of tp 2 + sp and cp 2 with Muon
-- classic, and 3 of pp 2 (1F1B) whose checkpoint one process resumes to 5.
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local cjson = require 'cjson'
local TP = require 'gptlua.dist.tensor_parallel'
local CP = require 'gptlua.dist.context_parallel'
local nanochat = require 'gptlua.models.nanochat'

local H = require 'support.mpi'
local DT = require 'support.dist_train'
local MPIRUN = H.MPIRUN
local recipe = dofile(H.ROOT .. '/spec/dist/tp_recipe.lua')

describe('nanochat v2 layouts in one process', function()
  it('ring attention refuses sliding windows, tensor parallelism a padded vocabulary it does not divide, in one line',
    function()
    local m = nanochat.GPT({ version = 'v2', depth = 2, n_embd = 32, n_head = 4, vocab_size = 16, block_size = 8,
      short_window = 3 })
    local ok, err = pcall(CP.parallelize, m, { size = 2, rank = 0 }, { mode = 'ring' })
    assert.is_false(ok)
    assert.equal("context parallel: ring attention does not take nanochat's sliding windows (layer 1 sees 4 keys); "
      .. "use cp_mode 'ulysses' or nanochat.window_pattern = 'L'", err)
    assert.has_error(function() TP.check(nanochat.resolve({ version = 'v2', depth = 2, n_embd = 32, n_head = 4,
      vocab_size = 16, pad_vocab_to = 6 }), 4) end,
      'tensor parallel: vocab_size 16 padded to 18 is not divisible by tp 4 (set nanochat.pad_vocab_to to a multiple of 4)')
  end)
end)

local grad_norms, assert_close = DT.grad_norms, DT.assert_close  -- (spec/support/dist_train.lua)


describe('nanochat v2 under tp, cp and pp on MPI ranks', function()
  if not MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local V2 = { version = 'v2', short_window = 3 }

  -- one process, 5 steps: the recipe the worker trains, with these overrides
  local refs = {}
  local function reference(name, args)
    if refs[name] then return refs[name] end
    local dir = out .. '/ref_' .. name
    local t = train.new(recipe('nanochat', { out_dir = dir, max_iters = 5, checkpoint_interval = 5, nanochat = V2 }),
      args)
    local res = t:run()
    refs[name] = { losses = res.losses, norms = grad_norms(dir), params = H.params_of(t.model) }
    return refs[name]
  end

  -- Muon keeps its momentum in float32: float64 gradients equal to 1e-15
  -- round to float32 differently now and then, and Newton-Schulz spreads
  -- that over the matrix (1e-8 of the parameters after 5 steps; AdamW: 1e-15)
  local function check_run(ref, dir, what, tol)
    local res = H.read_json(dir .. '/result.json')
    assert_close(ref.losses, res.losses, what .. ' loss')
    assert_close(ref.norms, grad_norms(dir), what .. ' gradient norm')
    local e = H.rel_error(ref.params, ckpt.load(res.checkpoint).model)
    assert.is_true(e < (tol or 1e-7), ('%s: final parameters differ, relative error %.3g'):format(what, e))
  end

  -- (the trainer cases are the costly part: plain tp and ring train through
  -- the same trainer code as tp + sp and Ulysses, and their one forward and
  -- backward above checks what differs)
  it('2 ranks: tp 2, tp 2 + sp, cp 2 (Ulysses, ring) and pp 2 equal one process (one forward and backward; 5 steps '
    .. 'of tp 2 + sp and cp 2 with Muon; pp 2 3 steps, resumed in one process)', function()
    local d = out .. '/w2'
    local muon = '--optimizer=nanochat'
    local o, rc = H.mpirun(2, 'spec/dist/nanochat_v2.lua', table.concat({ d, 'tp2', 'tp2sp', 'cp2', 'cp2ring', 'pp2',
      'pp2late', 'tp2sp:--tp=2,--sp,' .. muon, 'cp2:--cp=2,' .. muon, 'pp2:--pp=2,--max_iters=3,--warmup_iters=2,--lr_decay_iters=20,' .. muon }, ' '),
      300)
    H.assert_ranks_ok(o, rc, 2)
    local ref = reference('muon', { muon })
    check_run(ref, d .. '/tp2sp', 'nanochat v2 tp 2 + sp')
    check_run(ref, d .. '/cp2', 'nanochat v2 cp 2')
    -- pp 2 trains 3 steps and saves (Muon's and AdamW's state gathered from
    -- the stages; its schedule lengths given, so they stay the reference's);
    -- one process resumes from it and goes on to 5
    local res = H.read_json(d .. '/pp2/result.json')
    assert_close({ ref.losses[1], ref.losses[2], ref.losses[3] }, res.losses, 'nanochat v2 pp 2 loss')
    local t = train.new(recipe('nanochat', { out_dir = d .. '/pp2_resumed', max_iters = 5, nanochat = V2 }),
      { muon, '--resume=' .. res.checkpoint, '--max_iters=5', '--allow_changes' })
    local resumed = t:run()
    assert_close({ ref.losses[4], ref.losses[5] }, resumed.losses, 'nanochat v2 pp 2 -> 1 loss')
    local e = H.rel_error(ref.params, H.params_of(t.model))
    assert.is_true(e < 1e-7, ('nanochat v2 pp 2 -> 1: final parameters differ, relative error %.3g'):format(e))
  end)

  it('4 ranks: dp 2 x tp 2 + sp and tp 2 x cp 2 (Ulysses, ring): one forward and backward equals one process',
    function()
    local o, rc = H.mpirun(4, 'spec/dist/nanochat_v2.lua', out .. '/w4 dp2tp2sp tp2cp2 tp2cp2ring', 300)
    H.assert_ranks_ok(o, rc, 4)
  end)
end)
