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

describe('nanochat v2 under tp, cp and pp on MPI ranks', function()
  if not MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  -- one process, 5 steps with Muon classic (its momentum kept in float32:
  -- the rule's state32), the reference of spec/support/dist_train.lua; its
  -- step-3 checkpoint is what pp 2's 3 steps are held to
  local runs = DT.new(out)
  local MUON = { nanochat = { version = 'v2', short_window = 3 }, checkpoint_interval = 3, optimizer = 'nanochat' }
  local function launched(dir, what)
    local res = H.read_json(dir .. '/result.json')
    return { losses = res.losses, norms = DT.grad_norms(dir), checkpoint = res.checkpoint, what = what }
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
    local case = { ranks = 2, model = 'nanochat', state32 = true }
    runs:check(case, launched(d .. '/tp2sp', 'nanochat v2 tp 2 + sp'), MUON)
    runs:check(case, launched(d .. '/cp2', 'nanochat v2 cp 2'), MUON)
    -- pp 2 trains 3 steps and saves (Muon's and AdamW's state gathered from
    -- the stages; its schedule lengths given, so they stay the reference's);
    -- one process resumes from it and goes on to 5
    local perturb = DT.rounding_of(2, 'float64', true)
    local ref, refp = runs:reference('nanochat', MUON), runs:reference('nanochat', MUON, perturb)
    local function step3(r) return ckpt.load(r.dir .. '/p/checkpoints/step_0000003').model end
    local pp = launched(d .. '/pp2', 'nanochat v2 pp 2')
    DT.assert_by_rule(ref, refp, perturb, pp, { 1, 3 }, step3(ref), step3(refp))
    local dir = d .. '/pp2_resumed'
    local t = train.new(recipe('nanochat', { out_dir = dir, max_iters = 5, nanochat = MUON.nanochat }),
      { muon, '--resume=' .. pp.checkpoint, '--max_iters=5', '--allow_changes' })
    runs:check_resumed(case, DT.local_result(t, t:run(), dir, 'nanochat v2 pp 2 -> 1'), 4, MUON)
  end)

  it('4 ranks: dp 2 x tp 2 + sp and tp 2 x cp 2 (Ulysses, ring): one forward and backward equals one process',
    function()
    local o, rc = H.mpirun(4, 'spec/dist/nanochat_v2.lua', out .. '/w4 dp2tp2sp tp2cp2 tp2cp2ring', 300)
    H.assert_ranks_ok(o, rc, 4)
  end)
end)
