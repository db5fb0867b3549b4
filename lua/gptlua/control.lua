-- gptlua.control — steering a running job (issue 18): `gptlua attach
-- runs/<name>` talks to the job through run_dir/control.sock
-- (gptlua.control_socket) and runs Lua inside it.
--
-- When: commands run at a step boundary, never inside a step.  Rank 0 reads
-- the socket without blocking; on several ranks whether a command is
-- pending rides in the step's loss all-reduce (train.lua's average_loss, a
-- slot beside the stop flag), so a step with no command costs no collective
-- of its own.  When one is pending every rank takes part in one exchange at
-- the boundary: the batch's length (an all-reduce of one number) and its
-- bytes (a broadcast from rank 0).
-- Where: every rank runs every command, at the same step, so the
-- collectives a command makes (checkpoint(), eval(), set{}) stay matched;
-- `ranks` chooses whose results come back (rank 0 by default; "all", or a
-- list), gathered to rank 0 with one all-gather.  `rank` in a command says
-- which rank it is on.
-- What: pause(), resume(), step(n) (n more steps, then pause), checkpoint(),
-- stop() (save and end cleanly), eval(), sample(prompt), set{key = value}
-- (validated as config values are; live keys only), reload 'hook' (the
-- recipe file read again and that hook swapped on every rank), loss(n) (the
-- last n losses), and anything else Lua reaches: trainer, model, cfg.
-- Record: every command is an event in metrics.jsonl (step, command, who);
-- every change (set, reload) is kept in trainer.live_changes with its step
-- and sequence number, saved in checkpoints (state.live) and re-applied when
-- a run resumes from one, and written into the journal (gptlua.journal) so
-- a replay applies it at the same step.
local gl = require 'gptlua'
local ffi = require 'ffi'
local cjson = require 'cjson'
local config = require 'gptlua.config'
local check = require 'gptlua.check'
local socket = require 'gptlua.control_socket'

local M = {}

