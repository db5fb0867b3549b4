-- Data parallelism for slow links (gptlua.dist.policies: localsgd, diloco,
-- ps, ddp's PowerSGD hook).  In one process: the config checks.  On 2 MPI
-- ranks (spec/dist/avg_run.lua, the small GPT of policy_recipe.lua in
-- float64): each policy in its DDP-equivalent setting matches DDP (localsgd
-- sync_every 1 and diloco H 1 / outer lr 1 / no momentum with plain SGD;
-- full-rank PowerSGD; synchronous ps on 1 and 2 servers with AdamW and
-- clipping); each resumes exactly from a checkpoint in the middle of a
-- round; asynchronous ps on 3 ranks keeps its staleness bound with a slow
-- worker; and the bytes each rank sends shrink as the policy says.
local gl = require 'gptlua'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'

local H = require 'support.mpi'
local recipe = dofile(H.ROOT .. '/spec/dist/policy_recipe.lua')

describe('slow-link policies: config', function()
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)

  local function refuses(over, msg)
    local r = recipe(over)
    r.out_dir = out
    assert.has_error(function() train.new(r, {}) end, msg)
  end

  it('refuses bad keys with one line naming the key and the expected value', function()
    refuses({ dist = 'localsgd', sync_every = 0 }, 'config: sync_every must be an integer in [1, 9007199254740992], got 0')
    refuses({ dist = 'diloco', outer_lr = 0 }, 'config: outer_lr expected a number > 0, got 0')
    refuses({ dist = 'diloco', outer_momentum = 1 }, 'config: outer_momentum expected a number >= 0 and < 1, got 1')
    refuses({ dist = 'diloco', outer_dtype = 'float16' }, "config: outer_dtype expected 'float32' or 'bfloat16', got float16")
    refuses({ dist = 'diloco', sync_every = 2, diloco_fragments = 3 },
      'config: diloco_fragments expected at most sync_every (2) and the number of parameter tensors (15), got 3')
    refuses({ dist = 'zero1', powersgd_rank = 4 },
      "config: powersgd_rank is a communication hook of dist = 'ddp', got dist = 'zero1'")
    refuses({ dist = 'ps', ps_servers = 2 }, 'config: ps_servers expected at most the number of ranks (1), got 2')
  end)
end)

