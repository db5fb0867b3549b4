-- The profiler (gptlua.observe.profiler): --profile=N|A:B on a training run
-- writes a Chrome trace per rank that loads as JSON and holds a GPT's
-- forward and backward ops, the step's phases, and — on 2 DDP ranks — the
-- asynchronous all-reduces with their bytes and group, overlapping the
-- backward; under the CUDA simulator (#cuda) the ops also have device times
-- from CUDA events.  Off, nothing is wrapped.
local gl = require 'gptlua'
local A = require 'gptlua.autograd'
local cjson = require 'cjson'
local train = require 'gptlua.train'
local profiler = require 'gptlua.observe.profiler'
local H = require 'support.mpi'

local function recipe(over)
  local r = { name = 'p', model = 'gpt2', data = 'char', n_layer = 2, n_head = 2, n_embd = 16, block_size = 8,
              batch_size = 2, max_iters = 3, eval_interval = 0, log_interval = 1, sample_length = 0,
              warmup_iters = 0, quiet = true, device = 'cpu', out_dir = H.tmpdir() }
  for k, v in pairs(over or {}) do r[k] = v end
  return r
end

local function names_of(trace, pred)
  local out = {}
  for _, e in ipairs(trace.traceEvents) do if pred(e) then out[e.name] = (out[e.name] or 0) + 1 end end
  return out
end

-- every X event of the host track lies inside a step
local function check_nesting(trace)
  local steps = {}
  for _, e in ipairs(trace.traceEvents) do if e.cat == 'step' then steps[#steps + 1] = e end end
  assert.is_true(#steps > 0, 'no step spans')
  for _, e in ipairs(trace.traceEvents) do
    if e.ph == 'X' and e.tid == 1 then
      local inside = false
      for _, s in ipairs(steps) do
        if e.ts >= s.ts - 1e-3 and e.ts + e.dur <= s.ts + s.dur + 1e-3 then inside = true end
      end
      assert.is_true(inside, e.name .. ' outside every step')
    end
  end
end

describe('profiler', function()
  it('reads N and A:B step ranges and refuses anything else by name', function()
    assert.same({ 2, 6 }, { profiler.parse_steps('5') })
    assert.same({ 10, 15 }, { profiler.parse_steps('10:15') })
    assert.same({ 3, 3 }, { profiler.parse_steps(' 3:3 ') })
    for _, bad in ipairs({ 'x', '0', '5:3', '0:2', '1:', '-1', '2.5' }) do
      local ok, err = pcall(profiler.parse_steps, bad)
      assert.is_false(ok, bad)
      assert.equal(("config: profile expected N (profile N steps after the first) or A:B (steps A to B, "
        .. "1 <= A <= B), got '%s'"):format(bad), err)
    end
    local ok, err = pcall(train.new, recipe(), { '--profile=7:2' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("got '7:2'", 1, true), err)
    ok, err = pcall(train.new, recipe(), { '--profile=5', '--max_iters=1' })
    assert.is_false(ok)
    assert.equal("config: profile starts at step 2, after the run's last step (max_iters = 1)", err)
  end)

  it('stops the run when the profile is written, unless --profile_continue', function()
    local r = recipe({ max_iters = 6 })
    local res = train.main(r, { '--profile=2:3' })
    assert.equal(3, #res.losses)                      -- steps 1-3, then the stop
    assert.equal(3, res.checkpoint and tonumber(res.checkpoint:match('step_(%d+)$')))
    res = train.main(recipe({ max_iters = 6 }), { '--profile=2:3', '--profile_continue' })
    assert.equal(6, #res.losses)
    os.execute('rm -rf ' .. r.out_dir)
  end)

  it('wraps nothing unless a profile runs, and unwraps everything after it', function()
    local linear, add, backward = gl.linear, gl.Tensor.__add, gl.Tensor.backward
    local t = train.new(recipe(), {})
    assert.is_nil(t.profiler)
    assert.is_nil(rawget(t, 'train_step'))
    t:run()
    local r = recipe()
    train.main(r, { '--profile=1:2' })
    assert.equal(linear, gl.linear)
    assert.equal(add, gl.Tensor.__add)
    assert.equal(backward, gl.Tensor.backward)
    assert.is_nil(A.profile_node)
    os.execute('rm -rf ' .. r.out_dir .. ' ' .. t.cfg.out_dir)
  end)

  it('profiles any code between start and stop, nesting the ops an op calls', function()
    local prof = profiler.new({ rank = 3, device = 'cpu' })
    local a = gl.randn({ 4, 4 }, { seed = 1 })
    prof:start()
    local s = (a:matmul(a) + 1):reshape(16):sum():item()
    prof:stop()
    assert.is_number(s)
    local d = H.tmpdir()
    local trace = H.read_json(prof:write(d .. '/sub/t.json'))
    local ops = names_of(trace, function(e) return e.cat == 'op' and e.pid == 3 end)
    for _, n in ipairs({ 'matmul', 'add', 'reshape', 'view', 'sum', 'item' }) do
      assert.equal(1, ops[n], n)
    end
    local by = {}
    for _, e in ipairs(trace.traceEvents) do by[e.name] = e end
    -- reshape calls view: view's span lies inside reshape's
    assert.is_true(by.view.ts >= by.reshape.ts and by.view.ts + by.view.dur <= by.reshape.ts + by.reshape.dur)
    local rows = {}
    for _, r in ipairs(prof:key_averages()) do rows[r.name] = r end
    assert.is_true(rows.reshape.self < rows.reshape.total)
    os.execute('rm -rf ' .. d)
  end)

  it('writes a CPU trace with the ops of a GPT forward and backward and prints the top ops', function()
    local r = recipe({ max_iters = 4, eval_interval = 2, eval_iters = 1 })
    local _, t = train.main(r, { '--profile=2:3' })
    local trace = H.read_json(r.out_dir .. '/p/profile/trace.rank0.json')
    assert.equal(0, trace.otherData.rank)
    assert.equal(2, trace.otherData.first_step)
    assert.equal(3, trace.otherData.last_step)
    local ops = names_of(trace, function(e) return e.cat == 'op' end)
    -- mul: the trainer's loss * (1 / accum), reached only through the operator
    for _, n in ipairs({ 'embedding', 'layer_norm', 'linear', 'attention_qkv', 'add_layer_norm', 'mlp', 'add', 'mul',
                         'linear_cross_entropy' }) do
      assert.is_true((ops[n] or 0) > 0, 'no ' .. n .. ' in the trace')
    end
    assert.equal(2 * 2 * 2, ops.linear)   -- 2 steps x 2 layers x (c_attn, c_proj); the MLP is gl.mlp, lm_head fused with the loss
    assert.equal(2 * 2, ops.mlp)
    local nodes = names_of(trace, function(e) return e.cat == 'node' end)
    for _, n in ipairs({ 'embedding backward', 'layer_norm backward', 'linear backward', 'attention_qkv backward',
                         'add_layer_norm backward', 'mlp backward', 'linear_cross_entropy backward' }) do
      assert.is_true((nodes[n] or 0) > 0, 'no ' .. n .. ' in the trace')
    end
    local phases = names_of(trace, function(e) return e.ph == 'X' and e.cat ~= 'op' and e.cat ~= 'node' end)
    for _, n in ipairs({ 'step 2', 'step 3', 'forward', 'backward', 'data', 'optimizer', 'sync', 'grad_norm' }) do
      assert.is_true((phases[n] or 0) > 0, 'no phase ' .. n)
    end
    assert.equal(2, phases.data)   -- one batch per step: the eval between the steps is not recorded
    check_nesting(trace)
    local rows = t.profiler:key_averages()
    assert.is_true(#rows > 10)
    for i = 2, #rows do assert.is_true(rows[i - 1].total >= rows[i].total) end
    for _, row in ipairs(rows) do assert.is_true(row.self <= row.total + 1e-9 and row.self >= -1e-6, row.name) end
    local text = t.profiler:table(5)
    assert.truthy(text:match('^name%s+kind%s+calls%s+total ms%s+self ms'), text)
    assert.equal(5 + 2, select(2, text:gsub('\n', '')) + 1)
    os.execute('rm -rf ' .. r.out_dir)
  end)

  it('traces 2 DDP ranks: async all-reduces with bytes and group, overlapping the backward', function()
    local d = H.tmpdir()
    local out, rc = H.sh(('%s -n 2 spec/dist/launch_recipe.lua --out_dir=%s --dist=ddp --max_iters=3 --profile=2'):format(
      H.EXE, d), 120)
    assert.equal(0, rc, out)
    assert.truthy(out:find('profile: steps 2-3', 1, true), out)
    assert.truthy(out:find('all_reduce (async)', 1, true), out)
    for rank = 0, 1 do
      local trace = H.read_json(('%s/launch/profile/trace.rank%d.json'):format(d, rank))
      local begins, ends, backward_end = {}, {}, {}
      for _, e in ipairs(trace.traceEvents) do
        assert.equal(rank, e.pid)
        if e.ph == 'b' then begins[e.id] = e end
        if e.ph == 'e' then ends[e.id] = e end
        if e.name == 'backward' then backward_end[#backward_end + 1] = e.ts + e.dur end
      end
      local n, overlapped = 0, 0
      for id, b in pairs(begins) do
        n = n + 1
        assert.equal('all_reduce (async)', b.name)
        assert.equal('collective', b.cat)
        assert.equal('world', b.args.group)
        assert.equal(2, b.args.ranks)
        assert.is_true(b.args.bytes > 0)
        assert.truthy(ends[id], 'no end for ' .. id)
        assert.is_true(ends[id].ts >= b.ts)
        for _, t_end in ipairs(backward_end) do if b.ts < t_end and ends[id].ts > b.ts then overlapped = overlapped + 1 end end
      end
      assert.is_true(n >= 2, 'async all-reduces: ' .. n)
      assert.is_true(overlapped >= 1, 'no all-reduce started inside a backward')
      check_nesting(trace)
    end
    os.execute('rm -rf ' .. d)
  end)

  it('#cuda times ops on the device with CUDA events', function()
    if not gl.cuda_available() then pending('no CUDA device'); return end
    local r = recipe({ device = 'cuda', max_iters = 2 })
    local _, t = train.main(r, { '--profile=1:2' })
    local trace = H.read_json(r.out_dir .. '/p/profile/trace.rank0.json')
    local dev = names_of(trace, function(e) return e.tid == 2 and e.cat == 'device' and e.ph == 'X' and e.dur >= 0 end)
    for _, n in ipairs({ 'linear', 'layer_norm', 'linear_cross_entropy', 'linear backward' }) do
      assert.is_true((dev[n] or 0) > 0, 'no device time for ' .. n)
    end
    local with_time = 0
    for _, row in ipairs(t.profiler:key_averages()) do if row.device > 0 then with_time = with_time + 1 end end
    assert.is_true(with_time > 0, 'no op has device time')
    assert.truthy(t.profiler:table():find('device ms', 1, true))
    os.execute('rm -rf ' .. r.out_dir)
  end)
end)
