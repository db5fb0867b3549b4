-- gptlua.dist policies (DDP, ZeRO-1/2 sharded AdamW and Muon): bucketing,
-- hook-driven launches, gradient accumulation and checkpoint conversions in
-- this process (a world of one); then, on 2 and 3 MPI ranks
-- (spec/dist/policy_*.lua workers): equivalence with one process running N
-- times the gradient accumulation, optimizer-state bytes per rank,
-- checkpoints re-sharded from 2 to 3 ranks, the overlap benchmark, and the
-- default recipe end to end.  bfloat16 models under ZeRO (fp32 master
-- shards): equivalence and master bytes on 2 ranks, checkpoints between
-- ZeRO and unsharded runs both ways.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local B = require 'gptlua.dist.policies.base'
local shards = require 'gptlua.dist.policies.shards'
local cjson = require 'cjson'

local H = require 'support.mpi'
local ROOT, EXE, MPIRUN = H.ROOT, H.EXE, H.MPIRUN
local recipe = dofile(ROOT .. '/spec/dist/policy_recipe.lua')

local sh, mpirun = H.sh, H.mpirun
local tmpdir = H.tmpdir
local read_json = H.read_json



-- the gradient norms of every step in a run's metrics.jsonl
local function grad_norms(run_dir)
  local out = {}
  for line in io.lines(run_dir .. '/p/metrics.jsonl') do
    local m = cjson.decode(line)
    if m.grad_norm then out[#out + 1] = m.grad_norm end
  end
  return out
end

local state_of = H.params_of

local rel_error = H.rel_error

local function assert_losses(want, got, what, quantity, tol)
  assert.equal(#want, #got, what)
  for i = 1, #want do
    local rel = math.abs(want[i] - got[i]) / math.abs(want[i])
    assert.is_true(rel < (tol or 1e-5), ('%s: step %d %s %.9g, expected %.9g (relative error %.2g)'):format(
      what, i, quantity or 'loss', got[i], want[i], rel))
  end
end

local function assert_params(want, got, what)
  local e = rel_error(want, got)
  assert.is_true(e < 1e-5, ('%s: final parameters differ, relative error %.3g'):format(what, e))
end

-- ---------------------------------------------------------- one process --
describe('gptlua.dist policies in one process', function()
  local out = tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)

  it('refuses unknown policies, bad options and optimizers ZeRO cannot shard', function()
    assert.has_error(function() dist.policy('zero3', {}) end,
      "dist.policy: unknown policy zero3 (expected 'ddp', 'zero1', 'zero2', 'fsdp', 'hsdp', 'localsgd', 'diloco' or 'ps')")
    assert.has_error(function() dist.policy('ddp', { params = {}, optimizer = {} }) end,
      'dist.policy: ddp expected opts.params, a non-empty list of parameters')
    local p = gl.zeros({ 4 }):requires_grad_()
    assert.has_error(function() dist.policy('zero1', { params = { p } }) end,
      'dist.policy: zero1 expected opts.optimizer, an optimizer with step()')
    assert.has_error(function()
      dist.policy('ddp', { params = { p }, optimizer = { step = function() end }, bucket_mb = 0 })
    end, 'dist.policy: ddp expected bucket_mb > 0, got 0')
    assert.has_error(function()
      dist.policy('zero2', { params = { p }, optimizer = { step = function() end, groups = {} } })
    end, "dist.policy: zero2 shards optim.AdamW and optim.Muon (alone or in optim.Combined), "
      .. "got another optimizer; use dist = 'ddp' for it")
    local world = dist.init()
    assert.equal(5, world:all_reduce_number(5, 'avg'))
    assert.has_error(function() world:all_reduce_number('x') end, 'all_reduce_number: x expected a number, got string')
    assert.has_error(function() world:all_reduce_number(1, 'prod') end,
      "all_reduce_number: op expected 'sum', 'avg', 'max' or 'min', got prod")
  end)

  it('plans buckets in reverse order under the cap, split by dtype', function()
    local a, b, c = gl.zeros({ 100 }), gl.zeros({ 300 }), gl.zeros({ 50 })
    local d = gl.zeros({ 10 }, { dtype = 'float64' })
    local plan = B.plan({ a, b, c, d }, 1600)  -- 400 float32
    assert.equal(3, #plan)
    assert.same({ a, b }, { plan[1][1], plan[1][2] })
    assert.same({ c }, { plan[2][1] })
    assert.same({ d }, { plan[3][1] })
    assert.equal('float64', plan[3].dtype)
    local big = B.plan({ gl.zeros({ 1000 }), a }, 1600)
    assert.equal(2, #big)   -- a parameter over the cap forms a bucket alone
  end)

  it('DDP: gradients live in the buckets; each bucket launches during backward, in order, on the last micro-step only', function()
    local t = train.new(recipe({ max_iters = 1, out_dir = out }), {})
    local params = t.params
    local fired = 0
    for _, p in ipairs(params) do p:register_hook(function() fired = fired + 1 end) end
    local log = {}
    local comm = { rank = 0, size = 1 }
    function comm:all_reduce_async(buf, op)
      log[#log + 1] = { buf = buf, op = op, fired = fired }
      return { wait = function() end, test = function() return true end }
    end
    function comm:all_reduce_number(x) return x end
    local pol = dist.policy('ddp', { comm = comm, params = params, optimizer = t.optimizer, bucket_mb = 0.02 })
    assert.is_true(#pol.buckets >= 4)
    for _, b in ipairs(pol.buckets) do
      assert.is_true(B.bytes(b.grad) <= 0.02 * 2 ^ 20 or #b.params == 1)
      for _, p in ipairs(b.params) do   -- .grad is a view into the bucket
        local lo = gl.ffi.cast('char *', b.grad:data_ptr())
        local at = gl.ffi.cast('char *', p.grad:data_ptr())
        assert.is_true(at >= lo and at < lo + B.bytes(b.grad))
      end
    end
    local function micro(m, accum)
      fired = 0
      gl.scope(function()
        local x, y = t.data.train:next_batch()
        pol:before_micro_step(m, accum)
        local _, loss = t.model:forward(x, y)
        loss:backward()
      end)
    end
    pol:zero_grad()
    micro(1, 2)
    assert.equal(0, #log)          -- no_sync
    micro(2, 2)
    assert.equal(#pol.buckets, #log)
    for i, e in ipairs(log) do
      assert.equal(pol.buckets[i].grad, e.buf)
      assert.equal('avg', e.op)
    end
    assert.is_true(log[1].fired < #params / 2, 'the first bucket waited for ' .. log[1].fired .. ' gradients')
    assert.is_true(log[#log - 1].fired < #params)
    pol:after_backward()
    assert.equal(#pol.buckets, #log)
    pol:detach()
  end)

  it('ZeRO-2 keeps no full gradient after the reduce-scatter; ZeRO-1 keeps them', function()
    for _, name in ipairs({ 'zero1', 'zero2' }) do
      local kinds = {}
      for _, opt in ipairs({ 'adamw', 'nanochat' }) do
        local t = train.new(recipe({ max_iters = 1, optimizer = opt, dist = name, out_dir = out }), {})
        local pol = t.policy
        pol:zero_grad()
        gl.scope(function()
          local x, y = t.data.train:next_batch()
          pol:before_micro_step(1, 1)
          local _, loss = t.model:forward(x, y)
          loss:backward()
        end)
        pol:after_backward()
        assert.is_true(pol:grad_norm() > 0)
        for _, b in ipairs(pol.buckets) do
          kinds[b.kind] = true
          for _, p in ipairs(b.params) do
            if name == 'zero2' and b.kind ~= 'replicated' then assert.is_nil(p.grad)
            else assert.is_not_nil(p.grad) end
          end
        end
        pol:detach()
      end
      assert.same({ replicated = true, sharded = true, stack = true }, kinds)
    end
  end)

  it('keeps every micro-step of a bucket that a parameter without gradient holds back', function()
    local optim = require 'gptlua.optim'
    local function run(policy)
      local a = gl.randn({ 40, 40 }, { seed = 1 }):requires_grad_()
      local unused = gl.randn({ 40, 40 }, { seed = 2 }):requires_grad_()
      local o = { params = { a, unused }, optimizer = optim.AdamW({ a, unused }, { lr = 0.1 }) }
      local pol = policy and dist.policy(policy, o) or train.LocalPolicy.new(o)
      for step = 1, 3 do
        pol:zero_grad()
        for m = 1, 2 do
          gl.scope(function()
            pol:before_micro_step(m, 2)
            local loss = (a * gl.randn({ 40, 40 }, { seed = 10 * step + m })):sum()
            loss:backward()
          end)
        end
        pol:after_backward()
        gl.scope(function() pol:step() end)
      end
      if pol.detach then pol:detach() end
      return a:totable()
    end
    local want = run(nil)
    for _, policy in ipairs({ 'ddp', 'zero1', 'zero2' }) do assert.same(want, run(policy), policy) end
  end)

  it('matches the single-process trainer exactly in a world of one', function()
    for _, opt in ipairs({ 'adamw', 'nanochat' }) do
      local r = { optimizer = opt, max_iters = 4, gradient_accumulation_steps = 2, out_dir = out }
      local ref = train.new(recipe(r), {})
      local want = ref:run().losses
      for _, pol in ipairs({ 'ddp', 'zero1', 'zero2' }) do
        r.dist, r.bucket_mb = pol, 0.01
        local t = train.new(recipe(r), {})
        assert.same(want, t:run().losses, opt .. ' ' .. pol)
        assert.equal(0, rel_error(state_of(ref.model), state_of(t.model)), opt .. ' ' .. pol)
        t.policy:detach()
      end
    end
  end)

  it('resumes an unsharded checkpoint under ZeRO and a ZeRO checkpoint without a policy', function()
    local r = { optimizer = 'nanochat', max_iters = 6, checkpoint_interval = 3, keep_last = 5 }
    local function run(dir, over, args)
      local rr = { out_dir = out .. '/' .. dir }
      for k, v in pairs(r) do rr[k] = v end
      for k, v in pairs(over or {}) do rr[k] = v end
      local t = train.new(recipe(rr), args or {})
      local res = t:run()
      if t.policy.detach then t.policy:detach() end
      return res.losses, state_of(t.model)
    end
    local full, want = run('plain')
    local tail = { full[4], full[5], full[6] }
    local step3 = out .. '/plain/p/checkpoints/step_0000003'
    local losses, params = run('to_zero', { dist = 'zero2' }, { '--resume=' .. step3 })
    assert.same(tail, losses)
    assert.equal(0, rel_error(want, params))
    run('zero', { dist = 'zero1', max_iters = 3 })
    local zstep3 = out .. '/zero/p/checkpoints/step_0000003'
    assert.same({ 'optim.rank00000.safetensors' }, read_json(zstep3 .. '/state.json').shards.files)
    losses, params = run('from_zero', {}, { '--resume=' .. zstep3 })
    assert.same(tail, losses)
    assert.equal(0, rel_error(want, params))
  end)

  it('bfloat16: fp32 masters under ZeRO match the plain trainer exactly in a world of one, and resume both ways', function()
    local r = { optimizer = 'nanochat', max_iters = 6, checkpoint_interval = 3, keep_last = 5, dtype = 'bfloat16',
                gradient_accumulation_steps = 2, bucket_mb = 0.01 }
    local function run(dir, over, args)
      local rr = { out_dir = out .. '/bf16_' .. dir }
      for k, v in pairs(r) do rr[k] = v end
      for k, v in pairs(over or {}) do rr[k] = v end
      local t = train.new(recipe(rr), args or {})
      local res = t:run()
      if t.policy.detach then t.policy:detach() end
      return res.losses, state_of(t.model), t
    end
    local full, want = run('plain')
    local tail = { full[4], full[5], full[6] }
    local step3 = out .. '/bf16_plain/p/checkpoints/step_0000003'
    for _, pol in ipairs({ 'zero1', 'zero2' }) do
      local losses, params, t = run(pol, { dist = pol })
      assert.same(full, losses, pol)
      assert.equal(0, rel_error(want, params), pol)
      local sb = t.policy:state_bytes()
      assert.is_true(sb.master > 0, pol)
      -- a world of one: the masters are the whole model's, once
      local n = 0
      for _, p in ipairs(t.params) do n = n + p:numel() end
      assert.equal(4 * n, sb.master, pol)
      -- the unsharded checkpoint's '...master' tensors go into the shards
      losses, params = run(pol .. '_from_plain', { dist = pol }, { '--resume=' .. step3 })
      assert.same(tail, losses, pol)
      assert.equal(0, rel_error(want, params), pol)
    end
    -- a ZeRO checkpoint carries the masters: the plain trainer loads them
    local zstep3 = out .. '/bf16_zero2/p/checkpoints/step_0000003'
    local layout = read_json(zstep3 .. '/state.json').shards.layout
    assert.is_not_nil(layout['adamw.transformer.wte.weight.master'])
    local losses, params = run('from_zero', {}, { '--resume=' .. zstep3 })
    assert.same(tail, losses)
    assert.equal(0, rel_error(want, params))
  end)

  it('re-cuts state pieces of a checkpoint for any layout, and names what is missing', function()
    local idx = {}
    local function add(name, values)
      local c = { optim = { [name] = gl.tensor(values) } }
      for k, v in pairs(shards.index('x', c)) do
        idx[k] = idx[k] or {}
        for _, pc in ipairs(v) do table.insert(idx[k], pc) end
      end
    end
    add('adamw.w.m@0', { 0, 1, 2 })
    add('adamw.w.m@3', { 3, 4 })
    add('adamw.w.m@5', { 5, 6, 7, 8 })
    local dst = gl.zeros({ 5 })
    shards.fill(idx, 'adamw.w.m', 2, dst, 'ck')
    assert.same({ 2, 3, 4, 5, 6 }, dst:totable())
    assert.has_error(function() shards.fill(idx, 'adamw.w.m', 7, gl.zeros({ 3 }), 'ck') end,
      'resume: optimizer state adamw.w.m [7, 10) is missing from checkpoint ck')
    assert.has_error(function() shards.fill(idx, 'adamw.w.v', 0, gl.zeros({ 1 }), 'ck') end,
      'resume: optimizer state adamw.w.v [0, 1) is missing from checkpoint ck')
  end)
end)

-- ------------------------------------------------------------ MPI ranks --
describe('gptlua.dist policies over MPI ranks', function()
  if not MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)

  -- one process with N*accum micro-steps reads the same rows per step
  local refs = {}
  local function reference(opt, n_accum)
    local k = opt .. n_accum
    if not refs[k] then
      local dir = out .. '/ref' .. k
      local t = train.new(recipe({ optimizer = opt, gradient_accumulation_steps = n_accum, out_dir = dir }), {})
      refs[k] = { losses = t:run().losses, params = state_of(t.model), norms = grad_norms(dir) }
    end
    return refs[k]
  end

  local POLICIES = { 'ddp', 'zero1', 'zero2' }

  local function check_equivalence(n, accum)
    local dir = ('%s/n%d'):format(out, n)
    os.execute('mkdir -p ' .. dir)
    local o, rc = mpirun(n, 'spec/dist/policy_equiv.lua',
      ('%s %d 0.01 adamw:ddp,zero1,zero2 nanochat:ddp,zero1,zero2'):format(dir, accum))
    H.assert_ranks_ok(o, rc, n)
    local bytes = {}
    for _, opt in ipairs({ 'adamw', 'nanochat' }) do
      local ref = reference(opt, n * accum)
      bytes[opt] = {}
      for _, pol in ipairs(POLICIES) do
        local what = ('%s %s on %d ranks'):format(opt, pol, n)
        local res = read_json(('%s/%s_%s.json'):format(dir, opt, pol))
        assert.equal(n, res.world)
        assert_losses(ref.losses, res.losses, what)
        -- clipping (grad_clip 1) scales by the global norm over the shards
        -- (gradients drift more than losses in fp32: 1e-4; a norm that
        -- missed or double-counted a shard would be off by percents)
        assert_losses(ref.norms, grad_norms(('%s/runs_%s_%s'):format(dir, opt, pol)), what, 'gradient norm', 1e-4)
        assert_params(ref.params, ckpt.load_safetensors(('%s/%s_%s.safetensors'):format(dir, opt, pol)), what)
        bytes[opt][pol] = res.state_bytes
      end
    end
    return bytes
  end

  -- sharded state: each rank ~1/N of the unsharded total (DDP's, every
  -- rank whole); the ranks together hold it about once
  local function check_bytes(bytes, n, per_rank_slack)
    for opt, b in pairs(bytes) do
      local whole = b.ddp[1]
      assert.is_true(whole > 0)
      for _, pol in ipairs({ 'zero1', 'zero2' }) do
        local sum = 0
        for r = 1, n do
          sum = sum + b[pol][r]
          local ratio = b[pol][r] / whole
          assert.is_true(ratio <= per_rank_slack[opt] / n,
            ('%s %s rank %d holds %.3f of the optimizer state, expected about 1/%d'):format(opt, pol, r - 1, ratio, n))
        end
        assert.is_true(sum / whole < 1.1, ('%s %s: the ranks hold %.2f copies of the state'):format(opt, pol, sum / whole))
      end
    end
  end

  it('DDP, ZeRO-1/2 AdamW and sharded Muon on 2 ranks (2 micro-steps) match 1 rank with 4 from rank 0\'s weights', function()
    local bytes = check_equivalence(2, 2)
    check_bytes(bytes, 2, { adamw = 1.1, nanochat = 1.1 })
  end)

  it('... and on 3 ranks (padded shards and Muon stacks) match 1 rank with 3', function()
    local bytes = check_equivalence(3, 1)
    -- Muon owns whole matrices: stacks of 2 spread over 3 ranks are uneven
    check_bytes(bytes, 3, { adamw = 1.1, nanochat = 1.35 })
  end)

  -- bfloat16 weights with fp32 masters: 2 ranks against one process with 2
  -- micro-steps, both in bfloat16.  Each gradient element is a sum of two
  -- bfloat16 terms rounded once to bfloat16 on both sides (one process: the
  -- accumulation in backward; ZeRO: the averaging reduce-scatter), so the
  -- runs agree to fp32 summation-order noise: measured here, losses within
  -- 2e-14 and the masters identical.  That noise can still flip a bfloat16
  -- rounding of a weight (BLAS thread counts differ between the runs; the
  -- bfloat16 resume below moves losses by 1.6e-5 that way), so the bound is
  -- 1e-3: 60 times that, and under bfloat16's own rounding step (2^-8 =
  -- 3.9e-3), so masters rounded to bfloat16 (lost small updates), a missed
  -- update or a shard written to the wrong place fail it.
  it('bfloat16: ZeRO-1/2 AdamW and Muon on 2 ranks keep fp32 master shards and match 1 rank with 2 micro-steps', function()
    local dir = out .. '/bf16'
    os.execute('mkdir -p ' .. dir)
    local o, rc = mpirun(2, 'spec/dist/policy_equiv.lua',
      dir .. ' 1 0.01 dtype=bfloat16 adamw:zero1,zero2 nanochat:zero1,zero2')
    assert.equal(0, rc, o)
    for _, opt in ipairs({ 'adamw', 'nanochat' }) do
      local rdir = out .. '/ref_bf16_' .. opt
      local t = train.new(recipe({ optimizer = opt, gradient_accumulation_steps = 2, dtype = 'bfloat16',
        out_dir = rdir }), {})
      local want = t:run().losses
      local masters, whole = {}, 0
      for k, v in pairs(t.optimizer:state_dict().tensors) do
        if k:match('%.master$') then masters[k] = v; whole = whole + 4 * v:numel() end
      end
      assert.is_true(whole > 0)
      for _, pol in ipairs({ 'zero1', 'zero2' }) do
        local what = ('bfloat16 %s %s on 2 ranks'):format(opt, pol)
        local res = read_json(('%s/%s_%s.json'):format(dir, opt, pol))
        assert_losses(want, res.losses, what, 'loss', 1e-3)
        -- 4 bytes per element of each rank's slices (and replicated tensors)
        local sum = 0
        for r = 1, 2 do
          assert.is_true(res.shard_elements[r] > 0, what)
          assert.equal(4 * res.shard_elements[r], res.master_bytes[r], what .. ' rank ' .. (r - 1))
          sum = sum + res.master_bytes[r]
        end
        -- together about one copy (padding, Muon stacks and replicated tensors aside)
        assert.is_true(sum >= whole and sum / whole < 1.35, ('%s: %d master bytes on the ranks, %d whole'):format(
          what, sum, whole))
        -- the master pieces of both ranks, assembled, against the reference's masters
        local pieces = {}
        for r = 0, 1 do
          for k, v in pairs(ckpt.load_safetensors(('%s/%s_%s.master%d.safetensors'):format(dir, opt, pol, r))) do
            pieces[k] = v
          end
        end
        local idx, got = shards.index('masters', { optim = pieces }), {}
        for k, v in pairs(masters) do
          got[k] = gl.zeros(v.shape)
          shards.fill(idx, k, 0, got[k], 'masters')
        end
        local e = rel_error(masters, got)
        assert.is_true(e < 1e-3, ('%s: fp32 masters differ, relative error %.3g'):format(what, e))
      end
    end
  end)

  it('bfloat16: a ZeRO-1 checkpoint of 2 ranks resumes in one process with its fp32 masters', function()
    local d2 = out .. '/bf16_r2'
    local o, rc = mpirun(2, 'spec/dist/policy_resume.lua', d2 .. ' nanochat zero1 6 dtype=bfloat16')
    assert.equal(0, rc, o)
    local step3 = d2 .. '/p/checkpoints/step_0000003'
    local st = read_json(step3 .. '/state.json')
    assert.equal(2, st.shards.world)
    local n = 0
    for k in pairs(st.shards.layout) do if k:match('%.master$') then n = n + 1 end end
    assert.is_true(n > 0)
    local r1 = ckpt.load_safetensors(step3 .. '/' .. st.shards.files[2])
    local pieces = 0
    for k in pairs(r1) do if k:match('%.master@%d+$') then pieces = pieces + 1 end end
    assert.is_true(pieces > 0, 'rank 1 wrote no master pieces')
    local full = read_json(d2 .. '/losses.json').losses
    local tail = { full[4], full[5], full[6] }
    local t = train.new(recipe({ optimizer = 'nanochat', max_iters = 6, total_batch_size = 2 * 16 * 6,
      dtype = 'bfloat16', out_dir = out .. '/bf16_r1' }), { '--resume=' .. step3 })
    -- the masters loaded are the checkpoint's, not the bfloat16 weights widened
    local want = shards.full_tensors(step3, ckpt.load(step3))
    for k, v in pairs(t.optimizer:state_dict().tensors) do
      if k:match('%.master$') then assert.equal(0, v:max_abs_diff(want[k]), k) end
    end
    assert_losses(tail, t:run().losses, 'bfloat16 resumed in one process', 'loss', 1e-3)
  end)

  it('resumes a checkpoint of 2 ranks on 3 ranks and in one process, re-sharding the state', function()
    local d2, d3, d1 = out .. '/r2', out .. '/r3', out .. '/r1'
    local o, rc = mpirun(2, 'spec/dist/policy_resume.lua', d2 .. ' nanochat zero2 6')
    assert.equal(0, rc, o)
    local step3 = d2 .. '/p/checkpoints/step_0000003'
    local st = read_json(step3 .. '/state.json')
    assert.equal(2, st.shards.world)
    assert.same({ 'optim.rank00000.safetensors', 'optim.rank00001.safetensors' }, st.shards.files)
    for _, f in ipairs(st.shards.files) do assert.is_string(st.files[f]) end  -- checksummed
    o, rc = mpirun(3, 'spec/dist/policy_resume.lua', ('%s nanochat zero2 6 %s'):format(d3, step3))
    assert.equal(0, rc, o)
    local full = read_json(d2 .. '/losses.json').losses
    local tail = { full[4], full[5], full[6] }
    assert_losses(tail, read_json(d3 .. '/losses.json').losses, 'resumed on 3 ranks')
    local want = ckpt.load_safetensors(d2 .. '/p/checkpoints/step_0000006/model.safetensors')
    assert_params(want, ckpt.load_safetensors(d3 .. '/p/checkpoints/step_0000006/model.safetensors'), '3 ranks')
    -- one process assembles the shards whole
    local t = train.new(recipe({ optimizer = 'nanochat', max_iters = 6, total_batch_size = 2 * 16 * 6,
      out_dir = d1 }), { '--resume=' .. step3 })
    local res = t:run()
    assert_losses(tail, res.losses, 'resumed in one process')
    assert_params(want, state_of(t.model), 'one process')
  end)

  it('benchmarks DDP overlap and 1 -> 2 rank scaling (recipes/tools/bench_ddp_overlap.lua, a tiny recipe)', function()
    local path = out .. '/tiny_recipe.lua'
    local f = assert(io.open(path, 'wb'))
    f:write("return { model = 'gpt2', data = 'char', n_layer = 1, n_head = 2, n_embd = 32, block_size = 16, "
      .. "batch_size = 2, device = 'cpu', bias = false }")
    f:close()
    local o, rc = sh(EXE .. ' recipes/tools/bench_ddp_overlap.lua --steps=1 --rounds=1 --bucket_mb=0.01 --recipe=' .. path)
    assert.equal(0, rc, o)
    assert.truthy(o:match('1 rank  %(%d+ threads%): [%d.]+ ms/step, %d+ tokens/s'), o)
    assert.truthy(o:match('2 ranks %(%d+ threads each%), %d+ buckets of <= 0.01 MB'), o)
    assert.truthy(o:match('compute [%d.]+ ms | overlap [%d.]+ ms | serial [%d.]+ ms | comm alone [%d.]+ ms'), o)
    assert.truthy(o:match('scaling 1 %-> 2 ranks: [%d.]+x tokens/s'), o)
  end)

  it('runs the default recipe end to end: gptlua -n 2 recipes/shakespeare.lua --dist=ddp', function()
    local o, rc = sh(EXE .. ' -n 2 recipes/shakespeare.lua --dist=ddp --max_iters=2 --eval_interval=2 '
      .. '--eval_iters=1 --log_interval=1 --sample_length=0 --warmup_iters=0 --out_dir=' .. out .. '/e2e')
    assert.equal(0, rc, o)
    assert.truthy(o:find('batch 12 x 64 x 1 accum x 2 ranks = 1536 tokens/step', 1, true), o)
    assert.truthy(o:find('step     2/2 | loss', 1, true), o)
    assert.truthy(o:find('saved checkpoint ' .. out .. '/e2e/shakespeare/checkpoints/step_0000002', 1, true), o)
    local _, n = o:gsub('step     1/2', '')
    assert.equal(1, n)   -- progress from rank 0 only
  end)
end)
