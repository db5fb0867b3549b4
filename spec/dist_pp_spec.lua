-- Pipeline parallelism (gptlua.dist.schedules, gptlua.dist.pipeline, the
-- mesh's pp dimension): schedules as data checked and simulated in this
-- process (1F1B's bubble is (p-1)/(m+p-1), interleaving divides it by v,
-- ZB-H1's is (p-1)/(3m+p-1), 1F1B and ZB-H1 keep at most p microbatches in
-- flight, ZB-H2 2p-1 and no gap inside a rank, hand-edited schedules that would hang or mis-order messages are
-- refused); then on 2 and 4 MPI ranks (spec/dist/pp_*.lua workers), tiny
-- float64 gpt2 and nanochat: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-H2
-- (their weight gradients deferred from B to W), 5 AdamW steps equal to one process accumulating the
-- same microbatches (loss, every gradient, every parameter), and a stage
-- that fails or dies ending every rank with the stage named; the trainer
-- (--pp, spec/dist/tp_train.lua's small float64 run): pp 2, pp 2 x dp 2
-- (ddp, zero1, zero2, fsdp), pp 2 x tp 2 (ddp, zero1, zero2) and pp 2 x dp 2 x tp 2 (8 ranks) equal one
-- process (losses, clipped norms, parameters), as do pp 2 x cp 2 (Ulysses,
-- ring) and pp 2 x tp 2 with sp (spec/dist/pp_seq_train.lua: one launch), and a pp 2 x tp 2
-- checkpoint (every stage writes its part) resumes in one process and at
-- pp 2 x dp 2 (zero1); a NaN in one stage's gradients makes every rank
-- skip the step; each pp rank holds exactly its stages' parameters (the
-- others are not allocated), and evaluates (through the stages) and
-- samples as one process does.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local mesh = require 'gptlua.dist.mesh'
local S = require 'gptlua.dist.schedules'
local PP = require 'gptlua.dist.pipeline'
local H = require 'support.mpi'
local DT = require 'support.dist_train'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local cjson = require 'cjson'

describe('pipeline schedules as data', function()
  it('1F1B and GPipe have the bubble (p-1)/(m+p-1), interleaved divides it by v', function()
    for _, p in ipairs({ 2, 4 }) do
      for _, m in ipairs({ 4, 8, 16 }) do
        local want = (p - 1) / (m + p - 1)
        assert.near(want, S.simulate(S.check(S.one_f_one_b(p, m))).bubble, 1e-12)
        assert.near(want, S.simulate(S.check(S.gpipe(p, m))).bubble, 1e-12)
        local il = S.simulate(S.check(S.interleaved(p, m, 2))).bubble
        assert.near(S.theory(p, m, 2), il, 1e-12)
        assert.is_true(il < want)
      end
    end
  end)

  it('1F1B holds at most p microbatches in flight per stage, GPipe all of them', function()
    local one, all = S.one_f_one_b(4, 16), S.gpipe(4, 16)
    for st = 1, 4 do
      assert.equal(4 - st + 1, S.in_flight(one, st))
      assert.equal(16, S.in_flight(all, st))
    end
  end)

  it('prints a timeline per rank with its bubble', function()
    local text = S.format(S.one_f_one_b(2, 2))
    assert.equal(table.concat({
      'schedule 1f1b: 2 ranks, 2 stages, 2 microbatches',
      'rank 0 |F1|F2|  |  |B1|B1|  |B2|B2|',
      'rank 1 |  |F1|B1|B1|F2|B2|B2|  |  |',
      'bubble 33.3% of 18 rank-units (F = 1, B = 2 units; theory (p-1)/(m+p-1), over v if interleaved: 33.3%)',
      'microbatches in flight per stage (activations held): 2 1' }, '\n'),
      text)
  end)

  it('refuses edited schedules that would hang, repeat, miss or mis-order actions', function()
    local s = S.one_f_one_b(2, 2)
    s.ranks[2][1], s.ranks[2][2] = s.ranks[2][2], s.ranks[2][1]   -- B1 before F1 on rank 1
    assert.has_error(function() S.check(s) end, 'pipeline schedule: rank 0 waits forever at B1 of stage 1 (action 3 of its list)')
    s = S.one_f_one_b(2, 2); table.remove(s.ranks[1])
    assert.has_error(function() S.check(s) end, 'pipeline schedule: B2 of stage 1 is missing')
    s = S.one_f_one_b(2, 2); s.ranks[1][#s.ranks[1]] = { 'B', 1, 1 }
    assert.has_error(function() S.check(s) end, 'pipeline schedule: B1 of stage 1 appears twice')
    s = S.one_f_one_b(2, 2); s.ranks[1][1] = { 'F', 1, 2 }
    assert.has_error(function() S.check(s) end, 'pipeline schedule: rank 0 action 1: stage 2 lives on rank 1')
    s = S.gpipe(2, 2); s.ranks[2][1], s.ranks[2][2] = { 'F', 2, 2 }, { 'F', 1, 2 }
    assert.has_error(function() S.check(s) end,
      'pipeline schedule: stage 2 runs F2 as its 1-th forward but stage 1 sent F1 then: messages arrive in order')
    assert.has_error(function() S.interleaved(4, 6, 2) end,
      'pipeline schedule: interleaved 1F1B needs microbatches a multiple of the 4 pipeline ranks, got 6')
    assert.has_error(function() S.make('zb', 2, 4) end, 'pipeline schedule: unknown schedule zb (expected gpipe, 1f1b, interleaved, zbh1 or zbh2)')
  end)

  it('ZB-H1 splits backward into B and W: bubble (p-1)/(3m+p-1), at most p in flight, W in the timeline', function()
    for _, p in ipairs({ 2, 4 }) do
      for _, m in ipairs({ 4, 8, 16 }) do
        local s = S.check(S.zbh1(p, m))
        assert.near((p - 1) / (3 * m + p - 1), S.simulate(s).bubble, 1e-12)
        assert.near(S.theory(p, m, 1, true), S.simulate(s).bubble, 1e-12)
        for st = 1, p do assert.equal(math.min(p, m), S.in_flight(s, st)) end
      end
    end
    assert.equal(table.concat({
      'schedule zbh1: 2 ranks, 2 stages, 3 microbatches',
      'rank 0 |F1|F2|  |B1|W1|F3|B2|W2|B3|W3|',
      'rank 1 |  |F1|B1|F2|B2|W1|F3|B3|W2|W3|',
      'bubble 10.0% of 20 rank-units (F = 1, B = 1, W = 1 units; theory (p-1)/(3m+p-1): 10.0%)',
      'microbatches in flight per stage (activations held): 2 2' }, '\n'),
      (S.format(S.zbh1(2, 3))))
    local s = S.zbh1(2, 2); table.remove(s.ranks[1])
    assert.has_error(function() S.check(s) end, 'pipeline schedule: W2 of stage 1 is missing')
    s = S.zbh1(2, 2); s.ranks[1][3], s.ranks[1][4] = s.ranks[1][4], s.ranks[1][3]  -- W1 before B1
    assert.has_error(function() S.check(s) end, 'pipeline schedule: rank 0 waits forever at W1 of stage 1 (action 3 of its list)')
  end)

  it('ZB-H2 holds up to 2p-1 microbatches in flight: no gap inside any rank, the step bubble ZB-H1\'s', function()
    for _, p in ipairs({ 2, 4 }) do
      for _, m in ipairs({ 4, 8, 16 }) do
        local s = S.check(S.zbh2(p, m))
        local sim, h1 = S.simulate(s), S.simulate(S.zbh1(p, m))
        -- a synchronised step: the last rank starts p-1 units late whatever the order, as in ZB-H1
        assert.near((p - 1) / (3 * m + p - 1), sim.bubble, 1e-12)
        assert.near(h1.bubble, sim.bubble, 1e-12)
        -- steps overlapping: ZB-H1 keeps its bubble, ZB-H2 has none once m fills the 2p-1 warm-up
        assert.near(h1.bubble, h1.steady, 1e-12)
        if m >= 2 * p - 1 then assert.near(0, sim.steady, 1e-12) end
        for st = 1, p do assert.equal(math.min(2 * p - 1, m), S.in_flight(s, st)) end
      end
    end
    -- the paper's figure 3 (p = 4, m = 8): 7 warm-up forwards on the first rank, the last one's W's postponed
    local s = S.zbh2(4, 8)
    local function ops(l) local t = {} for _, a in ipairs(l) do t[#t + 1] = a[1] .. a[2] end return table.concat(t, ' ') end
    assert.equal('F1 F2 F3 F4 F5 F6 F7 B1 W1 B2 F8 B3 W2 B4 W3 B5 W4 B6 W5 B7 W6 W7 B8 W8', ops(s.ranks[1]))
    assert.equal('F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 W1 F8 B8 W2 W3 W4 W5 W6 W7 W8', ops(s.ranks[4]))
    assert.equal(table.concat({
      'schedule zbh2: 2 ranks, 2 stages, 4 microbatches',
      'rank 0 |F1|F2|F3|B1|W1|B2|F4|B3|W2|W3|B4|W4|  |',
      'rank 1 |  |F1|B1|F2|B2|F3|B3|W1|F4|B4|W2|W3|W4|',
      'bubble 7.7% of 26 rank-units (F = 1, B = 1, W = 1 units; theory (p-1)/(3m+p-1): 7.7%)',
      'bubble 0.0% when steps overlap (each rank goes on to the next step as its own part ends)',
      'microbatches in flight per stage (activations held): 3 3' }, '\n'),
      (S.format(S.zbh2(2, 4))))
    -- measured action times replace the units (recipes/tools/bench_pipeline.lua replays a step so)
    local one = S.one_f_one_b(2, 2)
    local each = { { 1, 1, 5, 5 }, { 1, 5, 1, 5 } }  -- rank 0 runs F1 F2 B1 B2, rank 1 F1 B1 F2 B2; F 1, B 5
    -- rank 1: F1 at 1-2, B1 2-7, F2 7-8, B2 8-13; rank 0's B2 13-18
    assert.equal(18, S.simulate(one, { each = each }).time)
  end)
end)

describe('the pp mesh dimension and stage partition in one process', function()
  it('puts pp outermost and checks it against the world', function()
    assert.same({ pp = 2, dp = 2, cp = 1, tp = 2 }, mesh.sizes({ pp = 2, tp = 2 }, 8))
    assert.same({ pp = 4, dp = 1, cp = 1, tp = 1 }, mesh.sizes({ pp = 4 }, 4))
    assert.has_error(function() mesh.sizes({ pp = 3 }, 4) end,
      'dist.mesh: pp 3 x cp 1 x tp 1 = 3 does not divide the world of 4 ranks')
    assert.has_error(function() mesh.sizes({ pp = 2, dp = 4 }, 4) end,
      'dist.mesh: pp 2 x dp 4 x cp 1 x tp 1 = 8 ranks, but the world has 4')
    assert.same({ pp = 4, dp = 2, cp = 1, tp = 1 }, mesh.strides({ pp = 2, dp = 2, cp = 2, tp = 1 }))
  end)

  it('balances blocks by parameters or FLOPs, takes counts or a hook, refuses bad cuts', function()
    gl.manual_seed(1)
    local model = require('gptlua.models.gpt2').GPT({ vocab_size = 16, block_size = 8, n_layer = 5, n_head = 2,
      n_embd = 8 })
    assert.same({ 1, 2, 2 }, PP.partition(model, 3))
    assert.same({ 1, 2, 2 }, PP.partition(model, 3, 'flops', 8))
    assert.same({ 1, 1, 3 }, PP.partition(model, 3, { 1, 1, 3 }))
    assert.same({ 4, 1 }, PP.partition(model, 2, function(costs, n) assert.equal(5, #costs); return { 4, 1 } end))
    assert.has_error(function() PP.partition(model, 6) end, 'pipeline: 5 blocks cannot fill 6 stages (each needs one)')
    assert.has_error(function() PP.partition(model, 2, { 5, 0 }) end,
      'pipeline: partition: stage 2 expected a positive block count, got 0')
    assert.has_error(function() PP.partition(model, 2, { 2, 2 }) end,
      'pipeline: partition: 2 counts summing to 4, expected 2 stages summing to the 5 blocks')
    assert.has_error(function() PP.partition(model, 2, 'size') end,
      'pipeline: partition expected params, flops, a list of block counts or a function, got size')
  end)

  it('refuses pipeline settings it cannot run, in one line', function()
    local recipe = dofile(H.ROOT .. '/spec/dist/tp_recipe.lua')
    local function err(args)
      local ok, e = pcall(train.new, recipe('gpt2', { max_iters = 1 }), args)
      assert.is_false(ok)
      return tostring(e)
    end
    assert.equal("config: pp 2 needs a distributed run (dist = 'ddp')", err({ '--pp=2' }))
    assert.equal("config: unknown pp_schedule 'zb' (expected 'gpipe', '1f1b', 'interleaved', 'zbh1' or 'zbh2')",
      err({ '--pp_schedule=zb' }))
    assert.equal("config: unknown pp_partition 'size' (expected 'params' or 'flops'; a recipe's pp_partition hook cuts "
      .. 'by hand)', err({ '--pp_partition=size' }))
    assert.equal('config: pp must be an integer in [1, 2147483647], got 0', err({ '--pp=0' }))
  end)

  it("checkpoint.load merges a pipeline checkpoint's stage parts and refuses bad part lists in one line", function()
    local dir = H.tmpdir()
    local path = ckpt.save(dir, 1, { model = { a = gl.ones({ 2 }) }, optim = { ['adamw.a.m'] = gl.zeros({ 2 }) },
      state = { config = {} } })
    ckpt.save_safetensors(path .. '/model.pp00001.safetensors', { b = gl.full({ 3 }, 2) })
    ckpt.save_safetensors(path .. '/optim.pp00001.safetensors', { ['adamw.b.m'] = gl.zeros({ 3 }) })
    local f = assert(io.open(path .. '/state.json')); local st = cjson.decode(f:read('*a')); f:close()
    local function with(parts)
      st.parts = parts
      f = assert(io.open(path .. '/state.json', 'wb')); f:write(cjson.encode(st)); f:close()
      local ok, c = pcall(ckpt.load, path)
      return ok and c or tostring(c)
    end
    for _, n in ipairs({ 'model.pp00001.safetensors', 'optim.pp00001.safetensors' }) do
      st.files[n] = ckpt.checksum(path .. '/' .. n)
    end
    local c = with({ model = { 'model.pp00001.safetensors' }, optim = { 'optim.pp00001.safetensors' } })
    assert.same({ 1, 1 }, c.model.a:tolist())
    assert.same({ 2, 2, 2 }, c.model.b:tolist())
    assert.same({ 0, 0, 0 }, c.optim['adamw.b.m']:tolist())
    assert.equal(('checkpoint: %s/state.json field parts.model expected files listed in files, got the string '
      .. "'x.safetensors'; not loaded"):format(path), with({ model = { 'x.safetensors' } }))
    assert.equal(('checkpoint: %s/state.json field parts expected an object of file lists, got 3; not loaded')
      :format(path), with(3))
    assert.equal(('checkpoint: %s: a is in two of its files; not loaded'):format(path),
      with({ model = { 'model.pp00001.safetensors', 'model.safetensors' } }))
    os.execute('rm -rf ' .. dir)
  end)

  it('a pipeline of one rank is the whole model', function()
    gl.manual_seed(1)
    local model = require('gptlua.models.gpt2').GPT({ vocab_size = 16, block_size = 8, n_layer = 2, n_head = 2,
      n_embd = 8 }):to('float64')
    local pipe = PP.new(model, dist.mesh({}).pp, { schedule = '1f1b', microbatches = 2, batch = { 1, 8 } })
    assert.equal(#model:parameters(), #pipe.params)
    assert.equal('Pipeline(1f1b, 1 stages over 1 ranks, 2 microbatches; rank 0: stage 1: blocks 1-2)', tostring(pipe))
    local x = gl.tensor({ { 1, 2, 3, 4, 5, 6, 7, 8 } }, { dtype = 'int64' })
    local y = gl.tensor({ { 2, 3, 4, 5, 6, 7, 8, 9 } }, { dtype = 'int64' })
    local _, want = model:forward(x, y)
    assert.near(want:item(), pipe:step({ x, x }, { y, y }), 1e-12)
    -- B frees each op's output as it goes (free_activations): without the GC, little of a step stays
    -- allocated (4.5 KiB: loss scalars; 28.5 KiB when the activations waited for the GC)
    collectgarbage('collect'); collectgarbage('stop')
    local before = gl.memory_stats().allocated
    pipe:step({ x, x }, { y, y })
    local left = gl.memory_stats().allocated - before
    collectgarbage('restart')
    assert.is_true(left < 8192, ('%d bytes of the step are still allocated'):format(left))
    -- ZB-H1's B leaves the blocks' weight gradients queued (attention's 2 linears and the mlp a block, 2 blocks), W runs them
    local zb = PP.new(model, dist.mesh({}).pp, { schedule = 'zbh1', microbatches = 2, batch = { 1, 8 } })
    local queued = {}
    zb.on_action = function(at, a)
      if at == 'end' then queued[#queued + 1] = a[1] .. a[2] .. ':' .. #(zb.stages[1].deferred[a[2]] or {}) end
    end
    for _, prm in ipairs(model:parameters()) do prm.grad = nil end
    assert.near(want:item(), zb:step({ x, x }, { y, y }), 1e-12)
    assert.same({ 'F1:0', 'B1:6', 'W1:0', 'F2:0', 'B2:6', 'W2:0' }, queued)
    assert.has_error(function() PP.new(model, dist.mesh({}).pp, { microbatches = 2 }) end,
      'pipeline: batch expected {B, T}, the microbatch shape')
  end)
end)

describe('gptlua --plan with --pp', function()
  it("runs the pipeline on the meta device, prints the schedule as a timeline with its bubble and the rank's own "
    .. 'parameters', function()
    local recipe = dofile(H.ROOT .. '/spec/dist/tp_recipe.lua')
    local r = require('gptlua.plan').plan(recipe('gpt2', { max_iters = 1 }), { world = 2, rank = 1,
      args = { '--pp=2', '--dist=ddp' } })
    assert.truthy(r.text:find('Pipeline(1f1b, 2 stages over 2 ranks, 4 microbatches; rank 1: stage 2: blocks 2-2)', 1,
      true), r.text)
    assert.truthy(r.text:find('rank 1 |  |F1|B1|B1|F2|B2|B2|F3|B3|B3|F4|B4|B4|  |  |', 1, true), r.text)
    assert.truthy(r.text:find('bubble 20.0% of', 1, true), r.text)
    -- rank 1 holds its stage's parameters only: block 1, ln_f and the tied wte, 14944 float64 elements (the
    -- whole model's 28160), in the allocator's size classes
    assert.is_true(r.bytes.parameters >= 14944 * 8 and r.bytes.parameters < 14944 * 8 * 1.05, r.text)
    r = require('gptlua.plan').plan(recipe('gpt2', { max_iters = 1 }), { world = 2, rank = 0,
      args = { '--pp=2', '--dist=ddp', '--pp_schedule=zbh1' } })
    assert.truthy(r.text:find('rank 0 |F1|F2|  |B1|W1|F3|B2|W2|F4|B3|W3|B4|W4|', 1, true), r.text)
    assert.truthy(r.text:find('bubble 7.7% of 26 rank-units (F = 1, B = 1, W = 1 units', 1, true), r.text)
    r = require('gptlua.plan').plan(recipe('gpt2', { max_iters = 1, n_layer = 4 }), { world = 4, rank = 3,
      args = { '--pp=4', '--dist=ddp', '--pp_schedule=zbh2' } })
    assert.truthy(r.text:find('Pipeline(zbh2, 4 stages over 4 ranks, 4 microbatches; rank 3: stage 4: blocks 4-4)', 1,
      true), r.text)
    assert.truthy(r.text:find('rank 3 |  |  |  |F1|B1|F2|B2|F3|B3|F4|B4|W1|W2|W3|W4|', 1, true), r.text)
    assert.truthy(r.text:find('microbatches in flight per stage (activations held): 4 4 4 4', 1, true), r.text)
  end)

  it("takes a recipe's own schedule (the pp_schedule hook), checked before it runs", function()
    local recipe = dofile(H.ROOT .. '/spec/dist/tp_recipe.lua')
    local rec = recipe('gpt2', { max_iters = 1 })
    rec.pp_schedule = function(p, m, v)
      local s = S.one_f_one_b(p, m)
      s.name = 'edited'
      return s
    end
    local r = require('gptlua.plan').plan(rec, { world = 2, rank = 0, args = { '--pp=2', '--dist=ddp' } })
    assert.truthy(r.text:find('schedule edited: 2 ranks, 2 stages, 4 microbatches', 1, true), r.text)
    rec.pp_schedule = function() return { ranks = {} } end
    local ok, err = pcall(require('gptlua.plan').plan, rec, { world = 2, args = { '--pp=2', '--dist=ddp' } })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('pipeline schedule: ranks_n expected a positive integer, got nil', 1, true), err)
  end)
end)

describe('pipeline parallelism on MPI ranks', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end

  it('GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-H2 on 2 and 4 stages: 5 steps equal one process accumulating the microbatches',
    function()
    for _, case in ipairs({ { 2, '1f1b 4 1' }, { 2, 'gpipe 4 1' }, { 2, 'interleaved 4 2' }, { 4, '1f1b 4 1' },
                            { 4, 'gpipe 4 1' }, { 4, 'interleaved 8 2' }, { 2, 'zbh1,zbh2 4 1' },
                            { 4, 'zbh1,zbh2:8 4 1' } }) do
      local o, rc = H.mpirun(case[1], 'spec/dist/pp_grads.lua', ('%d %s gpt2 nanochat'):format(case[1], case[2]))
      H.assert_ranks_ok(o, rc, case[1])
    end
  end)

  it('recipes/tools/bench_pipeline.lua measures every schedule (shrunk)', function()
    local o, rc = H.sh(('%s recipes/tools/bench_pipeline.lua --ps=2 --ms=2 --steps=1 --n_layer=4 --n_embd=16 --block_size=8')
      :format(H.EXE), 120)
    assert.equal(0, rc, o)
    for _, name in ipairs({ 'gpipe          2   2 |', '1f1b           2   2 |', 'interleaved v2 2   2 |',
                            'zbh1           2   2 |', 'zbh2           2   2 |' }) do
      -- step ms | wall | replay | theory | overlap | peaks: the theory is the schedule's, the replay a bubble
      local row = o:match(name:gsub('%p', '%%%0') .. '([^\n]*)')
      assert.truthy(row, o)
      local _, replay, theory = row:match('^%s*[%d.]+ |%s*%(?([%d.]+)%%%)? |%s*([%d.]+)%% |%s*([%d.]+)%% |')
      assert.truthy(theory, row)
      assert.near(100 * S.simulate(S.make(name:match('^(%S+)'), 2, 2, name:find('v2') and 2 or 1)).bubble,
        tonumber(theory), 0.05)
      assert.is_true(tonumber(replay) >= 0 and tonumber(replay) < 100, row)
    end
    o, rc = H.sh(H.EXE .. ' recipes/tools/bench_pipeline.lua --ms=x', 30)
    assert.not_equal(0, rc)
    assert.truthy(o:find('bench_pipeline: --ms expected numbers, got x', 1, true), o)
  end)

  it('a stage that raises or dies ends every rank, naming the stage', function()
    local o, rc = H.mpirun(2, 'spec/dist/pp_error.lua', 'error', 60)
    assert.not_equal(0, rc)
    assert.truthy(o:find('pipeline stage 2 (pp rank 1) failed at F2: ', 1, true), o)
    assert.truthy(o:find('injected failure', 1, true), o)
    assert.falsy(o:find('NOT REACHED', 1, true), o)
    o, rc = H.mpirun(2, 'spec/dist/pp_error.lua', 'die', 60)
    assert.not_equal(0, rc)
    assert.falsy(o:find('NOT REACHED', 1, true), o)
  end)
end)

-- --------------------------------------------------------- the trainer --
local function result(dir) return H.read_json(dir .. '/result.json') end
local grad_norms = DT.grad_norms  -- (spec/support/dist_train.lua: the rule runs:check holds a run to)

describe('the trainer with --pp on MPI ranks', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local recipe = dofile(H.ROOT .. '/spec/dist/tp_recipe.lua')

  it('pp 2 (gpt2, nanochat; 1F1B, GPipe and ZB-H1), pp 2 x dp 2 (ddp, zero1, zero2, fsdp), pp 2 x tp 2 (ddp, zero1, zero2) and '
    .. 'pp 2 x dp 2 x tp 2 train as '
    .. 'one process; a pp 2 x tp 2 checkpoint loads into pp 1 and pp 2 x dp 2 (zero1); a NaN on one stage skips the step '
    .. 'everywhere', function()
    local runs = DT.new(out)
    for _, model in ipairs({ 'gpt2', 'nanochat' }) do
      local cases = model == 'gpt2' and { { 2, '--pp=2 --dist=ddp' }, { 4, '--pp=2 --dp=2 --dist=ddp' },
        { 4, '--pp=2 --dp=2 --dist=zero1' }, { 4, '--pp=2 --dp=2 --dist=zero2' }, { 4, '--pp=2 --dp=2 --dist=fsdp' },
        { 2, '--pp=2 --dist=ddp --pp_schedule=gpipe' },
        { 4, '--pp=2 --tp=2 --dist=ddp' }, { 4, '--pp=2 --tp=2 --dist=zero1' }, { 4, '--pp=2 --tp=2 --dist=zero2' },
        { 2, '--pp=2 --dist=ddp --pp_schedule=zbh1' } }
        or { { 2, '--pp=2 --dist=ddp' }, { 8, '--pp=2 --dp=2 --tp=2 --dist=ddp' } }
      for _, case in ipairs(cases) do
        local dir = ('%s/%s_%d_%s'):format(out, model, case[1], case[2]:gsub('[^%w]', ''))
        local o, rc = H.mpirun(case[1], 'spec/dist/tp_train.lua', ('%s %s 5 %s'):format(dir, model, case[2]))
        H.assert_ranks_ok(o, rc, case[1])
        local r = result(dir)
        -- (FSDP reduces float64 gradients in float32)
        runs:check({ ranks = case[1], model = model, reduce = case[2]:match('fsdp') and 'float32' or nil },
          { losses = r.losses, norms = grad_norms(dir), checkpoint = r.checkpoint, what = model .. ' ' .. case[2] })
      end
      if model == 'gpt2' then
        -- pp 2 x tp 2 saves at step 3 (the whole model); one process, and pp 2 x dp 2, go on to 5
        local o, rc = H.mpirun(4, 'spec/dist/tp_train.lua', out .. '/resume_a gpt2 3 --pp=2 --tp=2 --dist=ddp')
        H.assert_ranks_ok(o, rc, 4)
        local step3 = result(out .. '/resume_a').checkpoint
        local t1 = train.new(recipe('gpt2', { out_dir = out .. '/resume_a1', max_iters = 5 }), { '--resume=' .. step3 })
        runs:check_resumed({ ranks = 4, model = 'gpt2' }, DT.local_result(t1, t1:run(), out .. '/resume_a1',
          'pp 2 x tp 2 -> 1'), 4)
        o, rc = H.mpirun(4, 'spec/dist/tp_train.lua', ('%s/resume_b gpt2 5 --pp=2 --dp=2 --dist=zero1 --resume=%s'):format(
          out, step3))
        H.assert_ranks_ok(o, rc, 4)
        local rb = result(out .. '/resume_b')
        runs:check_resumed({ ranks = 4, model = 'gpt2' }, { losses = rb.losses, norms = grad_norms(out .. '/resume_b'),
          checkpoint = rb.checkpoint, what = 'pp 2 x tp 2 -> pp 2 x dp 2 zero1' }, 4)
      end
    end
    -- a NaN in one stage's gradients: every rank skips the step
    local o, rc = H.mpirun(2, 'spec/dist/pp_nan.lua', out .. '/nan')
    H.assert_ranks_ok(o, rc, 2, ': 2 steps taken')
    -- (it also checked each rank's parameter bytes:) its evaluation through the stages and its sample equal one process's
    local one = train.new(recipe('gpt2', { max_iters = 3, out_dir = out .. '/nan_one', eval_iters = 2 }), {})
    local ev, got = one:evaluate(), H.read_json(out .. '/nan/eval.json')
    assert.near(ev.train, got.train, 1e-12 * ev.train)
    assert.near(ev.val, got.val, 1e-12 * ev.val)
    local tok = one.data.tokenizer
    one.data.tokenizer = setmetatable({ decode = function(_, ids) return table.concat(ids, ' ') end }, { __index = tok })
    assert.equal(one:sample(12), got.sample)
    -- what is not composed yet is refused in one line, by rank 0 alone (gptlua.dist.compose)
    o, rc = H.mpirun(4, 'spec/dist/tp_train.lua', out .. '/bad gpt2 1 --pp=2 --tp=2 --dist=diloco')
    assert.not_equal(0, rc)
    local line = "config: dist 'diloco' with pp and tp > 1 is not supported"
    local at = o:find(line, 1, true)
    assert.truthy(at, o)
    assert.is_nil(o:find(line, at + 1, true), o)
    assert.is_nil(o:find('traceback', 1, true), o)
  end)

  it('pp 2 x cp 2 (Ulysses: gpt2, ring: nanochat with ZB-H2) and pp 2 x tp 2 with sp (ZB-H1: gpt2) train as one '
    .. 'process, in one launch', function()
    local runs = { 'uly:gpt2:--pp=2,--cp=2,--dist=ddp',
      'ring:nanochat:--pp=2,--cp=2,--cp_mode=ring,--dist=ddp,--pp_schedule=zbh2',
      'sp:gpt2:--pp=2,--tp=2,--sp,--dist=ddp,--pp_schedule=zbh1', 'nsp:nanochat:--pp=2,--tp=2,--sp,--dist=ddp' }
    local o, rc = H.mpirun(4, 'spec/dist/pp_seq_train.lua', ('%s/seq 3 %s'):format(out, table.concat(runs, ' ')))
    H.assert_ranks_ok(o, rc, 4)
    local seq_refs = DT.new(out)
    for _, run in ipairs(runs) do
      local name, model = run:match('^([^:]+):([^:]+):')
      local dir = out .. '/seq/' .. name
      local r = result(dir)
      seq_refs:check({ ranks = 4, model = model }, { losses = r.losses, norms = grad_norms(dir), checkpoint = r.checkpoint,
        what = run }, { max_iters = 3 })
    end
  end)
end)
