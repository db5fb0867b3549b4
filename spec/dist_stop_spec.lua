-- Stopping a multi-rank run (issue 14): SIGINT to `gptlua -n 2`, or to one
-- of its ranks, stops every rank at the same step, which saves one
-- checkpoint (no temporaries left) and exits 0; the checkpoint resumes, and
-- a resume removes the temporaries a killed save left.  Runs the tiny
-- recipe spec/dist/stop_recipe.lua under ddp and fsdp.
local ckpt = require 'gptlua.checkpoint'
local H = require 'support.mpi'

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end
local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

describe('gptlua -n 2 stopped by SIGINT', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  -- starts the run, waits for its first metrics record, sends SIGINT to
  -- `target` ('launcher' or the rank number), and waits for the launcher
  local function interrupted_run(policy, target, launcher)
    local dir = H.tmpdir()
    local victim = target == 'launcher' and '$pid' or ('$(cat %s/pid.%d)'):format(dir, target)
    local script = ('%s -n 2 --launcher=' .. (launcher or 'mpi') .. ' spec/dist/stop_recipe.lua --out_dir=%s --dist=%s > %s/log 2>&1 & pid=$!; '
      .. 'for i in $(seq 1 600); do [ -s %s/stop/metrics.jsonl ] && break; sleep 0.1; done; '
      .. 'kill -INT %s; wait $pid; echo "exit=$?"'):format(H.EXE, dir, policy, dir, dir, victim)
    local out = H.sh('bash -c ' .. quote(script), 120)
    local log = io.open(dir .. '/log'):read('*a')
    return out, log, dir
  end

  it('SIGHUP to the launcher (its terminal closed) ends the job: no rank is left running', function()
    local dir = H.tmpdir()
    local script = ('%s -n 2 spec/dist/stop_recipe.lua --out_dir=%s > %s/log 2>&1 & pid=$!; '
      .. 'for i in $(seq 1 600); do [ -s %s/stop/metrics.jsonl ] && break; sleep 0.1; done; '
      .. 'kill -HUP $pid; wait $pid; echo "exit=$?"; sleep 3; '
      .. 'for r in 0 1; do kill -0 $(cat %s/pid.$r) 2>/dev/null && echo "rank $r alive" && kill -9 $(cat %s/pid.$r); done'
      ):format(H.EXE, dir, dir, dir, dir, dir)
    local out = H.sh('bash -c ' .. quote(script), 120)
    assert.truthy(out:find('exit=%d+'), out)
    assert.is_nil(out:find('exit=0', 1, true), out)
    assert.is_nil(out:find('alive', 1, true), out)
    os.execute('rm -rf ' .. dir)
  end)

  for _, policy in ipairs({ 'ddp', 'fsdp' }) do
    for _, target in ipairs({ 'launcher', 1 }) do
      it(('%s: SIGINT to the %s saves one checkpoint that resumes, and exits 0'):format(policy,
          target == 'launcher' and 'launcher' or 'rank ' .. target), function()
        local out, log, dir = interrupted_run(policy, target)
        has(out, 'exit=0')
        local step = tonumber(log:match('interrupted at step (%d+): saving a checkpoint'))
        assert.is_not_nil(step, log)
        assert.is_nil(log:find('MPI_ERR', 1, true), log)
        local cdir = dir .. '/stop/checkpoints'
        local list = ckpt.list(cdir)
        assert.equal(1, #list, log)
        assert.equal(step, list[1].step, log)
        local left = io.popen('ls -a ' .. cdir):read('*a')
        assert.is_nil(left:find('tmp', 1, true), left)
        -- a killed save's temporaries (of both kinds) are removed when the run resumes
        os.execute(('mkdir -p %s/step_0000099.tmp-shards %s/step_0000007.tmp.123'):format(cdir, cdir))
        local o, rc = H.sh(('%s -n 2 spec/dist/stop_recipe.lua --out_dir=%s --dist=%s --resume --allow_changes --max_iters=%d')
          :format(H.EXE, dir, policy, step + 2), 120)
        assert.equal(0, rc, o)
        has(o, ('resumed from %s/step_%07d at step %d'):format(cdir, step, step))
        has(o, 'removed ' .. cdir .. '/step_0000099.tmp-shards, left by a checkpoint save that did not finish')
        has(o, 'step_0000007.tmp.123, left by')
        left = io.popen('ls -a ' .. cdir):read('*a')
        assert.is_nil(left:find('tmp', 1, true), left)
        assert.equal(step + 2, ckpt.list(cdir)[#ckpt.list(cdir)].step)
        os.execute('rm -rf ' .. dir)
      end)
    end
  end

  -- the TCP launcher (Gloo) is the ranks' parent itself: it forwards the stop
  for _, target in ipairs({ 'launcher', 1 }) do
    it(('tcp launcher, ddp: SIGINT to the %s saves one checkpoint and exits 0'):format(
        target == 'launcher' and 'launcher' or 'rank ' .. target), function()
      local out, log, dir = interrupted_run('ddp', target, 'tcp')
      has(out, 'exit=0')
      local step = tonumber(log:match('interrupted at step (%d+): saving a checkpoint'))
      assert.is_not_nil(step, log)
      local cdir = dir .. '/stop/checkpoints'
      assert.equal(step, ckpt.list(cdir)[#ckpt.list(cdir)].step, log)
      local left = io.popen('ls -a ' .. cdir):read('*a')
      assert.is_nil(left:find('tmp', 1, true), left)
      os.execute('rm -rf ' .. dir)
    end)
  end
end)
