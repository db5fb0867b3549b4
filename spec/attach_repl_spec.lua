-- The attach REPL at a terminal (spec/support/pty.lua): help() and ?x in
-- the job, Tab completing the job's names, and the prompt ending when the
-- job does.  Completions are not events of the run.
local pty = require 'support.pty'
local H = require 'support.mpi'
local cjson = require 'cjson'

local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

describe('gptlua attach at a terminal', function()
  it('has help(), completes the job\'s names, and ends when the job ends', function()
    local d = H.tmpdir()
    local run = d .. '/live'
    -- the job: paused at step 3, so it waits for commands
    os.execute(('cd %s && LIVE_PAUSE_AT=3 timeout 120 %s spec/dist/live_recipe.lua --out_dir=%s --journal=false '
      .. '> %s/log 2>&1 &'):format(quote(H.ROOT), H.EXE, quote(d), quote(d)))
    os.execute(('for i in $(seq 1 600); do [ -S %s/control.sock ] && break; sleep 0.1; done'):format(quote(run)))
    local s = pty.spawn({ H.EXE, 'attach', run, '--timeout=60' }, { HOME = d, GPTLUA_HISTORY = d .. '/history',
      TERM = 'dumb', INPUTRC = '/dev/null', PATH = os.getenv('PATH') or '/usr/bin:/bin' })
    s:expect('help() for help, Tab completes')
    s:expect('> ')
    s:send('help()\n')
    s:expect('pause()  resume()  step(n)')
    s:expect('> ')
    s:send('?loss\n')                          -- help in the job, on the job's own function
    s:expect('loss(n)\r\n  loss(n): the last n training losses')
    s:expect('> ')
    s:send('trai\t')                           -- Tab: the job's names
    s:expect('trainer')
    s:send('.step\n')
    s:expect('3')
    s:expect('> ')
    s:send('cfg.max_it\t')                     -- a field of the job's table
    s:expect('cfg.max_iters')
    s:send('\n')
    s:expect('20000')
    s:expect('> ')
    -- another client stops the job: this prompt ends with it
    local o, rc = H.sh(('%s attach %s -e "stop()"'):format(H.EXE, run), 60)
    assert.equal(0, rc, o)
    s:expect('the job ended; detached', 30)
    local status = s:finish(30, true)
    assert.equal(0, status)
    -- the completions asked nothing of the run's record: only the typed commands are events
    local commands = {}
    for line in io.lines(run .. '/metrics.jsonl') do
      local m = cjson.decode(line)
      if m.event == 'control' then commands[#commands + 1] = m.command end
    end
    assert.same({ 'help()', 'help(loss, "loss")', 'trainer.step', 'cfg.max_iters', 'stop()' }, commands)
    os.execute('rm -rf ' .. quote(d))
  end)
end)
