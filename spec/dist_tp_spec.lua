-- gptlua.dist.mesh and tensor parallelism (gptlua.dist.tensor_parallel, the
-- trainer's tp policy): mesh sizes and bad meshes in this process; then on
-- 2 and 4 MPI ranks (spec/dist/tp_*.lua workers), float64 tiny models:
-- one forward and backward of gpt2 and nanochat (GQA included) at tp 2,
-- tp 4 and dp 2 x tp 2, each also with sequence parallelism, equal to the
-- whole model on the whole batch (loss, every gradient, sampling), 5
-- trainer steps (AdamW, clipping by the whole model's norm) of each layout
-- equal to one process, and checkpoints that
-- load under another mesh; context parallelism (Ulysses and ring) likewise,
-- and tp 2 x cp 2 (4 ranks) in both cp modes.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local mesh = require 'gptlua.dist.mesh'
local TP = require 'gptlua.dist.tensor_parallel'
local CP = require 'gptlua.dist.context_parallel'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'

local H = require 'support.mpi'
local DT = require 'support.dist_train'
local MPIRUN = H.MPIRUN
local recipe = DT.recipe

describe('gptlua.dist.mesh in one process', function()
  it('infers dp from the world and refuses meshes that do not fit it', function()
    assert.same({ pp = 1, dp = 2, cp = 1, tp = 2 }, mesh.sizes({ tp = 2 }, 4))
    assert.same({ pp = 1, dp = 4, cp = 1, tp = 1 }, mesh.sizes({}, 4))
    assert.same({ pp = 1, dp = 1, cp = 1, tp = 4 }, mesh.sizes({ dp = 1, tp = 4 }, 4))
    assert.has_error(function() mesh.sizes({ tp = 3 }, 4) end,
      'dist.mesh: tp 3 x cp 1 = 3 does not divide the world of 4 ranks')
    assert.has_error(function() mesh.sizes({ dp = 2, tp = 4 }, 4) end,
      'dist.mesh: dp 2 x cp 1 x tp 4 = 8 ranks, but the world has 4')
    assert.has_error(function() mesh.sizes({ tp = 0 }, 4) end, 'dist.mesh: tp expected a positive integer, got 0')
    assert.has_error(function() mesh.sizes({ dp = 1.5 }, 4) end,
      'dist.mesh: dp expected a positive integer (or 0: the rest of the world), got 1.5')
    assert.has_error(function() mesh.sizes({ xp = 2 }, 4) end, 'dist.mesh: unknown dimension xp (expected pp, dp, cp, tp or ep)')
    -- ep cuts dp (gptlua.dist.expert_parallel): it must divide it
    assert.same({ pp = 1, dp = 4, cp = 1, tp = 1, ep = 2 }, mesh.sizes({ ep = 2 }, 4))
    assert.has_error(function() mesh.sizes({ ep = 4 }, 6) end, 'dist.mesh: ep 4 does not divide dp 6')
    assert.has_error(function() mesh.sizes({ tp = 2, ep = 4 }, 4) end, 'dist.mesh: ep 4 does not divide dp 2')
    assert.same({ pp = 1, dp = 2, cp = 2, tp = 1 }, mesh.sizes({ cp = 2 }, 4))
    assert.has_error(function() mesh.sizes({ cp = 3, tp = 2 }, 4) end,
      'dist.mesh: tp 2 x cp 3 = 6 does not divide the world of 4 ranks')
    assert.has_error(function() dist.mesh({ dp = 2, tp = 2 }) end,
      'dist.mesh: dp 2 x cp 1 x tp 2 = 4 ranks, but the world has 1')
    local ok, err = pcall(dist.mesh, 5)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('dist.mesh: sizes must be a table, got 5', 1, true), tostring(err))
  end)

  it('in a world of one has a Comm of one rank per dimension', function()
    local m = dist.mesh({})
    for _, d in ipairs({ 'dp', 'cp', 'tp' }) do
      assert.equal(1, m.size[d]); assert.equal(0, m.coord[d]); assert.equal(1, m[d].size)
    end
    assert.same({ 0 }, m:group_ranks('tp'))
    assert.equal('Mesh(dp 1 x cp 1 x tp 1; rank 0 at 0,0,0)', tostring(m))
  end)

  it('refuses models whose heads, KV heads, width or vocabulary tp does not divide', function()
    local cfg = { n_head = 4, n_kv_head = 4, n_embd = 32, vocab_size = 68 }
    TP.check(cfg, 4)
    local function bad(over, tp, msg)
      local c = {}
      for k, v in pairs(cfg) do c[k] = v end
      for k, v in pairs(over) do c[k] = v end
      assert.has_error(function() TP.check(c, tp) end, msg)
    end
    bad({ n_head = 6 }, 4, 'tensor parallel: n_head 6 is not divisible by tp 4')
    bad({ n_kv_head = 2 }, 4, 'tensor parallel: n_kv_head 2 is not divisible by tp 4')
    bad({ n_embd = 30 }, 4, 'tensor parallel: n_embd 30 is not divisible by tp 4')
    bad({ vocab_size = 65 }, 2,
      'tensor parallel: vocab_size 65 is not divisible by tp 2 (set --vocab_size to a multiple of 2, e.g. 66)')
  end)

  it('cuts and reassembles fused blocks (gpt2 c_attn: q|k|v per rank)', function()
    local full = gl.arange(0, 24, { dtype = 'float64' }):view(12, 2)
    local spec = { dim = 1, blocks = 3 }
    local p0, p1 = TP.slice(full, spec, 0, 2), TP.slice(full, spec, 1, 2)
    assert.same({ { 0, 1 }, { 2, 3 }, { 8, 9 }, { 10, 11 }, { 16, 17 }, { 18, 19 } }, p0:totable())
    assert.same({ { 4, 5 }, { 6, 7 }, { 12, 13 }, { 14, 15 }, { 20, 21 }, { 22, 23 } }, p1:totable())
    assert.same({ { 0, 1, 2, 3, 4, 5 } }, TP.slice(gl.arange(0, 6, { dtype = 'float64' }):view(1, 6), { dim = 2 }, 0, 1)
      :totable())
  end)

  it('refuses tp without a distributed run, sp without tp, and tp < 1', function()
    assert.has_error(function() train.new(recipe('gpt2', { dist = 'none' }), { '--tp=2' }) end,
      "config: tp 2, cp 1 and dp 0 need a distributed run (dist = 'ddp')")
    assert.has_error(function() train.new(recipe('gpt2', { dist = 'none' }), { '--cp=2' }) end,
      "config: tp 1, cp 2 and dp 0 need a distributed run (dist = 'ddp')")
    assert.has_error(function() CP.check({ n_head = 4, n_kv_head = 2, block_size = 16 }, 4) end,
      'context parallel: n_kv_head 2 is not divisible by cp 4')
    assert.has_error(function() CP.check({ n_head = 4, block_size = 6 }, 4) end,
      'context parallel: block_size 6 is not divisible by cp 4')
    -- ring: heads need not divide by cp, the sequence divides into 2 cp chunks
    CP.check({ n_head = 3, n_kv_head = 1, block_size = 16 }, 4, 'ring')
    assert.has_error(function() CP.check({ n_head = 4, block_size = 12 }, 4, 'ring') end,
      'context parallel: block_size 12 is not divisible by 2 x cp 8')
    assert.has_error(function() CP.check({ n_head = 4, block_size = 16 }, 2, 'zigzag') end,
      "context parallel: cp_mode expected 'ulysses' or 'ring', got zigzag")
    assert.has_error(function() CP.check({ n_head = 4, block_size = 16, window = 4 }, 2, 'ring') end,
      'context parallel: a sliding window is not supported with context parallelism')
    -- under tp the heads are cut first: Ulysses needs n_head / tp divisible by cp
    assert.has_error(function() CP.check({ n_head = 4, n_kv_head = 4, block_size = 16 }, 4, 'ulysses', 2) end,
      'context parallel: n_head / tp 2 is not divisible by cp 4')
    assert.has_error(function() train.new(recipe('gpt2', { dist = 'none' }), { '--cp_mode=zigzag' }) end,
      "config: cp_mode expected 'ulysses' or 'ring', got zigzag")
    assert.has_error(function() require('gptlua.dist.ring_attention').attention(gl.zeros({ 1, 1, 4, 2 }),
      gl.zeros({ 1, 1, 4, 2 }), gl.zeros({ 1, 1, 4, 2 }), dist.init(), { window = 2 }) end,
      'ring attention: a sliding window (2) is not supported')
    assert.has_error(function() train.new(recipe('gpt2', { dist = 'none' }), { '--sp' }) end,
      'config: sp (sequence parallel) needs tp > 1, got tp 1')
    assert.has_error(function() TP.check({ n_head = 4, n_embd = 32, vocab_size = 68, block_size = 6 }, 4, true) end,
      'tensor parallel: block_size 6 is not divisible by tp 4')
    assert.has_error(function() train.new(recipe('gpt2'), { '--tp=0' }) end)
  end)
end)

-- ------------------------------------------------------------ MPI ranks --
-- Cases of one world size share a launch (spec/support/dist_train.lua;
-- tp_grads.lua and cp_grads.lua take several meshes separated by ','): a
-- launch's start-up costs more than one of these tiny runs.
describe('tensor parallelism on MPI ranks', function()
  if not MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local runs = DT.new(out)

  -- each of cases' meshes {dp, size, rest} in one launch per world size
  local function grads(script, cases)
    local sizes, by_size = {}, {}
    for _, c in ipairs(cases) do
      local n = c[1] * c[2]
      if not by_size[n] then by_size[n] = {}; sizes[#sizes + 1] = n end
      table.insert(by_size[n], ('%d %d %s'):format(c[1], c[2], c[3]))
    end
    for _, n in ipairs(sizes) do
      local o, rc = H.mpirun(n, script, table.concat(by_size[n], ' , '), 60 + 60 * #by_size[n])
      H.assert_ranks_ok(o, rc, n)
    end
  end

  it('one forward and backward at tp 2, tp 4 and dp 2 x tp 2, with and without sequence parallelism, equals the '
    .. 'whole model (loss, every gradient)', function()
    grads('spec/dist/tp_grads.lua', { { 1, 2, 'gpt2 nanochat nanochat:2' }, { 1, 4, 'gpt2 nanochat' },
                                      { 2, 2, 'gpt2 nanochat:2' }, { 1, 2, 'sp gpt2 nanochat:2' },
                                      { 1, 4, 'sp gpt2 nanochat' }, { 2, 2, 'sp gpt2 nanochat:2' } })
    -- a mesh the model's KV heads do not fit is refused on every rank, in one line
    local o, rc = H.mpirun(4, 'spec/dist/tp_grads.lua', '1 4 nanochat:2')
    assert.not_equal(0, rc)
    assert.truthy(o:find('tensor parallel: n_kv_head 2 is not divisible by tp 4', 1, true), o)
  end)

  it('sequence parallel lowers the per-rank peak below plain tp by the column-parallel inputs it no longer keeps',
    function()
    local o, rc = H.mpirun(2, 'spec/dist/sp_memory.lua', '')
    H.assert_ranks_ok(o, rc, 2)
  end)

  it('context parallel (Ulysses and ring): one forward and backward at cp 2, cp 4 and dp 2 x cp 2 equals the whole '
    .. 'model', function()
    grads('spec/dist/cp_grads.lua', { { 1, 2, 'ulysses gpt2 nanochat:2' }, { 1, 4, 'ulysses gpt2 nanochat' },
                                      { 2, 2, 'ulysses gpt2 nanochat:2' }, { 1, 2, 'ring gpt2 nanochat:2' },
                                      { 1, 4, 'ring gpt2 nanochat:2 nanochat:1' }, { 2, 2, 'ring gpt2 nanochat:2' } })
  end)

  it('5 trainer steps of cp 2 and cp 4 ring, cp 2, dp 2 x cp 2 (zero1; ring: ddp), tp 2 x cp 2 (both modes), tp 2, '
    .. 'tp 4, dp 2 x tp 2 (ddp, zero1, fsdp), tp 2 + sp and dp 2 x tp 2 + sp (ddp, zero2, fsdp) equal one process '
    .. '(losses, clipped norms, parameters)', function()
    local cases = {}
    for _, model in ipairs({ 'gpt2', 'nanochat' }) do
      -- (nanochat, whose layers are cut the same way, runs a quicker subset;
      -- its 2 KV heads do not divide by tp 4)
      for _, case in ipairs({ { 2, '--cp=2 --cp_mode=ring', true }, { 4, '--cp=4 --cp_mode=ring', true },
                              { 4, '--dp=2 --cp=2 --cp_mode=ring', true }, { 4, '--tp=2 --cp=2 --cp_mode=ring', true },
                              { 4, '--tp=2 --cp=2' },
                              { 2, '--cp=2', true }, { 4, '--dp=2 --cp=2 --dist=zero1' },
                              { 2, '--tp=2', true }, { 4, '--tp=4' }, { 4, '--dp=2 --tp=2' }, { 2, '--tp=2 --sp' },
                              { 4, '--dp=2 --tp=2 --sp', true }, { 4, '--dp=2 --tp=2 --dist=zero1' },
                              { 4, '--dp=2 --tp=2 --sp --dist=zero2', true }, { 4, '--dp=2 --tp=2 --dist=fsdp' },
                              { 4, '--dp=2 --tp=2 --sp --dist=fsdp', true } }) do
        if model == 'gpt2' or case[3] then
          -- (FSDP reduce-scatters gradients in float32, its reduce_dtype: the
          -- rule of spec/support/dist_train.lua measures what that does)
          cases[#cases + 1] = { ranks = case[1], model = model, args = case[2],
                                reduce = case[2]:match('fsdp') and 'float32' or nil }
        end
      end
    end
    local got = runs:launch(cases)
    for i, c in ipairs(cases) do runs:check(c, got[i]) end
  end)

  -- Newton–Schulz runs in float32 on the whole matrix gathered from the
  -- shards' momentum updates, and the momentum is kept in float32 (FSDP:
  -- float32 gradient reduction too): the rule of spec/support/dist_train.lua
  it('5 trainer steps of nanochat with Muon at tp 2, dp 2 x tp 2 + sp, zero2 and fsdp dp 2 x tp 2 equal one process',
    function()
    local cases = {}
    for _, case in ipairs({ { 2, '--tp=2' }, { 4, '--dp=2 --tp=2 --sp' }, { 4, '--dp=2 --tp=2 --dist=zero2' },
                            { 4, '--dp=2 --tp=2 --dist=fsdp' } }) do
      cases[#cases + 1] = { ranks = case[1], model = 'nanochat', args = '--optimizer=nanochat ' .. case[2],
                            what = 'nanochat muon ' .. case[2], state32 = true,
                            reduce = case[2]:match('fsdp') and 'float32' or nil }
    end
    for i, res in ipairs(runs:launch(cases)) do runs:check(cases[i], res, { optimizer = 'nanochat' }) end
  end)

  it('checkpoints load under another mesh: tp 2 -> one process -> dp 2 x tp 2, and ZeRO-2 -> FSDP under tp 2', function()
    -- tp 2 saves at step 3 (full tensors); one process goes on to 5.  One
    -- process saves at step 3 too, and dp 2 x tp 2 zero2 (its optimizer
    -- pieces assembled whole): all three launched before any resumes.
    local b = out .. '/resume_b'
    local one = train.new(recipe('gpt2', { out_dir = b, max_iters = 3 }), {}):run().checkpoint
    local saved = runs:launch({ { ranks = 2, model = 'gpt2', iters = 3, args = '--tp=2', name = 'resume_a' },
                                { ranks = 4, model = 'gpt2', iters = 3, args = '--dp=2 --tp=2 --dist=zero2',
                                  name = 'resume_c' } })
    local step3 = saved[1].checkpoint
    local sd = ckpt.load_safetensors(step3 .. '/model.safetensors')
    assert.same({ 96, 32 }, sd['transformer.h.0.attn.c_attn.weight'].shape)
    assert.same({ 68, 32 }, sd['transformer.wte.weight'].shape)
    local t = train.new(recipe('gpt2', { out_dir = out .. '/resume_a1', max_iters = 5 }), { '--resume=' .. step3 })
    runs:check_resumed({ ranks = 2, model = 'gpt2' }, DT.local_result(t, t:run(), out .. '/resume_a1', 'tp 2 -> 1'), 4)
    -- dp 2 x tp 2 goes on to 5 from the one process's step 3; dp 2 x tp 2
    -- fsdp from zero2's (one launch; FSDP reduces in float32)
    local resumed = runs:launch({
      { ranks = 4, model = 'gpt2', args = '--dp=2 --tp=2 --resume=' .. one, name = 'b4', what = 'tp 1 -> dp 2 x tp 2' },
      { ranks = 4, model = 'gpt2', args = '--dp=2 --tp=2 --dist=fsdp --resume=' .. saved[2].checkpoint, name = 'c4',
        what = 'zero2 dp 2 x tp 2 -> fsdp dp 2 x tp 2' } })
    runs:check_resumed({ ranks = 4, model = 'gpt2' }, resumed[1], 4)
    runs:check_resumed({ ranks = 4, model = 'gpt2', reduce = 'float32' }, resumed[2], 4)
  end)

  -- The text's 65 characters under tp 2: the trainer pads the vocabulary to
  -- 66 rows.  Their logits are masked (the loss and the gradient norm equal
  -- an unpadded model's), their gradient is zero, and checkpoints hold the
  -- 65 rows: tp 2 resumes from one process's step 3 and one process from
  -- tp 2's, each equal to the other side's run by the rule (the padded
  -- model's initial values differ from an unpadded one's: the extra row
  -- takes random numbers, so the runs are compared from a shared checkpoint on).
  it('pads the vocabulary to a multiple of tp (65 -> 66 under tp 2: masked, not saved, loads under any tp)', function()
    local gpt2 = require 'gptlua.models.gpt2'
    local m = gpt2.GPT({ vocab_size = 65, block_size = 8, n_layer = 1, n_head = 2, n_embd = 16, pad_vocab_for_tp = 2 })
    assert.same({ 66, 16 }, m.transformer.wte.weight.shape)
    assert.same({ 1, 8, 65 }, m:forward(gl.zeros({ 1, 8 }, { dtype = 'int64' })).shape)   -- no padded logit to sample
    for _, model in ipairs({ 'gpt2', 'nanochat' }) do
      local V65 = { vocab_size = 65 }
      local one = runs:reference(model, V65)
      local got = runs:launch({
        { ranks = 2, model = model, iters = 5, args = '--tp=2 --vocab_size=65', name = 'pad_tp_' .. model },
        { ranks = 2, model = model, iters = 5, name = 'pad_res_' .. model, what = model .. ' 1 -> tp 2',
          args = ('--tp=2 --vocab_size=65 --resume=%s/p/checkpoints/step_0000003'):format(one.dir) } })
      local tp, tp_resumed = got[1], got[2]
      local sd = ckpt.load(tp.checkpoint).model
      assert.same({ 65, 32 }, sd['transformer.wte.weight'].shape)
      -- tp 2 from one process's step 3 equals one process
      runs:check_resumed({ ranks = 2, model = model }, tp_resumed, 4, V65)
      -- tp 2 equals one process resumed from its step 3 (their shared
      -- checkpoint, the padded row's initial values aside): tp 2's steps
      -- 4 and 5 against that one process's by the rule
      local back = { ranks = 2, model = model }
      runs:check(back, { losses = { tp.losses[4], tp.losses[5] }, norms = { tp.norms[4], tp.norms[5] },
        checkpoint = tp.checkpoint, what = model .. ' tp 2 (steps 4, 5) against tp 2 -> 1' },
        { vocab_size = 65, resume = tp.dir .. '/p/checkpoints/step_0000003' })
    end
  end)
end)