describe('slow-link policies over MPI ranks', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)

  local n = 0
  -- runs avg_run.lua on 2 ranks with the key=value arguments; returns
  -- rank 0's {losses, comm_bytes, metrics} and final parameters
  local function run(args, dir)
    n = n + 1
    dir = dir or ('%s/run%d'):format(out, n)
    os.execute('mkdir -p ' .. dir)
    local o, rc = H.mpirun(2, 'spec/dist/avg_run.lua', dir .. ' dtype=float64 ' .. args)
    H.assert_ranks_ok(o, rc, 2)
    return H.read_json(dir .. '/losses.json'), ckpt.load_safetensors(dir .. '/params.safetensors'), dir
  end

  local function same(want, got, what, tol)
    for i = 1, #want.losses do
      local rel = math.abs(want.losses[i] - got.losses[i]) / math.abs(want.losses[i])
      assert.is_true(rel <= tol, ('%s: step %d loss %.15g, expected %.15g'):format(what, i, got.losses[i], want.losses[i]))
    end
    assert.equal(#want.losses, #got.losses, what)
  end

  local function same_params(want, got, what, tol)
    local e = H.rel_error(want, got)
    assert.is_true(e <= tol, ('%s: final parameters differ, relative error %.3g'):format(what, e))
  end

  it('localsgd (sync_every 1), diloco (H 1, outer lr 1, no momentum) and full-rank PowerSGD with SGD equal DDP', function()
    local base = 'optimizer=sgd max_iters=6 '
    local ddp, ddp_p = run(base .. 'dist=ddp')
    for _, a in ipairs({ 'dist=localsgd sync_every=1', 'dist=diloco sync_every=1 outer_lr=1 outer_momentum=0',
                         'dist=ddp powersgd_rank=1000' }) do
      local got, p = run(base .. a)
      same(ddp, got, a, 1e-12)
      same_params(ddp_p, p, a, 1e-10)
    end
  end)

  it('synchronous parameter servers (1 and 2 servers, AdamW, clipping) equal DDP', function()
    local base = 'max_iters=6 grad_clip=0.5 '
    local ddp, ddp_p = run(base .. 'dist=ddp')
    for _, a in ipairs({ 'dist=ps ps_servers=1', 'dist=ps ps_servers=2' }) do
      local got, p = run(base .. a)
      same(ddp, got, a, 1e-12)
      same_params(ddp_p, p, a, 1e-12)
    end
  end)

  -- 6 steps with a checkpoint every 3 (step 3 is mid-round for H = 4), and
  -- the same run resumed from step 3: the last 3 losses and the final
  -- parameters must agree exactly
  it('each policy resumes exactly from a checkpoint in the middle of a round', function()
    for _, a in ipairs({ 'dist=localsgd sync_every=4', 'dist=diloco sync_every=4 outer_momentum=0.9',
                         'dist=diloco sync_every=4 diloco_fragments=2 outer_dtype=bfloat16 optimizer=nanochat',
                         'dist=ddp powersgd_rank=2', 'dist=ps ps_servers=2' }) do
      local args = 'max_iters=6 checkpoint_interval=3 keep_last=5 ' .. a
      local full, want, dir = run(args)
      local step3 = dir .. '/p/checkpoints/step_0000003'
      local st = H.read_json(step3 .. '/state.json')
      assert.equal(2, st.shards and st.shards.world, a)
      local tail, got = run(args .. ' resume=' .. step3)
      same({ losses = { full.losses[4], full.losses[5], full.losses[6] } }, tail, a .. ' resumed', 0)
      same_params(want, got, a .. ' resumed', 0)
      if a:match('localsgd') then   -- local state of 2 ranks: not on 3
        local o, rc = H.mpirun(3, 'spec/dist/avg_run.lua', out .. '/r3 dtype=float64 ' .. args .. ' resume=' .. step3)
        assert.is_true(rc ~= 0)
        assert.truthy(o:find(('resume: checkpoint %s holds the local state of 2 localsgd ranks; resume it on 2 ranks, '
          .. 'not 3'):format(step3), 1, true), o)
      end
    end
  end)

  -- 3 ranks, two servers (every push reaches both: rank 0 records them all), rank 2 sleeps 200 ms
  -- before each batch: the two fast workers must run ahead of it (more
  -- than one update each between two of its updates; in lock step they
  -- would make exactly one each) and no applied update may be more than k
  -- versions stale.  Asynchronous runs do not repeat exactly; the loss rank
  -- 0 computes right after a checkpoint's quiesce does.
  it('asynchronous ps: staleness never exceeds max_staleness, fast workers run ahead of a slow one, resumes', function()
    local k = 6
    local dir = out .. '/async'
    os.execute('mkdir -p ' .. dir)
    local args = ('dtype=float64 max_iters=12 dist=ps ps_servers=2 max_staleness=%d slow=2:200 checkpoint_interval=6 keep_last=5')
      :format(k)
    local o, rc = H.mpirun(3, 'spec/dist/avg_run.lua', dir .. ' ' .. args)
    H.assert_ranks_ok(o, rc, 3)
    local res = H.read_json(dir .. '/losses.json')
    assert.equal(3 * 12, #res.ps_log)
    local applied, slow, ahead = 0, 0, 0
    local since_slow = 0
    for _, e in ipairs(res.ps_log) do
      local worker, staleness, dropped = e[1], e[2], e[3]
      if not dropped then
        applied = applied + 1
        assert.is_true(staleness <= k, ('an update of worker %d applied %d versions stale'):format(worker, staleness))
        if worker == 2 then
          slow = slow + 1
          ahead = math.max(ahead, since_slow)
          since_slow = 0
        else since_slow = since_slow + 1 end
      end
    end
    assert.is_true(slow >= 6, 'the slow worker had ' .. slow .. ' updates applied')
    assert.is_true(ahead > 2, 'the fast workers made at most ' .. ahead .. ' updates between two of the slow one')
    local max = 0
    for _, m in ipairs(res.metrics) do max = math.max(max, m.staleness_max) end
    assert.is_true(max > 0 and max <= k, 'recorded staleness_max ' .. max)
    -- (rank 0 logs its last step before the others' last updates arrive)
    local logged = res.metrics[#res.metrics].updates
    assert.is_true(logged > 12 and logged <= applied, ('%d updates logged, %d applied'):format(logged, applied))
    local step6 = dir .. '/p/checkpoints/step_0000006'
    assert.is_table(H.read_json(step6 .. '/state.json').ps_versions)
    local rdir = out .. '/async_resumed'
    os.execute('mkdir -p ' .. rdir)
    o, rc = H.mpirun(3, 'spec/dist/avg_run.lua', rdir .. ' ' .. args .. ' resume=' .. step6)
    H.assert_ranks_ok(o, rc, 3)
    local tail = H.read_json(rdir .. '/losses.json').losses
    assert.equal(6, #tail)
    assert.equal(res.losses[7], tail[1])
  end)

  it('sends fewer bytes per rank: localsgd 1/H of DDP, bfloat16 outer gradients half, PowerSGD rank 2 less', function()
    local base = 'max_iters=8 '
    local ddp = run(base .. 'dist=ddp')
    local lsgd = run(base .. 'dist=localsgd sync_every=4')
    local dil32 = run(base .. 'dist=diloco sync_every=4')
    local dil16 = run(base .. 'dist=diloco sync_every=4 outer_dtype=bfloat16')
    local psgd = run(base .. 'dist=ddp powersgd_rank=2')
    -- X: one all-reduce of the float64 parameters on 2 ranks (2 * 1/2 * 8P
    -- bytes).  Beside it every run sends the same: rank 0's first broadcast
    -- of the weights, each step's {loss, stop}.  DDP: 8 X, localsgd: 2 X.
    local X = (ddp.comm_bytes - lsgd.comm_bytes) / 6
    assert.is_true(X > 0)
    assert.near(lsgd.comm_bytes, dil32.comm_bytes, 1e-6)
    -- float64 parameters travel as bfloat16: a quarter of the bytes
    assert.near(lsgd.comm_bytes - 2 * X * 3 / 4, dil16.comm_bytes, 1e-6)
    assert.is_true(psgd.comm_bytes < ddp.comm_bytes / 4, ('%d vs %d'):format(psgd.comm_bytes, ddp.comm_bytes))
    -- the round position and the averagings are in the metrics
    local last = lsgd.metrics[#lsgd.metrics]
    assert.equal(0, last.round_step)
    assert.equal(2, last.syncs)
  end)
end)
