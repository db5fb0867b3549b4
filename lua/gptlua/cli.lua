-- gptlua.cli — the command line of the `gptlua` executable: options,
-- subcommands, scripts and recipes, the REPL.  A user's error (a bad key or
-- value, a missing file, no GPU: raised without a position, error(msg, 0))
-- prints as its one line; a bug (an error with a file:line) prints with a
-- traceback, and -v gives every error its traceback.
local M = { verbose = false }

-- `gptlua NAME args...`: each subcommand is one line here, a module whose
-- main(args) returns an exit status, and the line of help that says what
-- it does.
M.subcommands = {
  plot = { module = 'gptlua.observe.plot', help = 'RUN [RUN ...] [--out=FILE.png] [--terminal]: PNG of runs\' curves' },
  attach = { module = 'gptlua.control', main = 'attach_main', help = 'RUN [-e CODE] [--ranks=all]: a REPL inside a running job' },
  replay = { module = 'gptlua.journal', main = 'replay_main', help = 'RUN [--from STEP] [--to STEP]: re-run, check every step against the journal' },
  diff = { module = 'gptlua.journal', main = 'diff_main', help = 'RUN_A RUN_B [--exact]: the first step where two runs\' journals diverge, and why' },
  eval = { module = 'gptlua.eval', help = 'RUN --tasks=a.jsonl[,...] [--fewshot=K] [--bpb]: multiple-choice accuracy, bits per byte' },
  generate = { module = 'gptlua.chat', main = 'generate_main', help = 'RUN --prompt TEXT [--n=1] [--max_tokens] [--temperature] [--top_k] [--top_p] [--seed]: sample with the KV-cache engine' },
  chat = { module = 'gptlua.chat', help = 'RUN [--temperature] [--top_k] [--top_p] [--seed]: a terminal chat (Ctrl-C stops a reply, Ctrl-D ends)' },
}

