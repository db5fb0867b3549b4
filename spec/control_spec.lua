-- Steering a running job (issue 18): `gptlua attach` to a job of
-- spec/dist/live_recipe.lua on 1 rank and on 2 ranks (mpirun) pauses it,
-- reads the loss on every rank, changes the learning rate, swaps the
-- schedule hook from the edited recipe, resumes, checkpoints and stops it;
-- metrics.jsonl and the checkpoint hold the changes and a resume applies
-- them again.  Security: the socket is 0600 and refuses another user; a
-- malformed message, or a client gone mid-command, leaves the job running;
-- a killed job's stale socket is replaced.  Every job runs under the shell
-- script's time limit (H.sh), so none outlives its spec.
local cjson = require 'cjson'
local ckpt = require 'gptlua.checkpoint'
local control = require 'gptlua.control'
local H = require 'support.mpi'

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end
local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function read(path)
  local f = assert(io.open(path, 'rb'))
  local s = f:read('*a')
  f:close()
  return s
end

local function metrics(run)
  local out = {}
  for line in read(run .. '/metrics.jsonl'):gmatch('[^\n]+') do out[#out + 1] = cjson.decode(line) end
  return out
end

-- a temporary directory holding a copy of the recipe; returns it and the run's directory
local function setup()
  local dir = H.tmpdir()
  os.execute(('cp %s/spec/dist/live_recipe.lua %s/recipe.lua'):format(H.ROOT, dir))
  return dir, dir .. '/live'
end

-- the shell lines that start the job in the background ($pid) and wait for its socket
local function start(dir, run, launch, extra)
  return {
    ('%s %s %s/recipe.lua --out_dir=%s --warmup_iters=0 %s > %s/log 2>&1 & pid=$!'):format(H.EXE, launch, dir, dir,
      extra or '', dir),
    ('for i in $(seq 1 600); do [ -S %s/control.sock ] && break; sleep 0.1; done'):format(run),
  }
end

local function script(lines) return 'bash -c ' .. quote(table.concat(lines, '\n')) end

local function steer(launch, nranks)
  local dir, run = setup()
  local A = ('%s attach %s --timeout=60 --ranks=all'):format(H.EXE, run)
  local lines = start(dir, run, launch)
  for _, l in ipairs({
    ('stat -c "mode=%%A" %s/control.sock'):format(run),
    A .. [[ -e 'pause()' -e 'trainer.step' -e 'loss(1)[1]' -e 'set{ learning_rate = 3e-4 }']],
    ("sed -i 's/^local LR_FACTOR = 1.0/local LR_FACTOR = 0.5/' %s/recipe.lua"):format(dir),
    A .. [[ -e "reload 'lr_schedule'" -e 'optimizer.groups[1].initial_lr * trainer.schedule(trainer.step)' -e 'step(3)' -e 'resume()' -e 'checkpoint()' -e 'stop()']],
    'wait $pid; echo "exit=$?"',
    ('ls %s'):format(run),
  }) do lines[#lines + 1] = l end
  local out = H.sh(script(lines), 180)
  local log = read(dir .. '/log')
  has(out, 'exit=0')
  has(out, 'mode=srw-------')
  assert.is_nil(out:find('control.sock', 1, true), out)         -- the ended job removed it
  -- paused at one step on every rank, and every rank's last loss is the same (ddp averages it)
  local step = tonumber(out:match('%[rank 0%] paused at step (%d+)'))
  assert.is_not_nil(step, out .. log)
  local losses = {}
  for r = 0, nranks - 1 do
    has(out, ('[rank %d] paused at step %d'):format(r, step))
    has(out, ('[rank %d] set at step %d: {"learning_rate":0.0003}'):format(r, step))
    has(out, ('[rank %d] reloaded lr_schedule from %s/recipe.lua at step %d'):format(r, dir, step))
    has(out, ('[rank %d] 0.00015'):format(r))                        -- 3e-4 * the reloaded 0.5
    losses[r + 1] = out:match(('%%[rank %d%%] (%%d%%.%%d+)\n'):format(r))
  end
  assert.is_not_nil(losses[1], out)
  for r = 2, nranks do assert.equal(losses[1], losses[r]) end
  -- metrics: the commands as events (with who), and the lr from the change on
  local recs = metrics(run)
  local set_event, seen_after
  for _, m in ipairs(recs) do
    if m.event == 'control' and m.command == 'set{ learning_rate = 3e-4 }' then set_event = m end
    if m.lr and m.step then
      if m.step <= step then assert.near(1e-3, m.lr, 1e-12)
      else assert.near(1.5e-4, m.lr, 1e-12); seen_after = true end
    end
  end
  assert.is_not_nil(set_event, out)
  assert.equal(step, set_event.step)
  assert.truthy(set_event.by:find('pid %d+'), set_event.by)
  assert.truthy(seen_after)
  -- the checkpoint: the effective config and both changes, the hook with its source
  local list = ckpt.list(run .. '/checkpoints')
  local last = list[#list]
  local st = cjson.decode(read(last.path .. '/state.json'))
  assert.near(3e-4, st.config.learning_rate, 1e-15)
  assert.equal(2, #st.live)
  assert.same({ 'set', step, 1 }, { st.live[1].kind, st.live[1].step, st.live[1].seq })
  assert.same({ 'reload', 'lr_schedule', step, 2 }, { st.live[2].kind, st.live[2].hook, st.live[2].step, st.live[2].seq })
  has(st.live[2].source, 'local LR_FACTOR = 0.5')
  -- resuming (the recipe file back as it was) applies both changes again
  os.execute(("sed -i 's/^local LR_FACTOR = 0.5/local LR_FACTOR = 1.0/' %s/recipe.lua"):format(dir))
  local o, rc = H.sh(('%s %s %s/recipe.lua --out_dir=%s --warmup_iters=0 --resume --allow_changes --max_iters=%d'):format(H.EXE, launch,
    dir, dir, last.step + 2), 120)
  assert.equal(0, rc, o)
  local after = 0
  for _, m in ipairs(metrics(run)) do
    if m.lr and m.step and m.step > last.step then assert.near(1.5e-4, m.lr, 1e-12); after = after + 1 end
  end
  assert.equal(2, after)
  os.execute('rm -rf ' .. dir)
end

describe('gptlua attach', function()
  it('steers a 1-rank job: pause, loss, set, reload, step, resume, checkpoint, stop; resume re-applies', function()
    steer('', 1)
  end)

  it('a malformed message is refused and a client gone mid-command leaves the job running', function()
    local dir, run = setup()
    local client = ([[
      local S = require 'gptlua.control_socket'
      local path = %q
      local c = assert(S.client(path))
      for _, m in ipairs({ 'not json at all', '{"id": 2}', '[1, 2]', '{"id": 3, "code": "1", "ranks": "some"}',
                           '{"id": 4, "code": "1 +"}' }) do
        c:send(m); print('reply', c:read_line(60))
      end
      c:close()
      local d = assert(S.client(path))          -- a command that takes a while, then gone
      d:send('{"id": 5, "code": "for i = 1, 3e7 do end return trainer.step"}'); d:close()
      local e = assert(S.client(path))          -- half a message, then gone
      e:send('{"id": 6, "code": "pau', true); e:close()
      local big = assert(S.client(path))        -- a line past the limit
      big:send(('x'):rep(S.MAX_LINE + 10), true); print('reply', big:read_line(60)); big:close()
    ]]):format(run .. '/control.sock')
    local lines = start(dir, run, '')
    for _, l in ipairs({
      ('%s -e %s'):format(H.EXE, quote(client)),
      ('%s attach %s --timeout=60 -e "trainer.step" -e "stop()"'):format(H.EXE, run),
      'wait $pid; echo "exit=$?"',
    }) do lines[#lines + 1] = l end
    local out = H.sh(script(lines), 120)
    has(out, 'exit=0')
    has(out, 'reply\t{"error":"control: malformed message (expected one JSON object a line')
    has(out, 'reply\t{"error":"control: message without code (a string of Lua), got nil"}')
    has(out, 'reply\t{"error":"control: ranks must be \\"all\\", a rank or a list of ranks, got \\"some\\""}')
    local syntax = out:match('reply\t({[^\n]*"id":4[^\n]*)')                 -- a syntax error is the command's result
    local r = cjson.decode((assert(syntax, out))).results[1]
    assert.is_false(r.ok)
    has(r.out, "attach:1: unexpected symbol near '1'")
    has(out, ('reply\t{"error":"control: message longer than %d bytes"}'):format(require('gptlua.control_socket').MAX_LINE))
    has(out, 'stopping at step')
    assert.truthy(out:match('\n(%d+)\nstopping at step'), out)          -- the job answered after all that
    os.execute('rm -rf ' .. dir)
  end)

  it('the socket is 0600: another user cannot connect, and is refused by uid if the mode is opened', function()
    local uid = io.popen('id -u'):read('*l')
    if uid ~= '0' then pending('needs root to act as another user (setpriv)') return end
    local dir, run = setup()
    local nobody = ('setpriv --reuid=65534 --regid=65534 --clear-groups %s attach %s --timeout=30 -e 1; echo "nobody=$?"')
      :format(H.EXE, run)
    local lines = start(dir, run, '')
    for _, l in ipairs({
      nobody,
      ('chmod 666 %s/control.sock'):format(run),
      nobody,
      ('%s attach %s --timeout=60 -e "stop()"'):format(H.EXE, run),
      'wait $pid; echo "exit=$?"',
    }) do lines[#lines + 1] = l end
    os.execute('chmod 755 ' .. dir)
    local out = H.sh(script(lines), 120)
    has(out, 'exit=0')
    has(out, 'cannot connect to ' .. run .. '/control.sock: Permission denied')
    has(out, "control: connection refused: not the job's user")
    assert.is_nil(out:find('nobody=0', 1, true), out)
    os.execute('rm -rf ' .. dir)
  end)

  it('a killed job leaves a stale socket; the resumed job replaces it', function()
    local dir, run = setup()
    local lines = start(dir, run, '', '--checkpoint_interval=5')
    for _, l in ipairs({
      ('for i in $(seq 1 600); do [ -d %s/checkpoints/step_0000005 ] && break; sleep 0.1; done'):format(run),
      'kill -9 $pid; wait $pid 2>/dev/null',
      ('[ -S %s/control.sock ] && echo stale-left'):format(run),
      ('%s attach %s -e 1; echo "attach=$?"'):format(H.EXE, run),
      ('%s %s/recipe.lua --out_dir=%s --resume > %s/log2 2>&1 & pid=$!'):format(H.EXE, dir, dir, dir),
      ('for i in $(seq 1 600); do %s attach %s -e 1 > /dev/null 2>&1 && break; sleep 0.1; done'):format(H.EXE, run),
      ('%s attach %s --timeout=60 -e "trainer.step >= 5" -e "stop()"'):format(H.EXE, run),
      'wait $pid; echo "exit=$?"',
    }) do lines[#lines + 1] = l end
    local out = H.sh(script(lines), 120)
    has(out, 'stale-left')
    has(out, 'Connection refused (is the job running?)')
    has(out, 'attach=1')
    has(out, 'true\nstopping at step')
    has(out, 'exit=0')
    os.execute('rm -rf ' .. dir)
  end)

  it('the attach REPL (statements from a pipe): multi-line statements, :ranks, errors kept to the statement', function()
    local dir, run = setup()
    local lines = start(dir, run, '')
    for _, l in ipairs({
      ([[printf 'pause()\nfor i = 1, 2 do\n  print("line", i)\nend\n:ranks all\nrank\nerror("boom")\nstop()\n' | %s attach %s --timeout=60; echo "repl=$?"]])
        :format(H.EXE, run),
      'wait $pid; echo "exit=$?"',
    }) do lines[#lines + 1] = l end
    local out = H.sh(script(lines), 60)
    has(out, 'line\t1\nline\t2')
    has(out, 'results from ranks all')
    has(out, '[rank 0] 0')
    has(out, '[rank 0] boom')
    has(out, '[rank 0] stopping at step')
    has(out, 'repl=1')                       -- a statement failed (as the local REPL from a pipe)
    has(out, 'exit=0')
    os.execute('rm -rf ' .. dir)
  end)

  it('a paused job still stops on SIGINT, saving its checkpoint', function()
    local dir, run = setup()
    local lines = start(dir, run, '')
    for _, l in ipairs({
      ('%s attach %s --timeout=60 -e "pause()"'):format(H.EXE, run),
      'sleep 0.5; kill -INT $pid; wait $pid; echo "exit=$?"',
      ('ls %s'):format(run),
    }) do lines[#lines + 1] = l end
    local out = H.sh(script(lines), 60)
    has(out, 'exit=0')
    local step = tonumber(out:match('paused at step (%d+)'))
    assert.is_not_nil(step, out)
    assert.is_nil(out:find('control.sock', 1, true), out)
    assert.equal(step, ckpt.list(run .. '/checkpoints')[1].step)
    os.execute('rm -rf ' .. dir)
  end)

  it('set{} takes live keys with values checked as config values are', function()
    local cfg = { eval_iters = 20 }
    local function err(v)
      local ok, e = pcall(control.validate_set, v, cfg)
      assert.is_false(ok)
      return e
    end
    assert.equal('control: set expects a table of config values, e.g. set{ learning_rate = 3e-4 }', err(nil))
    has(err({ n_layer = 3 }), 'control: set: n_layer cannot change while the job runs (keys set{} takes: ')
    has(err({ learning_rat = 1 }), 'config: unknown key learning_rat in the recipe (did you mean learning_rate?)')
    assert.equal('config: learning_rate must be a number, got string (fast)', err({ learning_rate = 'fast' }))
    assert.equal('control: set: learning_rate must be >= 0, got -1', err({ learning_rate = -1 }))
    has(err({ eval_interval = 2.5 }), 'eval_interval')
    has(err({ schedule = 'zigzag' }), "unknown schedule 'zigzag'")
    control.validate_set({ learning_rate = 3e-4, max_iters = 10 }, cfg)
  end)

  it('attach: usage and bad input are one-line errors', function()
    local o, rc = H.sh(('%s attach /nonexistent/run -e 1'):format(H.EXE), 30)
    assert.equal(1, rc)
    has(o, 'gptlua attach: cannot connect to /nonexistent/run/control.sock: No such file or directory (is the job running?)')
    o, rc = H.sh(('%s attach x --ranks=a,b'):format(H.EXE), 30)
    assert.equal(1, rc)
    has(o, 'gptlua attach: --ranks expects all or a list of ranks like 0,1, got a,b')
  end)
end)

describe('gptlua attach to a 2-rank job (mpirun)', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  it('every rank pauses at one step, shows its loss, takes the change and the hook; resume re-applies', function()
    steer('-n 2 --launcher=mpi', 2)
  end)
end)
