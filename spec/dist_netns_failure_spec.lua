-- A node lost mid-run, across two network namespaces (spec/support/netns.lua):
-- the ranks train over TCP rendezvous and Gloo, and once the job has
-- published a checkpoint the test takes node 2's link down (its end of the
-- veth).  Every rank must end within the collective timeout (dist_timeout,
-- set short here) with a line naming the rank it lost, none may hang, and
-- the last published checkpoint must load and verify its checksums.
-- Skipped, saying why, where namespaces cannot be made.
local NS = require 'support.netns'
local H = require 'support.mpi'
local ckpt = require 'gptlua.checkpoint'
local launch = require 'gptlua.dist.launch'
local cjson = require 'cjson'

local ok, why = NS.available()
if not ok then
  describe('a node lost across two network namespaces', function()
    pending('skipped: network namespaces are not available here (' .. why .. ')')
  end)
  return
end

local TIMEOUT = 5   -- dist_timeout, s

describe('a node lost across two network namespaces', function()
  it('ends every rank within the collective timeout, naming the lost rank; the last checkpoint verifies', function()
    local dir = H.tmpdir()
    local ckdir = dir .. '/elastic/checkpoints'
    local out, statuses, ended, down_at, at_step = NS.with({}, function(nodes)
      local job = NS.start_ranks(nodes, launch.free_port(), function()
        -- far more steps than the test lets it take: it must be stopped by the lost link
        return ('%s %s/spec/dist/elastic_recipe.lua --out_dir=%s --dist=ddp --max_iters=1000000 '
          .. '--checkpoint_interval=4 --dist_timeout=%d'):format(H.EXE, H.ROOT, dir, TIMEOUT)
      end, 200)
      -- mid-run: a checkpoint is published (a temporary directory renamed to step_N)
      local published = NS.wait_for(function() return #ckpt.list(ckdir) > 0 end, 120)
      local step = published and ckpt.list(ckdir)[1].step
      local t = NS.now()
      NS.link_down(nodes[2])
      local o, s, e = NS.finish(job)
      return o, s, e, t, step
    end)
    assert.truthy(at_step, 'no checkpoint was published before the link went down:\n' .. out)
    -- `timeout` (124) would mean a hang; each rank ends with the engine's abort status
    assert.is_true(statuses[1] ~= nil and statuses[1] ~= 0 and statuses[1] ~= 124, out)
    assert.is_true(statuses[2] ~= nil and statuses[2] ~= 0 and statuses[2] ~= 124, out)
    -- rank 0 names rank 1 as the one missing from the collective; rank 1 names rank 0 as lost
    assert.truthy(out:find('did not complete within 5.0 s on rank 0. Missing: rank 1', 1, true), out)
    assert.truthy(out:find('[rank 1] gptlua.dist: lost rank 0', 1, true), out)
    -- rank 0: the timeout, then up to half of it asking the others; rank 1: the
    -- timeout of its next question to rank 0's store.  2 x the timeout + 10 s
    -- leaves room for a loaded machine without letting a hang pass.
    for r = 1, 2 do
      local took = ended[r] - down_at
      assert.is_true(took < 2 * TIMEOUT + 10,
        ('rank %d ended %.1f s after the link went down, expected within %d s'):format(r - 1, took, 2 * TIMEOUT + 10))
    end
    local all = ckpt.list(ckdir)
    assert.is_true(#all > 0 and all[#all].step >= at_step, out)
    local c = ckpt.load(all[#all].path)   -- verifies every file's checksum
    assert.equal(all[#all].step, c.state.step)
    os.execute('rm -rf ' .. dir)
  end)
end)

-- Ctrl-C on a job of two nodes, one TCP launcher a node (NNODES, NODE_RANK):
-- SIGINT to either node's launcher reaches every rank on both nodes (the
-- launcher passes it on as the stop signal, and the ranks agree on the stop
-- at the next step), so every rank saves the same step and exits 0, both
-- launchers exit 0, and no process is left in either namespace.
describe('Ctrl-C on a job of two nodes', function()
  for _, target in ipairs({ 1, 2 }) do
    it(('SIGINT to node %d\'s launcher stops every rank on both nodes, which save one checkpoint'):format(target),
      function()
      local dir = H.tmpdir()
      local out, statuses, left = NS.with({}, function(nodes)
        local job = NS.start_ranks(nodes, launch.free_port(), function(r)
          return ('env NNODES=2 NODE_RANK=%d sh -c \'echo $$ > %s/launcher.%d; exec %s -n 1 --launcher=tcp '
            .. '%s/spec/dist/stop_recipe.lua --out_dir=%s --dist=ddp\''):format(r, dir, r, H.EXE, H.ROOT, dir)
        end, 120)
        local running = NS.wait_for(function()
          local f = io.open(dir .. '/stop/metrics.jsonl', 'rb')
          local s = f and f:read('*a') or ''
          if f then f:close() end
          return s:find('"step"') ~= nil and io.open(dir .. '/launcher.' .. (target - 1)) ~= nil
        end, 90)
        if running then
          local pid = io.open(dir .. '/launcher.' .. (target - 1)):read('*a'):match('%d+')
          os.execute('kill -INT ' .. pid)
        end
        local o, s = NS.finish(job)
        local pids = ''
        for _, n in ipairs(nodes) do
          local p = io.popen('ip netns pids ' .. n.name)
          pids = pids .. p:read('*a')
          p:close()
        end
        return o, s, pids
      end)
      assert.same({ 0, 0 }, statuses, out)
      assert.truthy(out:find('dist: ddp (on 2 ranks)', 1, true), out)   -- one job across both nodes
      assert.equal('', left, 'processes left in the namespaces:\n' .. left .. '\n' .. out)
      local step = tonumber(out:match('interrupted at step (%d+): saving a checkpoint'))
      assert.is_not_nil(step, out)
      local list = ckpt.list(dir .. '/stop/checkpoints')
      assert.equal(step, list[#list].step, out)
      ckpt.load(list[#list].path)
      for r = 0, 1 do
        local pid = io.open(('%s/pid.%d'):format(dir, r)):read('*a'):match('%d+')
        assert.is_false(os.execute('kill -0 ' .. pid .. ' 2>/dev/null') == 0, 'rank ' .. r .. ' is still running')
      end
      os.execute('rm -rf ' .. dir)
    end)
  end
end)

-- A node lost mid-run on a job that restarts, one TCP launcher a node
-- (NNODES=2, --max_restarts=1 --min_ranks=1): the launchers meet at node
-- 0's (the rendezvous host) before each attempt (gptlua.dist.rendezvous).
-- The ranks hold before step 6 (a test hook) while the test waits for step
-- 4's checkpoint and takes node 2's link down, then go on: the step's
-- collective times out on both nodes, node 0's launcher waits --rdzv_timeout
-- for node 1, which cannot reach it, and restarts alone from step 4 with the
-- same global batch (2 accumulation steps on 1 rank), finishing the run;
-- node 1's launcher stops with one line.  The restarted run must end on what
-- a run on that one rank, resumed from the same checkpoint, gives: the same
-- rank count, data and arithmetic, so the losses and the parameters are
-- equal bit for bit.
describe('a node lost on a job with --max_restarts across two network namespaces', function()
  local RDZV = 5   -- --rdzv_timeout, s
  local function read(p) local f = assert(io.open(p, 'rb')); local s = f:read('*a'); f:close(); return s end
  local function exists(p) local f = io.open(p, 'rb'); if f then f:close() end return f ~= nil end
  -- the losses of metrics.jsonl's step records after its last restart record (or all of them)
  local function losses_after_restart(path)
    local out = {}
    for line in io.lines(path) do
      local r = cjson.decode(line)
      if r.restart then out = {} end
      if r.loss and r.step then out[#out + 1] = { r.step, r.loss } end
    end
    return out
  end

  it('the surviving node\'s launcher restarts on its own rank and finishes the run, as a run resumed there gives',
    function()
    local dir = H.tmpdir()
    local ckdir = dir .. '/elastic/checkpoints'
    local hold = dir .. '/hold'
    local train_args = ('--dist=ddp --max_iters=12 --checkpoint_interval=4 --dist_timeout=%d'):format(TIMEOUT)
    local out, statuses = NS.with({}, function(nodes)
      local job = NS.start_ranks(nodes, launch.free_port(), function(r)
        return ('env NNODES=2 NODE_RANK=%d GPTLUA_TEST_HOLD_AT=6:%s %s -n 1 --launcher=tcp --max_restarts=1 '
          .. '--min_ranks=1 --rdzv_timeout=%d %s/spec/dist/elastic_recipe.lua --out_dir=%s %s'):format(r, hold, H.EXE,
          RDZV, H.ROOT, dir, train_args)
      end, 120)
      local held = NS.wait_for(function()
        local l = ckpt.list(ckdir)
        return exists(hold .. '.rank0') and exists(hold .. '.rank1') and #l > 0 and l[#l].step == 4
      end, 60)
      if held then NS.link_down(nodes[2]) end
      io.open(hold, 'wb'):close()
      return NS.finish(job)
    end)
    assert.equal(0, statuses[1], out)
    assert.is_true(statuses[2] ~= nil and statuses[2] ~= 0 and statuses[2] ~= 124, out)
    assert.truthy(out:find('did not complete within 5.0 s on rank 0. Missing: rank 1', 1, true), out)
    -- node 1 cannot reach the host: it stops, in one line
    assert.truthy(out:find(('gptlua %%-n: rendezvous: no answer from the rendezvous host [%%d.]+:%%d+ within %d s'):format(
      2 * RDZV)), out)
    -- node 0 restarts alone, resharded to keep the global batch
    assert.truthy(out:find('gptlua -n: restart 1 of 1 on 1 rank (node 0), from the last checkpoint', 1, true), out)
    assert.truthy(out:find(("resume: gradient_accumulation_steps 1 -> 2 keeps the run's 64 tokens per step on 1 "
      .. 'data-parallel ranks'), 1, true), out)
    assert.truthy(out:find(('restart 1: resumed from %s/step_0000004, 2 steps lost'):format(ckdir), 1, true), out)
    assert.truthy(out:find('gptlua -n: finished after 1 restart on 1 rank; 2 steps lost and trained again', 1, true), out)
    -- recorded as a single node's restarts are
    local m, j = {}, {}
    for line in io.lines(dir .. '/elastic/metrics.jsonl') do
      local r = cjson.decode(line)
      if r.restart then m[#m + 1] = r end
    end
    for line in io.lines(dir .. '/elastic/journal.jsonl') do
      local r = cjson.decode(line)
      if r.restart then j[#j + 1] = r end
    end
    assert.equal(1, #m, out)
    assert.same({ 1, 4, 2, 1 }, { m[1].restart, m[1].step, m[1].lost_steps, m[1].ranks })
    assert.same({ 1, 4, 2 }, { j[1].restart, j[1].at, j[1].lost_steps })
    -- the final checkpoint verifies (every file's checksum) and was made on one rank
    local final = ckpt.load(ckdir .. '/step_0000012')
    assert.same({ 12, 1, 2 }, { final.state.step, final.state.ranks, final.state.config.gradient_accumulation_steps })
    -- the run on the survivor from that checkpoint: one process, resumed from a copy of step 4
    local ref = H.tmpdir()
    os.execute(('mkdir -p %s/elastic/checkpoints && cp -a %s/step_0000004 %s/elastic/checkpoints/'):format(ref, ckdir, ref))
    local rout, rc = H.sh(('%s spec/dist/elastic_recipe.lua --out_dir=%s %s --resume --resume_keep_batch=true'):format(
      H.EXE, ref, train_args), 60)
    assert.equal(0, rc, rout)
    local want = losses_after_restart(ref .. '/elastic/metrics.jsonl')
    assert.equal(8, #want, rout)   -- steps 4..11
    assert.same(want, losses_after_restart(dir .. '/elastic/metrics.jsonl'))
    assert.equal(read(ref .. '/elastic/checkpoints/step_0000012/model.safetensors'),
      read(ckdir .. '/step_0000012/model.safetensors'))
    os.execute('rm -rf ' .. dir .. ' ' .. ref)
  end)
end)
