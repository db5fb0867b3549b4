-- Restarts (gptlua.dist.elastic): `gptlua -n N --max_restarts=K` stops every
-- rank when one dies and starts the job again from its last checkpoint;
-- --min_ranks continues on the ranks that can start, with the same global
-- batch; K used up ends with one line and the job's status.  The failures
-- are test hooks: rank R exits before step S (GPTLUA_TEST_EXIT_AT), a slot
-- that cannot start again (GPTLUA_TEST_DEAD_SLOT).  spec/dist/elastic_recipe.lua
-- checkpoints every 2 steps of 8 in the background, so a rank dying before
-- step 5 leaves step 4's checkpoint published when rank 0's writer was done
-- by its next step boundary, else step 2's: the job resumes from either,
-- having lost 5 - that step.
local ckpt = require 'gptlua.checkpoint'
local H = require 'support.mpi'
local cjson = require 'cjson'

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end
local function read(p) local f = assert(io.open(p, 'rb')); local s = f:read('*a'); f:close(); return s end

local function job(dir, launcher_args, env, extra)
  return H.sh(('env %s %s -n 2 %s spec/dist/elastic_recipe.lua --out_dir=%s --dist=ddp %s'):format(env or '', H.EXE,
    launcher_args, dir, extra or ''), 240)
end