-- ------------------------------------------------------------- changes --
-- Keys set{} may change while a job runs, and what else must follow them:
-- 'schedule' rebuilds the lr schedule from cfg, 'lr' sets the peak rate of
-- the optimizer's groups that key names (g.lr_key), 'wd' sets its decayed groups' weight
-- decay.  Everything else (the model's shape, data, device, dist) is fixed
-- for the job's life.
local LIVE_KEYS = {
  learning_rate = 'lr', matrix_lr = 'lr', embedding_lr = 'lr', unembedding_lr = 'lr', scalar_lr = 'lr',
  min_lr = 'schedule', final_lr_frac = 'schedule', warmup_iters = 'schedule', lr_decay_iters = 'schedule',
  decay_lr = 'schedule', schedule = 'schedule', cooldown_frac = 'schedule', weight_decay = 'wd',
  grad_clip = true, max_iters = true, eval_interval = true, eval_iters = true, log_interval = true,
  sample_interval = true, sample_length = true, sample_prompt = true, temperature = true, top_k = true,
  checkpoint_interval = true, keep_last = true, max_bad_steps = true, always_save_checkpoint = true, quiet = true,
}
-- hooks reload may swap (the build_* hooks ran once, at the start)
local SWAPPABLE = { lr_schedule = true, on_log = true, on_eval = true }

local function fail(msg) error('control: ' .. msg, 0) end

local function sorted(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks, function(a, b) return tostring(a) < tostring(b) end)
  return ks
end

-- checks values as a recipe's are checked; raises a one-line error
function M.validate_set(values, cfg, hooks)
  local train = require 'gptlua.train'
  if type(values) ~= 'table' or next(values) == nil then fail('set expects a table of config values, e.g. set{ learning_rate = 3e-4 }') end
  for _, k in ipairs(sorted(values)) do
    if type(k) ~= 'string' or train.defaults[k] == nil then config.validate({ [k] = values[k] }, train.defaults) end
    if not LIVE_KEYS[k] then
      fail(('set: %s cannot change while the job runs (keys set{} takes: %s)'):format(k, table.concat(sorted(LIVE_KEYS), ', ')))
    end
    local why = train.ignored_key(cfg, hooks, k)
    if why then fail('set: ' .. why) end
  end
  config.validate(values, train.defaults)
  for _, k in ipairs(sorted(values)) do
    local v, r = values[k], train.INTEGER_KEYS[k]
    if r then check.integer(v, 'config', k, r[1], r[2], config.NO_POSITION) end
    if LIVE_KEYS[k] == 'lr' and v < 0 or (k == 'min_lr' or k == 'weight_decay' or k == 'grad_clip') and v < 0 then
      fail(('set: %s must be >= 0, got %s'):format(k, v))
    end
    if k == 'final_lr_frac' and not (v >= 0 and v <= 1) then fail(('set: final_lr_frac must be in [0, 1], got %s'):format(v)) end
    if k == 'schedule' and v ~= 'cosine' and v ~= 'wsd' and v ~= 'constant' then
      fail(("set: unknown schedule '%s' (expected 'cosine', 'wsd' or 'constant')"):format(check.printable(v)))
    end
  end
  if values.eval_interval and values.eval_interval > 0 and (values.eval_iters or cfg.eval_iters) < 1 then
    fail('set: eval_iters must be >= 1 when eval_interval is set')
  end
end

local function optimizers(opt) return opt.optimizers or { opt } end

local function apply_set(t, values)
  local cfg = t.cfg
  local old = {}
  for k in pairs(values) do old[k] = cfg[k] end
  local schedule = false
  for _, k in ipairs(sorted(values)) do
    cfg[k] = values[k]
    local what = LIVE_KEYS[k]
    if what == 'schedule' or what == 'lr' then schedule = true end
    if what == 'wd' then
      for _, o in ipairs(optimizers(t.optimizer)) do
        for _, g in ipairs(o.groups or {}) do if (g.weight_decay or 0) > 0 then g.weight_decay = values[k] end end
      end
    end
    if what == 'lr' then
      -- the groups whose peak is this key's value times their factor (train_config, optim.nanochat);
      -- a recipe's own optimizer names none: its groups' peaks scale with learning_rate, as they were made
      local named = false
      for _, o in ipairs(optimizers(t.optimizer)) do
        for _, g in ipairs(o.groups or {}) do
          if g.lr_key then named = true end
          if g.lr_key == k then g.initial_lr = values[k] * g.lr_factor end
        end
      end
      if not named and k == 'learning_rate' and old[k] > 0 then
        for _, o in ipairs(optimizers(t.optimizer)) do
          for _, g in ipairs(o.groups or {}) do g.initial_lr = g.initial_lr * values[k] / old[k] end
        end
      end
    end
  end
  if schedule then t.schedule = (t.hooks.lr_schedule or require('gptlua.train').lr_schedule)(cfg) end
end

-- the hook `name` of the recipe whose source is src (read from path)
local function hook_from_source(name, src, path)
  local f, err = loadstring(src, '@' .. path)
  if not f then fail(('reload: %s: %s'):format(path, err)) end
  local ok, recipe = pcall(f)
  if not ok then fail(('reload: running %s failed: %s'):format(path, tostring(recipe))) end
  if type(recipe) ~= 'table' or type(recipe[name]) ~= 'function' then
    fail(('reload: %s defines no hook %s'):format(path, name))
  end
  return require('gptlua.train').checked_hook(name, recipe[name])
end

local function apply_reload(t, name, src, path)
  local h = hook_from_source(name, src, path)
  t.hooks[name] = h
  if name == 'lr_schedule' then t.schedule = h(t.cfg) end
end

-- Applies one change record ({kind = 'set', values} or {kind = 'reload',
-- hook, path, source}) to trainer t; kept in t.live_changes.
function M.apply(t, change)
  if change.kind == 'set' then apply_set(t, change.values)
  elseif change.kind == 'reload' then apply_reload(t, change.hook, change.source, change.path)
  else fail(('unknown change kind %s'):format(tostring(change.kind))) end
  t.live_changes = t.live_changes or {}
  t.live_changes[#t.live_changes + 1] = change
  if t.journal then t.journal:change(change) end
end

-- re-applies the changes a checkpoint recorded (resume), in their order
function M.reapply(t, changes)
  t.live_changes = {}
  for _, c in ipairs(changes or {}) do M.apply(t, c) end
end

local function record(t, change)
  change.seq = #(t.live_changes or {}) + 1
  change.step = t.step
  M.apply(t, change)
  return change
end

-- ------------------------------------------------------------ commands --
local Ctl = {}
Ctl.__index = Ctl

-- the controller of trainer t: rank 0 listens on run_dir/control.sock.
-- Returns nil when cfg.control is off.
function M.for_trainer(t)
  if not t.cfg.control then return nil end
  local self = setmetatable({ t = t, paused = false, pause_at = nil, stop = false,
    recipe_path = rawget(_G, 'arg') and arg[0] or nil }, Ctl)
  if t.rank == 0 then
    local path = t.run_dir .. '/control.sock'
    local server, why = socket.listen(path)
    if server then
      self.server = server
      t:print(('control: gptlua attach %s'):format(t.run_dir))
    else
      t:print(('control: no control socket for this run (%s)'):format(why))
    end
  end
  return self
end

function Ctl:close()
  if self.server then self.server:close(); self.server = nil end
end

-- rank 0: 1 when the boundary after the step being taken must hold an
-- exchange (a command waits, the job is paused or is reaching step(n)'s end)
function Ctl:pending()
  if self.t.rank ~= 0 then return 0 end
  if self.paused or (self.pause_at and self.t.step + 1 >= self.pause_at) then return 1 end
  return self.server and self.server:poll() and 1 or 0
end

-- the functions a command sees (besides _G): they act on this rank's
-- trainer; every rank runs them alike
local function environment(self, who, out)
  local t = self.t
  local env = { trainer = t, model = t.model, cfg = t.cfg, optimizer = t.optimizer, data = t.data,
                rank = t.rank, world = t.world, gl = gl }
  function env.print(...)
    local parts = {}
    for i = 1, select('#', ...) do parts[#parts + 1] = tostring((select(i, ...))) end
    out[#out + 1] = table.concat(parts, '\t')
  end
  -- pause(): hold the job at this step boundary (it keeps taking commands)
  function env.pause() self.paused, self.pause_at = true, nil; return ('paused at step %d'):format(t.step) end
  -- resume(): train on after pause() or step(n)
  function env.resume() self.paused, self.pause_at = false, nil; return ('resumed at step %d'):format(t.step) end
  -- step(n): n more steps (default 1), then pause
  function env.step(n)
    n = n or 1
    check.integer(n, 'control', 'step(n)', 1, 2 ^ 53, config.NO_POSITION)
    self.paused, self.pause_at = false, t.step + n
    return ('running %d step%s, pausing at step %d'):format(n, n == 1 and '' or 's', t.step + n)
  end
  -- stop(): save a checkpoint and end the run cleanly (exit 0), as Ctrl-C does
  function env.stop() self.stop = true; return ('stopping at step %d'):format(t.step) end
  -- checkpoint(): save a checkpoint of this step now
  function env.checkpoint() return t:save_checkpoint() or ('checkpoint of step %d saved by rank 0'):format(t.step) end
  -- eval(): the train and val loss now ({train = ..., val = ...}), recorded in metrics.jsonl
  function env.eval()
    local ev = t:evaluate()
    t:write_metrics({ step = t.step, eval = true, train_loss = ev.train, val_loss = ev.val, by = who })
    return ev
  end
  -- sample(prompt, n): n (200) characters or tokens generated from prompt (cfg.sample_prompt)
  function env.sample(prompt, n)
    if prompt ~= nil and type(prompt) ~= 'string' then fail('sample(prompt): prompt must be a string') end
    local saved = t.cfg.sample_prompt
    t.cfg.sample_prompt = prompt or saved
    local ok, text = pcall(t.sample, t, n or 200)
    t.cfg.sample_prompt = saved
    if not ok then error(text, 0) end
    return text
  end
  -- set{key = value, ...}: change live keys of the run (checked as config values; kept in checkpoints)
  function env.set(values)
    M.validate_set(values, t.cfg, t.hooks)
    local v = {}
    for k, x in pairs(values) do v[k] = x end
    local c = record(t, { kind = 'set', values = v, by = who })
    return ('set at step %d: %s'):format(c.step, cjson.encode(v))
  end
  -- reload 'lr_schedule' (or 'on_log', 'on_eval'): read the recipe file again and swap that hook
  function env.reload(name)
    if type(name) ~= 'string' or not SWAPPABLE[name] then
      fail(('reload: expected the name of a hook to swap (%s), got %s'):format(table.concat(sorted(SWAPPABLE), ', '),
        check.describe(name)))
    end
    local path = self.recipe_path
    if not path then fail('reload: this job was not started from a recipe file') end
    local f = io.open(path, 'rb')
    if not f then fail(('reload: cannot read the recipe %s'):format(path)) end
    local src = f:read('*a')
    f:close()
    local c = record(t, { kind = 'reload', hook = name, path = path, source = src, by = who })
    return ('reloaded %s from %s at step %d'):format(name, path, c.step)
  end
  -- help() in the job: what attach offers; help(x): x's signature and doc, as the REPL's
  function env.help(...)
    if select('#', ...) == 0 then return M.ATTACH_HELP end
    return require('gptlua.help').text(...)
  end
  -- Tab completion in the attach REPL: the candidates for text among the job's names, a line each
  function env.__complete(text)
    return table.concat(require('gptlua.repl').complete_in(env, text), '\n')
  end
  -- loss(n): the last n training losses (all when n is not given)
  function env.loss(n)
    local h, out2 = t.history, {}
    n = math.min(n or #h, #h)
    for i = #h - n + 1, #h do out2[#out2 + 1] = h[i] end
    return out2
  end
  return setmetatable(env, { __index = _G })
end

-- runs one command's source on this rank; returns ok and its text
local function run_command(self, cmd)
  local out = {}
  local f, err = loadstring('return ' .. cmd.code, '=attach')
  if not f then f, err = loadstring(cmd.code, '=attach') end
  if not f then return false, err end
  setfenv(f, environment(self, cmd.who, out))
  local res = { pcall(f) }
  if not res[1] then return false, tostring(res[2]) end
  local render = require('gptlua.repl').render
  for i = 2, table.maxn(res) do out[#out + 1] = render(res[i]) end
  return true, table.concat(out, '\n')
end

-- every rank's copy of rank 0's string s (others pass nil), and whether
-- any rank has received a stop signal (Ctrl-C stops a paused job too):
-- one all-reduce of {length, signal}, then a broadcast of the bytes
local function share(t, s)
  t:take_stop_signals()
  if t.world == 1 then return s, t.stop_signal == true end
  local comm = t.comm
  local head = t.control_head
  if not head then
    head = gl.empty({ 2 }, { dtype = 'float64' }):keep()
    t.control_head = head
  end
  local d = ffi.cast('double *', gl.lib.gl_data_ptr(head.c))
  d[0], d[1] = t.rank == 0 and #s or 0, t.stop_signal and 1 or 0
  comm:all_reduce(head, 'sum')
  local n, stop = d[0], d[1] > 0
  if n == 0 then return '', stop end
  local words = math.ceil(n / 4)
  local buf = gl.zeros({ words }, { dtype = 'int32' })
  local p = ffi.cast('char *', gl.lib.gl_data_ptr(buf.c))
  if t.rank == 0 then ffi.copy(p, s, n) end
  comm:broadcast(buf, 0)
  return ffi.string(p, n), stop
end

-- rank 0 gets every rank's string s (a list by rank), others nil
local function gather(t, s)
  if t.world == 1 then return { s } end
  local comm = t.comm
  local n = comm:all_reduce_number(#s, 'max')
  local words = math.ceil((n + 4) / 4)
  local mine = gl.zeros({ words }, { dtype = 'int32' })
  local p = ffi.cast('char *', gl.lib.gl_data_ptr(mine.c))
  ffi.cast('int32_t *', p)[0] = #s
  ffi.copy(p + 4, s, #s)
  local all = gl.zeros({ words * t.world }, { dtype = 'int32' })
  comm:all_gather(all, mine)
  if t.rank ~= 0 then return nil end
  local q = ffi.cast('char *', gl.lib.gl_data_ptr(all.c))
  local out = {}
  for r = 0, t.world - 1 do
    local base = q + r * words * 4
    out[r + 1] = ffi.string(base + 4, ffi.cast('int32_t *', base)[0])
  end
  return out
end

local function wants(ranks, r)
  if ranks == 'all' then return true end
  for _, x in ipairs(ranks) do if x == r then return true end end
  return false
end

-- One round: rank 0 takes the queued commands (waiting up to wait_ms for
-- one), every rank runs them, rank 0 answers.  Returns the batch's size.
function Ctl:round(wait_ms)
  local t = self.t
  local batch, s = nil, nil
  if t.rank == 0 then
    batch = self.server and (self.server:poll(wait_ms) and self.server:take()) or {}
    local wire = {}
    for i, c in ipairs(batch) do wire[i] = { code = c.code, ranks = c.ranks, who = c.who, quiet = c.quiet } end
    s = #wire > 0 and cjson.encode(wire) or ''
  end
  local stop
  s, stop = share(t, s)
  if stop then self.stop = true end
  if s == '' then return 0 end
  local wire = cjson.decode(s)
  for i, c in ipairs(wire) do
    local ok, text = run_command(self, c)
    local results
    if c.ranks ~= 'all' and #c.ranks == 1 and c.ranks[1] == 0 then
      results = { { rank = 0, ok = ok, out = text } }
    else
      local all = gather(t, cjson.encode({ ok = ok, out = text }))
      if all then
        results = {}
        for r = 0, t.world - 1 do
          if wants(c.ranks, r) then
            local x = cjson.decode(all[r + 1])
            results[#results + 1] = { rank = r, ok = x.ok, out = x.out }
          end
        end
      end
    end
    if t.rank == 0 then
      if not c.quiet then
        t:write_metrics({ step = t.step, event = 'control', command = c.code, by = c.who, ok = ok,
          error = not ok and text or nil })
      end
      local req = batch[i]
      self.server:send(req.client, cjson.encode({ id = req.id, step = t.step, results = results }))
    end
  end
  return #wire
end

-- At a step boundary (every rank calls it): on several ranks it acts only
-- when the step's all-reduce agreed something is pending.  Runs pending
-- commands; while paused keeps taking commands (an exchange every 0.2 s,
-- so the other ranks wait in short collectives, not in one that times out).
-- Returns true when the job must stop (stop(), or a stop signal while paused).
function Ctl:boundary()
  local t = self.t
  if t.world > 1 and not t.control_agreed then return false end
  t.control_agreed = false
  if self.pause_at and t.step >= self.pause_at then
    self.paused, self.pause_at = true, nil
    t:print(('control: paused at step %d'):format(t.step))
  end
  self:round(0)
  while self.paused and not self.stop do self:round(200) end
  return self.stop
end

-- ---------------------------------------------------------------- attach --
local USAGE = [[
usage: gptlua attach RUN_DIR [-e CODE ...] [--ranks=all|0,1,...] [--timeout=SECONDS]
Connects to the job writing RUN_DIR (its control.sock) and runs Lua in it at
its next step boundary, on every rank; --ranks picks whose results are shown
(default 0).  With -e runs each CODE and exits (1 if any failed); else a REPL
(:ranks all / :ranks 0,1 switch ranks; Ctrl-D detaches, the job goes on).
Commands: pause() resume() step(n) checkpoint() stop() eval() sample(prompt)
set{key = value} reload 'lr_schedule' loss(n), and trainer, model, cfg, rank.
]]

-- help() in the attach REPL
M.ATTACH_HELP = [[
Attached to a running job: each statement runs inside it at its next step
boundary, on every rank (:ranks all / :ranks 0,1 picks whose results show).
  pause()  resume()  step(n)     hold the job; go on; n more steps, then hold
  checkpoint()  stop()           save now; save and end the run (exit 0)
  eval()  sample(prompt)  loss(n) evaluate; generate; the last n losses
  set{key = value, ...}          change the run (live keys: set{bogus = 1} lists them)
  reload 'lr_schedule'           swap a hook from the recipe file (also on_log, on_eval)
  trainer  model  cfg  optimizer  data  rank  world  gl
help(x) or ?x: x's signature and doc.  Tab completes the job's names.
Ctrl-D detaches (the job goes on); the prompt ends when the job does.]]

local function parse_ranks(s)
  if s == 'all' then return 'all' end
  local out = {}
  for x in s:gmatch('[^,]+') do
    local r = tonumber(x)
    if not r or r < 0 or r % 1 ~= 0 then return nil end
    out[#out + 1] = r
  end
  return #out > 0 and out or nil
end

-- the text of a reply: rank 0's output as it is, other ranks' (asked for
-- with --ranks) each line prefixed with its rank
local function show(reply, prefixed)
  if reply.error then return false, reply.error end
  local lines, ok = {}, true
  for _, r in ipairs(reply.results or {}) do
    ok = ok and r.ok
    local text = r.out or ''
    if prefixed then text = ('[rank %d] %s'):format(r.rank, text:gsub('\n', '\n[rank ' .. r.rank .. '] ')) end
    lines[#lines + 1] = text
  end
  return ok, table.concat(lines, '\n')
end

function M.attach_main(args)
  local dir, codes, ranks, timeout = nil, {}, { 0 }, 600
  local i = 1
  while args[i] do
    local a = args[i]
    if a == '-h' or a == '--help' then io.write(USAGE) return 0
    elseif a == '-e' then
      if not args[i + 1] then io.stderr:write('gptlua attach: -e needs an argument\n') return 1 end
      codes[#codes + 1] = args[i + 1]; i = i + 1
    elseif a:match('^%-%-ranks=') then
      ranks = parse_ranks(a:sub(9))
      if not ranks then io.stderr:write(('gptlua attach: --ranks expects all or a list of ranks like 0,1, got %s\n'):format(a:sub(9))) return 1 end
    elseif a:match('^%-%-timeout=') then
      timeout = tonumber(a:sub(11))
      if not timeout or timeout <= 0 then io.stderr:write('gptlua attach: --timeout expects seconds > 0\n') return 1 end
    elseif a:sub(1, 1) == '-' then io.stderr:write('gptlua attach: unknown option ', a, '\n', USAGE) return 1
    elseif not dir then dir = a
    else io.stderr:write('gptlua attach: one run directory, got a second: ', a, '\n') return 1 end
    i = i + 1
  end
  if not dir then io.stderr:write(USAGE) return 1 end
  -- a run's name (runs/shakespeare) is the newest run of that name with a control socket
  local note
  local runs = require 'gptlua.runs'
  dir, note = runs.resolve(dir, function(d) return runs.mtime(d .. '/control.sock') > 0 end)
  if note then io.stderr:write('gptlua attach: ', note, '\n') end
  local path = dir:gsub('/+$', '') .. '/control.sock'
  local client, why = socket.client(path)
  if not client then
    io.stderr:write(('gptlua attach: cannot connect to %s: %s (is the job running?)\n'):format(path, why))
    return 1
  end
  local id = 0
  -- runs src in the job; returns ok, the text, and true when the job is gone
  local function remote(src, quiet, wait)
    id = id + 1
    local ok, err = client:send(cjson.encode({ id = id, code = src, ranks = quiet and { 0 } or ranks,
                                               quiet = quiet or nil }))
    if not ok then return false, 'gptlua attach: the job went away: ' .. err, true end
    while true do
      local line, e = client:read_line(wait or timeout)
      if not line then
        if e == 'timeout' then return false, ('gptlua attach: no answer within %g s'):format(wait or timeout) end
        return false, 'gptlua attach: the job closed the connection (it ended)', true
      end
      local reply = cjson.decode(line)
      -- (a late answer to an earlier request, a Tab completion that timed out, is dropped)
      if reply.id == nil or reply.id == id then
        return show(reply, not quiet and (ranks == 'all' or #ranks > 1 or ranks[1] ~= 0))
      end
    end
  end
  if #codes > 0 then
    local rc = 0
    for _, code in ipairs(codes) do
      local ok, text = remote(code)
      if text and text ~= '' then (ok and io.stdout or io.stderr):write(text, '\n') end
      if not ok then rc = 1 end
    end
    client:close()
    return rc
  end
  local rc = require('gptlua.repl').run({ remote = function(src)
    local r = src:match('^%s*:ranks%s+(%S+)%s*$')
    if r then
      local p = parse_ranks(r)
      if not p then return false, 'ranks: all, or a list like 0,1' end
      ranks = p
      return true, 'results from ranks ' .. r
    end
    return remote(src)
  end,
  -- Tab: the job's names (it answers at its next step boundary; none after 2 s)
  complete = function(text)
    local ok, out = remote(('return __complete(%q)'):format(text), true, 2)
    local cands = {}
    if ok then for c in out:gmatch('[^\n]+') do cands[#cands + 1] = c end end
    return cands
  end,
  watch_fd = client.fd,   -- the job's end closes the socket: the prompt ends with it
  banner = ('attached to %s: Lua runs in the job at its next step boundary; help() for help, Tab completes, '
    .. 'Ctrl-D detaches'):format(dir) })
  client:close()
  return rc
end

return M
