-- The REPL at a terminal (a pseudo-terminal, spec/support/pty.lua): Ctrl-C
-- at the prompt and during a statement, history written as statements run,
-- Tab completion of Lua names, fields, methods and file names in strings,
-- and the banner of -i after a recipe.
local pty = require 'support.pty'
local exe, root = GPTLUA.exe, GPTLUA.root

local function tmpdir()
  local d = os.tmpname(); os.remove(d)
  assert(os.execute('mkdir -p ' .. d))
  return d
end

local function slurp(p)
  local f = io.open(p, 'rb')
  if not f then return nil end
  local s = f:read('*a'); f:close(); return s
end

-- a REPL session on a terminal with its own history file
local function session(args, dir)
  dir = dir or tmpdir()
  local argv = { exe }
  for _, a in ipairs(args or {}) do argv[#argv + 1] = a end
  local s = pty.spawn(argv, { HOME = dir, GPTLUA_HISTORY = dir .. '/history', TERM = 'dumb',
    INPUTRC = '/dev/null', PATH = os.getenv('PATH') or '/usr/bin:/bin' })
  s.dir = dir
  s:expect('> ')
  return s
end

-- Ctrl-D once the prompt is back (a key typed while a statement runs meets
-- the terminal in cooked mode, where Ctrl-D is no key readline ever sees)
local function quit(s)
  s:expect('> ')
  return s:finish()
end

describe('REPL on a terminal', function()
  it('Ctrl-C stops a running statement (an endless loop, a function of the session) and keeps the session', function()
    local s = session()
    s:send('kept = 41\n'); s:expect('> ')
    -- each statement prints a marker first, so Ctrl-C is sent once it runs
    s:send('print("S" .. "1"); while true do end\n')
    s:expect('S1')
    s:send('\3')
    s:expect('interrupted')
    s:send('function spin() local n = 0 while true do n = n + 1 end end\n'); s:expect('> ')
    s:send('print("S" .. "2"); spin()\n')
    s:expect('S2')
    os.execute('sleep 0.2')
    s:send('\3')
    s:expect('interrupted')
    s:send('kept + 1\n')
    s:expect('42')
    assert.equal(0, quit(s))
  end)

  it('Ctrl-C at the prompt clears a half-typed line or statement, not the session', function()
    local s = session()
    s:send('half = ')
    s:expect('half = ')
    s:send('\3')
    s:expect('^C')
    s:send('half == nil\n')
    s:expect('true')
    s:send('for i = 1, 2 do\n'); s:expect('>> ')
    s:send('\3'); s:expect('^C')
    s:send('6 * 7\n')
    s:expect('42')
    assert.equal(0, quit(s))
  end)

  it('appends each statement to the history file as it runs, multi-line ones whole', function()
    local s = session()
    -- each step waits for its statement's output (a marker the echo cannot show)
    s:send('hist_one = 1; print("A" .. "1")\n'); s:expect('A1')
    s:send('for i = 1, 1 do\nhist_two = i\nend; print("B" .. "2")\n'); s:expect('B2')
    local h = slurp(s.dir .. '/history')  -- before the session ends
    assert.truthy(h and h:find('hist_one = 1; print("A" .. "1")', 1, true), h)
    assert.truthy(h:find('for i = 1, 1 do\nhist_two = i\nend; print("B" .. "2")', 1, true), h)
    -- a session killed outright keeps what it ran
    s:send('hist_three = 3; print("C" .. "3")\n'); s:expect('C3')
    os.execute('kill -9 ' .. s.pid)
    assert.equal(137, s:finish(5, true))
    assert.truthy(slurp(s.dir .. '/history'):find('hist_three = 3', 1, true))
    -- the next session reads it back: Up recalls the last statement, then the multi-line one whole
    local s2 = session({}, s.dir)
    s2:send('\27[A\n')
    s2:expect('C3')
    s2:send('\27[A\27[A\27[A\n')  -- (the recalled statement ran again: one more entry)
    s2:expect('B2')
    assert.equal(0, quit(s2))
  end)

  it('completes names, fields, methods and file names inside strings', function()
    local dir = tmpdir()
    local f = io.open(dir .. '/uniq_abcdef.txt', 'w'); f:write('file-content'); f:close()
    local s = session({}, dir)
    s:send('math.sq\t16)\n')
    s:expect('4')
    s:send('x = gl.ones({4})\n'); s:expect('> ')
    s:send('x:nar\t1, 2, 2):numel()\n')
    s:expect('2')
    s:send('gl.zeros_l\tx):sum():item()\n')
    s:expect('0')
    s:send('io.open("' .. dir .. '/uniq_ab\t):read("*a")\n')
    s:expect('file-content')
    assert.equal(0, quit(s))
    os.execute('rm -rf ' .. dir)
  end)

  it('after -i RECIPE, says which globals it left and they hold the trainer', function()
    local dir = tmpdir()
    local recipe = dir .. '/tiny.lua'
    local f = io.open(recipe, 'w')
    f:write(('return { name = "tiny", out_dir = %q, n_layer = 1, n_head = 2, n_embd = 16, block_size = 8, ' ..
      'batch_size = 2, max_iters = 2, eval_interval = 0, log_interval = 0, sample_length = 0, ' ..
      'device = "cpu", data_path = %q }'):format(dir, root .. '/data/tinyshakespeare.txt'))
    f:close()
    local s = session({ '-i', recipe }, dir)
    assert.truthy(s.out:find('`gl`, `trainer`, `model`, `cfg`, `data` are loaded', 1, true), s.out)
    s:send('print(trainer.step, model == trainer.model, cfg.n_embd, data.train ~= nil)\n')
    s:expect('2\ttrue\t16\ttrue')
    -- Ctrl-C during a training run started here: the trainer checkpoints and
    -- stops, and the REPL's Ctrl-C is back for the rest of the statement
    s:send('cfg.max_iters, cfg.log_interval = 1e9, 1; r = trainer:run(); print("R" .. tostring(r.interrupted)); ' ..
      'while true do end\n')
    -- the third step's log line: the trainer's Ctrl-C handler is in place (and the
    -- first metrics write, whose `mkdir -p` runs under system() with SIGINT ignored, is over)
    s:expect('    5/1000000000 | loss')
    s:send('\3')
    s:expect('Rtrue')
    os.execute('sleep 0.3')
    s:send('\3')
    s:expect('interrupted')
    assert.equal(0, quit(s))
    os.execute('rm -rf ' .. dir)
  end)
end)