local USAGE = [==[
usage: gptlua [options] [script.lua [args...]]
       gptlua recipe.lua --help          the recipe's keys, their types, values and meaning

Runs a Lua training script (a recipe) on the gptlua engine, or starts the
interactive REPL when no script is given.

options:
  -e CODE        run CODE (may be repeated; runs before the script)
  -i             enter the REPL after running the script (its globals in scope;
                 after a recipe also trainer, model, cfg and data)
  -n N           launch N ranks of the script (through mpirun; over TCP without it)
  --launcher=L   how -n starts the ranks: mpi (mpirun), tcp (gptlua itself, with
                 torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and Gloo)
                 or auto (default: mpi when mpirun is on PATH, else tcp)
  --max_restarts=K  with -n: when a rank dies or the job aborts, stop every rank and
                 start again from the last checkpoint, up to K times
  --min_ranks=M  with -n: restart on the ranks that can start if at least M
                 (the same global batch, more accumulation), else give up
  --rdzv_timeout=S  with -n on several nodes (NNODES): how long node 0's launcher
                 waits for the others before each restart (default 60)
  --plan         print the per-rank memory plan of a recipe instead of running it
                 (gptlua --plan recipe.lua [--world=N] [--rank=R] [--device_memory=80GiB] [--margin=0.1] [--key=value])
  -v, --verbose  print a traceback with every error (a user's error is otherwise one line)
  -V, --version  print the version
  -h, --help     print this help
  --             stop option parsing

examples:
  gptlua                                   interactive REPL
  gptlua recipes/shakespeare.lua           train the default char-level model
  gptlua recipes/shakespeare.lua --max_iters=100 --device=cpu
  gptlua -e 'local gl = require "gptlua"; print(gl.randn({2, 3}))'
  gptlua -i recipes/shakespeare.lua --max_iters=10
  gptlua -n 2 recipes/shakespeare.lua --dist=ddp
  gptlua --plan recipes/gpt2_124m.lua --world=8
]==]

-- the help text: the options, then the subcommands
function M.usage()
  local names = {}
  for k in pairs(M.subcommands) do names[#names + 1] = k end
  table.sort(names)
  if #names == 0 then return USAGE end
  local lines = { '\nsubcommands:' }
  for _, k in ipairs(names) do
    lines[#lines + 1] = ('  gptlua %-10s %s'):format(k, M.subcommands[k].help or '')
  end
  return USAGE .. table.concat(lines, '\n') .. '\n'
end

-- seconds of the monotonic clock (gptlua.libc): what every duration is timed with
local now = require('gptlua.libc').monotonic
M.now = now

-- error handler: message plus a traceback without this file's frames
function M.traceback(e)
  local msg = type(e) == 'string' and e or tostring(e)
  local tb = debug.traceback('', 2)
  local keep = {}
  for line in tb:gmatch('[^\n]+') do
    if not line:find('gptlua/cli%.lua') and not line:find('in function \'script_error\'', 1, true) and not line:find('%[C%]: in function \'xpcall\'') and
       not line:find('gptlua/repl%.lua') and not line:find('^%s*%(tail call%)') then
      keep[#keep + 1] = line
    end
  end
  return msg .. '\n' .. table.concat(keep, '\n')
end

-- a user's error: a message raised without a position (error(msg, 0))
function M.is_user_error(e)
  return type(e) == 'string' and not e:match('^[^\n]-:%d+: ')
end

-- the error handler of scripts: a user's error as it is, else (or with -v)
-- the message and the traceback
local function script_error(e)
  if type(e) ~= 'string' then
    -- error(value) with a value that is not a message: its tostring when it
    -- defines one, else where it was raised (a table prints as an address)
    local mt = getmetatable(e)
    if mt and mt.__tostring then
      e = tostring(e)
    else
      local where = ''
      for level = 2, 20 do
        local info = debug.getinfo(level, 'Sl')
        if not info then break end
        if info.what ~= 'C' then where = ('%s:%d: '):format(info.short_src, info.currentline); break end
      end
      e = ('%serror raised with %s instead of a message (error() takes a string)'):format(where,
        e == nil and 'nil' or 'a ' .. type(e))
      if not M.verbose then return e end
    end
  end
  if M.is_user_error(e) and not M.verbose then return e end
  return M.traceback(e)
end

-- runs f under the error handler; on failure prints to stderr
function M.protected(f, ...)
  local res = { xpcall(f, script_error, ...) }
  if not res[1] then
    -- on a rank of a distributed job: prefix with the rank and bring every rank down
    local d = package.loaded['gptlua.dist']
    if d and d.on_error then d.on_error(res[2])
    else io.stderr:write(res[2], '\n'); io.stderr:flush() end
    return false
  end
  return true, unpack(res, 2, table.maxn(res))
end

function M.main(argv)
  local exprs, interactive, nranks, plan, script, launcher = {}, false, nil, false, nil, nil
  local elastic  -- --max_restarts, --min_ranks (gptlua.dist.elastic)
  local i = 1
  while argv[i] do
    local a = argv[i]
    if a == '-h' or a == '--help' then io.write(M.usage()) return 0
    elseif a == '-v' or a == '--verbose' then M.verbose = true
    elseif a == '-V' or a == '--version' then
      io.write('gptlua ', GPTLUA.version, ' (', jit and jit.version or _VERSION, ')\n') return 0
    elseif a == '-e' then
      if not argv[i + 1] then io.stderr:write('gptlua: -e needs an argument\n') return 1 end
      exprs[#exprs + 1] = argv[i + 1]; i = i + 1
    elseif a == '-i' then interactive = true
    elseif a == '-n' then
      nranks = tonumber(argv[i + 1])
      if not nranks or nranks < 1 or nranks ~= math.floor(nranks) then
        io.stderr:write('gptlua: -n needs a positive integer, got ', tostring(argv[i + 1]), '\n') return 1
      end
      i = i + 1
    elseif a:match('^%-n%d+$') then nranks = tonumber(a:sub(3))
    elseif a == '--plan' then plan = true
    elseif a:match('^%-%-launcher=') then launcher = a:sub(12)
    elseif a:match('^%-%-max_restarts=') or a:match('^%-%-min_ranks=') or a:match('^%-%-rdzv_timeout=') then
      local k, v = a:match('^%-%-([%w_]+)=(.*)$')
      if k == 'rdzv_timeout' and not (tonumber(v) and tonumber(v) > 0) then
        io.stderr:write('gptlua: --rdzv_timeout expected a number of seconds > 0, got ', v, '\n') return 1
      elseif k ~= 'rdzv_timeout' and not (tonumber(v) and tonumber(v) >= 0 and tonumber(v) % 1 == 0) then
        io.stderr:write('gptlua: --', k, ' expected a whole number, got ', v, '\n') return 1
      end
      elastic = elastic or {}
      elastic[k] = tonumber(v)
    elseif a == '--' then i = i + 1; script = argv[i]; break
    elseif a:sub(1, 1) == '-' and a ~= '-' then
      io.stderr:write('gptlua: unknown option ', a, ' (gptlua --help lists them)\n') return 1
    elseif M.subcommands[a] and #exprs == 0 and not interactive and not nranks and not plan then
      local sub = {}
      for k = i + 1, #argv do sub[#sub + 1] = argv[k] end
      local ok, rc = M.protected(function() local c = M.subcommands[a]; return require(c.module)[c.main or 'main'](sub) end)
      return ok and (rc or 0) or 1
    else script = a; break end
    i = i + 1
  end
  local args = {}
  if script then for k = i + 1, #argv do args[#args + 1] = argv[k] end end

  if nranks then
    if not script then io.stderr:write('gptlua: -n needs a script\n') return 1 end
    return require('gptlua.dist.launch').main(nranks, script, args, launcher, elastic)
  end
  if launcher or elastic then
    io.stderr:write('gptlua: ', launcher and '--launcher goes' or '--max_restarts, --min_ranks and --rdzv_timeout go', ' with -n N\n')
    return 1
  end
  if plan then
    if not script then io.stderr:write('gptlua: --plan needs a recipe\n') return 1 end
    local ok, rc = M.protected(function() return require('gptlua.plan').main(script, args) end)
    return ok and (rc or 0) or 1
  end

  -- global arg as the standalone lua interpreter sets it
  arg = { [-1] = argv[0], [0] = script or argv[0] }
  for k, v in ipairs(args) do arg[k] = v end

  for _, code in ipairs(exprs) do
    local f, err = loadstring(code, '=(command line)')
    if not f then io.stderr:write('gptlua: ', err, '\n') return 1 end
    if not M.protected(f) then return 1 end
  end
  if script then
    local f, err
    if script == '-' then f, err = loadstring(io.read('*a'), '=stdin')
    else f, err = loadfile(script) end
    if not f then io.stderr:write('gptlua: ', err, '\n') return 1 end
    local ok, rc = M.protected(f, unpack(args))
    if not ok then return 1 end
    -- a script returns a recipe (a config table), an exit status, or nothing
    if rc ~= nil and type(rc) ~= 'table' and type(rc) ~= 'number' then
      io.stderr:write(('gptlua: %s returned %s, expected a recipe (a table of config values and hooks), ' ..
        'an exit status (a number) or nothing\n'):format(script, require('gptlua.check').describe(rc)))
      return 1
    end
    -- a recipe returns its config table: train it with the command-line
    -- overrides (or list its keys), and leave the trainer to -i's REPL
    local globals = {}
    if type(rc) == 'table' then
      local train = require 'gptlua.train'
      for _, a in ipairs(args) do
        if a == '--help' or a == '-h' then
          io.write(require('gptlua.config').usage(train.defaults, rc, require('gptlua.config_keys'), script))
          return 0
        end
      end
      local trainer
      ok = M.protected(function() trainer = select(2, train.main(rc, args)) end)
      if not ok then return 1 end
      if trainer then
        _G.trainer, _G.model, _G.cfg, _G.data = trainer, trainer.model, trainer.cfg, trainer.data
        globals = { 'trainer', 'model', 'cfg', 'data' }
      end
      rc = 0
    end
    if not interactive then return type(rc) == 'number' and rc or 0 end
    return require('gptlua.repl').run({ globals = globals })
  end
  if interactive or #exprs == 0 then
    return require('gptlua.repl').run()
  end
  return 0
end

return M