local function records(path, key)
  local out = {}
  for line in io.lines(path) do
    local r = cjson.decode(line)
    if r[key] then out[#out + 1] = r end
  end
  return out
end

-- the final parameters of an uninterrupted 2-rank run, made once
local reference
local function reference_model()
  if not reference then
    local dir = H.tmpdir()
    local out, rc = job(dir, '')
    assert.equal(0, rc, out)
    reference = read(dir .. '/elastic/checkpoints/step_0000008/model.safetensors')
    os.execute('rm -rf ' .. dir)
  end
  return reference
end

describe('gptlua -n N --max_restarts', function()
  for _, launcher in ipairs({ 'mpi', 'tcp' }) do
    if launcher == 'tcp' or H.MPIRUN then
      it(launcher .. ': a rank killed mid-run -> every rank stopped, the job restarted from the last checkpoint, '
        .. 'and it ends on the uninterrupted run\'s parameters', function()
        local dir = H.tmpdir()
        local env = 'GPTLUA_TEST_EXIT_AT=1:5' .. (launcher == 'tcp' and ' GPTLUA_SPEC_BACKEND=gloo' or '')
        local out, rc = job(dir, '--max_restarts=2 --launcher=' .. launcher, env)
        assert.equal(0, rc, out)
        has(out, 'test hook: exiting before step 5')
        -- (under tcp the first rank the launcher sees end may be a peer whose collective broke: status 1)
        assert.truthy(out:find('gptlua %-n: the job failed %(status %d%); stopping every rank and restarting'), out)
        has(out, 'gptlua -n: restart 1 of 2 on 2 ranks, from the last checkpoint')
        local from = tonumber(out:match('restart 1: resumed from [^\n]*/step_(%d+), %d+ steps lost'))
        assert.truthy(from == 2 or from == 4, out)
        has(out, ('restart 1: resumed from %s/elastic/checkpoints/step_%07d, %d steps lost'):format(dir, from, 5 - from))
        has(out, ('gptlua -n: finished after 1 restart on 2 ranks; %d steps lost and trained again'):format(5 - from))
        local m = records(dir .. '/elastic/metrics.jsonl', 'restart')
        assert.equal(1, #m, out)
        assert.same({ 1, from, 5 - from, 2 }, { m[1].restart, m[1].step, m[1].lost_steps, m[1].ranks })
        local j = records(dir .. '/elastic/journal.jsonl', 'restart')
        assert.same({ 1, from, 5 - from }, { j[1].restart, j[1].at, j[1].lost_steps })
        assert.equal(reference_model(), read(dir .. '/elastic/checkpoints/step_0000008/model.safetensors'))
        os.execute('rm -rf ' .. dir)
      end)
    end
  end

  it('--min_ranks: a rank that cannot start again -> the job finishes on the others with the same global batch',
    function()
    local dir = H.tmpdir()
    local out, rc = job(dir, '--max_restarts=1 --min_ranks=1', 'GPTLUA_TEST_EXIT_AT=1:5 GPTLUA_TEST_DEAD_SLOT=1')
    assert.equal(0, rc, out)
    has(out, 'gptlua -n: restart 1 of 1 on 1 rank, from the last checkpoint')
    has(out, "resume: gradient_accumulation_steps 1 -> 2 keeps the run's 64 tokens per step on 1 data-parallel ranks")
    assert.truthy(out:find('gptlua %-n: finished after 1 restart on 1 rank; [13] steps lost and trained again'), out)
    local st = ckpt.load(dir .. '/elastic/checkpoints/step_0000008').state
    assert.same({ 64, 1, 2 }, { st.tokens_per_step, st.ranks, st.config.gradient_accumulation_steps })
    assert.same({ 1 }, { records(dir .. '/elastic/metrics.jsonl', 'restart')[1].ranks })
    os.execute('rm -rf ' .. dir)
  end)

  it('fewer ranks than --min_ranks can start -> one line and the failure\'s status', function()
    local dir = H.tmpdir()
    local out, rc = job(dir, '--max_restarts=3 --min_ranks=2', 'GPTLUA_TEST_EXIT_AT=1:5 GPTLUA_TEST_DEAD_SLOT=1')
    assert.equal(3, rc, out)
    has(out, 'gptlua -n: only 1 of 2 ranks can start, fewer than --min_ranks=2: giving up after 0 restarts')
    os.execute('rm -rf ' .. dir)
  end)

  it('the restarts used up -> one clear line and a non-zero exit', function()
    local dir = H.tmpdir()
    local out, rc = job(dir, '--max_restarts=1', 'GPTLUA_TEST_EXIT_AT=1:5:all')
    assert.equal(3, rc, out)
    assert.truthy(out:find('gptlua %-n: the job failed %(status %d%) and its 1 restart are used up %(%-%-max_restarts=1%); '
      .. '[13] steps were lost to the restarts'), out)
    os.execute('rm -rf ' .. dir)
  end)

  it('refuses bad values in one line', function()
    local out, rc = H.sh(H.EXE .. ' -n 2 --min_ranks=3 spec/dist/elastic_recipe.lua', 30)
    assert.equal(1, rc, out)
    has(out, 'gptlua -n: --min_ranks expected an integer in 1..2 (the ranks of -n), got 3')
    out, rc = H.sh(H.EXE .. ' --max_restarts=x spec/dist/elastic_recipe.lua', 30)
    assert.equal(1, rc, out)
    has(out, 'gptlua: --max_restarts expected a whole number, got x')
    out, rc = H.sh(H.EXE .. ' --max_restarts=1 spec/dist/elastic_recipe.lua', 30)
    assert.equal(1, rc, out)
    has(out, 'gptlua: --max_restarts, --min_ranks and --rdzv_timeout go with -n N')
    out, rc = H.sh(H.EXE .. ' -n 1 --rdzv_timeout=0 spec/dist/elastic_recipe.lua', 30)
    assert.equal(1, rc, out)
    has(out, 'gptlua: --rdzv_timeout expected a number of seconds > 0, got 0')
    -- on several nodes --min_ranks counts every node's ranks
    out, rc = H.sh('env NNODES=2 NODE_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 ' .. H.EXE
      .. ' -n 2 --launcher=tcp --min_ranks=5 spec/dist/elastic_recipe.lua', 30)
    assert.equal(1, rc, out)
    has(out, 'gptlua -n: --min_ranks expected an integer in 1..4 (the ranks of NNODES x -n), got 5')
  end)
end)

-- Two nodes on this host, one TCP launcher a node (NNODES=2, NODE_RANK,
-- MASTER_ADDR=127.0.0.1): with --max_restarts the launchers meet at node
-- 0's before each attempt (gptlua.dist.rendezvous; the link lost between
-- two namespaces is spec/dist_netns_failure_spec.lua's).
describe('gptlua -n N --max_restarts on two nodes (one launcher a node)', function()
  -- runs both launchers at once; their outputs and statuses, by node
  local function two_nodes(dir, flags_of_node, env)
    local port = require('gptlua.dist.launch').free_port()
    local parts = {}
    for node = 0, 1 do
      parts[#parts + 1] = ('(env GPTLUA_SPEC_BACKEND=gloo NNODES=2 NODE_RANK=%d MASTER_ADDR=127.0.0.1 MASTER_PORT=%d %s '
        .. '%s -n 1 --launcher=tcp %s spec/dist/elastic_recipe.lua --out_dir=%s --dist=ddp > %s/node%d.log 2>&1; '
        .. 'echo "node %d status $?" >> %s/node%d.log) &'):format(node, port, env or '', H.EXE, flags_of_node(node), dir,
        dir, node, node, dir, node)
    end
    local script = dir .. '/nodes.sh'
    local f = assert(io.open(script, 'wb'))
    f:write(table.concat(parts, '\n'), '\nwait\n')
    f:close()
    H.sh('bash ' .. script, 240)
    local logs, statuses = {}, {}
    for node = 0, 1 do
      logs[node + 1] = read(('%s/node%d.log'):format(dir, node))
      statuses[node + 1] = tonumber(logs[node + 1]:match('node %d status (%d+)'))
    end
    return logs, statuses
  end

  it('a rank of node 1 killed mid-run -> both launchers meet again, the job restarts on both nodes and ends on '
    .. 'the uninterrupted run\'s parameters', function()
    local dir = H.tmpdir()
    local logs, statuses = two_nodes(dir, function() return '--max_restarts=1 --rdzv_timeout=60' end,
      'GPTLUA_TEST_EXIT_AT=1:5')
    local out = logs[1] .. logs[2]
    assert.same({ 0, 0 }, statuses, out)
    has(logs[2], 'test hook: exiting before step 5')
    -- every node joined: the round closed without waiting out the timeout
    has(logs[1], 'gptlua -n: restart 1 of 1 on 2 ranks (nodes 0, 1), from the last checkpoint')
    has(logs[2], 'gptlua -n: restart 1 of 1 on 2 ranks (nodes 0, 1), from the last checkpoint')
    assert.same({ 2 }, { records(dir .. '/elastic/metrics.jsonl', 'restart')[1].ranks })
    assert.equal(reference_model(), read(dir .. '/elastic/checkpoints/step_0000008/model.safetensors'))
    os.execute('rm -rf ' .. dir)
  end)

  it('fewer ranks than --min_ranks join -> one line on every node, a node started with other flags refused',
    function()
    local dir = H.tmpdir()
    local logs, statuses = two_nodes(dir, function(node)
      return ('--max_restarts=1 --min_ranks=%d --rdzv_timeout=3'):format(2 - node)
    end)
    local out = logs[1] .. logs[2]
    assert.same({ 1, 1 }, statuses, out)
    local misfit = 'node 1 was started with NNODES=2 --max_restarts=1 --min_ranks=1; the rendezvous host with NNODES=2 '
      .. '--max_restarts=1 --min_ranks=2'
    has(logs[1], 'gptlua -n: rendezvous: refused a node: ' .. misfit)
    has(logs[2], 'gptlua -n: rendezvous: ' .. misfit)
    has(logs[1], 'gptlua -n: only 1 of 2 ranks (node 0 of 2) joined the rendezvous within 3 s, fewer than '
      .. '--min_ranks=2: the job does not start')
    os.execute('rm -rf ' .. dir)
  end)
end)
