-- gptlua.journal — the per-step journal of a run (issue 18), its replay
-- check, and `gptlua replay` / `gptlua diff`.
--
-- run_dir/journal.jsonl, one JSON object a line, written by rank 0:
--   a header each time the job starts or resumes:
--     {"journal": 1, "run", "recipe", "args", "world", "from": step,
--      "resumed_from": checkpoint, "config": the effective config}
--   a record per optimizer step s (the step that took the model from s to s+1):
--     {"step": s, "loss", "grad_norm", "lr_mult", "lr" (the first parameter
--      group's): hex floats (%a, exact),
--      "ok": taken or skipped, "rng": the random stream's offset after it,
--      "data": training rows consumed after it (loaders with sample()), "changes": live changes
--      (gptlua.control) applied before it, and every journal_hash_interval
--      steps "params" / "optim": FNV-1a hashes of every parameter's bytes
--      and of the optimizer state (rank 0's: its shard under ZeRO/FSDP, alone or under tp, cp or pp); on
--      several ranks "collectives": a hash of the step's collectives (op,
--      group, sizes), checked equal across ranks one step later}
-- A run with cfg.replay = JOURNAL checks each of its steps against that
-- journal as it goes and stops at the first difference, naming the step
-- and the quantity; `gptlua replay RUN` starts such a run from one of RUN's
-- checkpoints (same recipe, arguments and world size; into a temporary
-- directory), and `gptlua diff A B` compares two runs' journals.
local gl = require 'gptlua'
local ffi = require 'ffi'
local bit = require 'bit'
local cjson = require 'cjson'

local J = {}

local function hex(x) return ('%a'):format(x) end
J.hex = hex

-- FNV-1a 64 of named tensors in name order (each name's bytes, then the
-- tensor's: gl_tensor_hash), as 16 hex digits
local PRIME = 0x100000001b3ULL
function J.hash_tensors(named)
  local names = {}
  for k in pairs(named) do names[#names + 1] = k end
  table.sort(names)
  local h = ffi.new('uint64_t[1]', 0xcbf29ce484222325ULL)
  for _, k in ipairs(names) do
    local x = h[0]
    for i = 1, #k do x = bit.bxor(x, k:byte(i)) * PRIME end
    h[0] = x
    local t = named[k]
    if t.device ~= 'cpu' then t = t:to('cpu') end   -- a host copy every journal_hash_interval steps
    t = t:contiguous()
    if gl.lib.gl_tensor_hash(t.c, h) ~= 0 then error(ffi.string(gl.lib.gl_last_error()), 2) end
  end
  return bit.tohex(h[0], 16)
end

local function read_lines(path)
  local f, err = io.open(path, 'rb')
  if not f then return nil, err end
  local out, n = {}, 0
  for line in f:lines() do
    n = n + 1
    if line:match('%S') then
      local ok, rec = pcall(cjson.decode, line)
      if not ok or type(rec) ~= 'table' then
        f:close()
        return nil, ('%s:%d: not a JSON object'):format(path, n)
      end
      out[#out + 1] = rec
    end
  end
  f:close()
  return out
end

-- {headers = {...}, steps = {[s] = record}} of a journal file (a step
-- journaled twice, by a run resumed from before it, keeps the later record)
function J.read(path)
  local recs, err = read_lines(path)
  if not recs then error(('journal: cannot read %s: %s'):format(path, err), 0) end
  local out = { headers = {}, steps = {}, last = -1, first = math.huge }
  for _, r in ipairs(recs) do
    if r.journal then out.headers[#out.headers + 1] = r
    elseif type(r.step) == 'number' then
      out.steps[r.step] = r
      out.last, out.first = math.max(out.last, r.step), math.min(out.first, r.step)
    end
  end
  return out
end

local Journal = {}
Journal.__index = Journal

-- ---------------------------------------------------------- collectives --
-- On several ranks every rank folds each collective it makes on the world
-- communicator (name, op, root, group size, the element count all ranks
-- pass alike) into a hash of the step's sequence.
-- The next step's loss all-reduce (train.lua's average_loss) carries a
-- 20-bit digest h of it and h^2 from every rank: the ranks made the same
-- sequence exactly when world * sum(h^2) == sum(h)^2 (Cauchy-Schwarz; exact
-- in a double), so a mismatch is caught, naming its step, for no collective
-- of its own.
local function fold_string(h, str)
  for i = 1, #str do h = bit.tobit(bit.bxor(h, str:byte(i)) * 403 + bit.lshift(bit.bxor(h, str:byte(i)), 24)) end
  return h
end

local function numel_of(x)
  if x == nil then return 0 end
  if x.numel then return x:numel() end
  return 0
end

-- The size every rank of a collective must agree on, where there is one:
-- all_reduce's buffer, reduce_scatter's and all_gather's whole (the counts'
-- total with uneven shards).  Rooted collectives (gather, scatter, reduce,
-- broadcast) hold their buffers on one side only and all_to_all's sizes are
-- each rank's own: for those only the op, root and group size are folded.
local function agreed_size(name, s)
  if name == 'all_reduce' then return numel_of(s.send) end
  if name == 'reduce_scatter' or name == 'all_gather' then
    local counts = s.recv_counts
    if type(counts) == 'table' then
      local n = 0
      for _, c in ipairs(counts) do n = n + c end
      return n
    end
    return name == 'reduce_scatter' and numel_of(s.send) or numel_of(s.recv)
  end
  return 0
end

local function fold_number(h, x)  -- x: an integer below 2^53, folded as two 32-bit words
  local lo = x % 4294967296
  h = bit.tobit(bit.bxor(h, bit.tobit(lo)) * 403 + bit.lshift(bit.bxor(h, bit.tobit(lo)), 24))
  local hi = (x - lo) / 4294967296
  return bit.tobit(bit.bxor(h, bit.tobit(hi)) * 403 + bit.lshift(bit.bxor(h, bit.tobit(hi)), 24))
end

local function observe_collectives(self)
  local dist = require 'gptlua.dist'
  local ids = setmetatable({}, { __index = function(t, k)  -- a name's hash, computed once
    local v = fold_string(0, tostring(k))
    t[k] = v
    return v
  end })
  -- The world communicator's collectives only: every rank makes those in
  -- one order.  A sub-group's (HSDP replicas and shard groups, a device
  -- mesh's dp/tp/cp groups) legitimately differ between groups and may
  -- interleave differently on each rank, and a send/recv pair's two sides
  -- differ by design: those are left out.
  self.coll, self.coll_done = {}, 0
  local world = self.t.comm
  dist.on_collective = function(name, comm, s)
    if comm ~= world or name == 'send' or name == 'recv' then return end
    local role = comm.role or 'world'
    local h = self.coll[role] or fold_string(0x811c9dc5, role)
    h = fold_number(h, ids[name])
    h = fold_number(h, ids[s.op or ''])
    h = fold_number(h, (s.root or 0) + 1)
    h = fold_number(h, comm.size)
    self.coll[role] = fold_number(h, agreed_size(name, s))
  end
end

-- the step's per-communicator hashes, combined independently of their order
local function combine(seqs)
  local h = 0
  for _, v in pairs(seqs) do h = bit.tobit(h + v) end
  return h
end

-- the 20-bit digest of the last finished step's collectives (0 on one rank)
function Journal:collective_digest()
  return self.coll and bit.band(self.coll_done, 0xfffff) or 0
end

-- sum_h, sum_h2 as the all-reduce returned them: raises when ranks differed
function Journal:check_collectives(sum_h, sum_h2, world)
  if not self.coll or self.coll_step == nil then return end
  if world * sum_h2 ~= sum_h * sum_h then
    error(('journal: the ranks made different collectives in step %d (op, group or sizes differ; '
      .. 'rank %d\'s sequence hash %s)'):format(self.coll_step, self.t.rank, bit.tohex(self.coll_done)), 0)
  end
end

-- ------------------------------------------------------------- writing --

-- the journal of trainer t (rank 0 writes; every rank applies replayed
-- changes); nil when cfg.journal is off and no replay is asked for
function J.start(t, first_step, resumed_from)
  local cfg = t.cfg
  if not cfg.journal and cfg.replay == '' then return nil end
  local self = setmetatable({ t = t, changes = {}, every = cfg.journal_hash_interval }, Journal)
  if cfg.journal and t.rank == 0 then
    self.path = t.run_dir .. '/journal.jsonl'
    self.file = assert(io.open(self.path, 'ab'))
    self:write({ journal = 1, run = t.run_id, recipe = rawget(_G, 'arg') and arg[0] or nil, args = t.args or {},
      world = t.world, from = first_step, resumed_from = resumed_from, config = cfg })
  end
  if t.world > 1 then observe_collectives(self) end
  if cfg.replay ~= '' then
    self.expect = J.read(cfg.replay)
    self.replay_to = cfg.replay_to
    self:apply_replayed(first_step)
  end
  return self
end

function Journal:write(rec)
  if not self.file then return end
  self.file:write(cjson.encode(rec), '\n')
  self.file:flush()
end

-- a live change applied before the next step (gptlua.control)
function Journal:change(c) self.changes[#self.changes + 1] = c end

-- replay: the changes the journal recorded before step s that this run has
-- not applied yet (those of a checkpoint are in already: seq says)
function Journal:apply_replayed(s)
  local rec = self.expect.steps[s]
  if not (rec and rec.changes) then return end
  local have = #(self.t.live_changes or {})
  for _, c in ipairs(rec.changes) do
    if c.seq > have then
      require('gptlua.control').apply(self.t, c)
      have = have + 1
    end
  end
end

local FIELDS = { 'loss', 'grad_norm', 'lr_mult', 'lr', 'ok', 'rng', 'data', 'params', 'optim', 'collectives' }
J.FIELDS = FIELDS

-- the first field on which records a and b differ, or nil
function J.first_difference(a, b, skip)
  for _, k in ipairs(FIELDS) do
    if a[k] ~= nil and b[k] ~= nil and a[k] ~= b[k] and not (skip and skip[k]) then return k end
  end
  local ca, cb = a.changes and #a.changes or 0, b.changes and #b.changes or 0
  if ca ~= cb then return 'changes' end
  return nil
end

-- the FSDP/HSDP policy of trainer t, alone or inside the tp or pp policy
-- that wraps it (policy.inner), or nil
local function fsdp_policy(t)
  local p = t.policy
  while p do
    if p.units then return p end
    p = p.inner
  end
  return nil
end

-- the parameters this rank holds, by name: FSDP's shard of each unit (its
-- whole parameters exist only inside forward and backward: between steps
-- the model's tensors are freed), else the model's
local function local_parameters(t)
  local named = {}
  local fsdp = fsdp_policy(t)
  if fsdp then
    for i, u in ipairs(fsdp.units) do if u.pshard then named[('unit%04d.shard'):format(i)] = u.pshard end end
    return named
  end
  for _, np in ipairs(t.model:named_parameters()) do
    if not rawget(np[2], 'held_by') then named[np[1]] = np[2] end  -- (pp: another stage's)
  end
  return named
end

-- Records step s (just taken); in a replay compares it with the journal
-- (raising at a difference) and applies the changes recorded before the
-- next step.  Returns true when a replay has reached replay_to.
function Journal:step(s, loss, norm, lr_mult, ok)
  local t = self.t
  local g = t.optimizer.groups and t.optimizer.groups[1]
  local rec = { step = s, loss = hex(loss), grad_norm = hex(norm), lr_mult = hex(lr_mult), lr = g and hex(g.lr), ok = ok,
                rng = gl.get_rng_state().offset, data = t.data.train.sample and t.data.train:sample() or nil }
  if #self.changes > 0 then rec.changes, self.changes = self.changes, {} end
  if self.coll then  -- this step's collectives: compared across ranks in the next step's all-reduce
    self.coll_done, self.coll_step, self.coll = combine(self.coll), s, {}
    rec.collectives = bit.tohex(self.coll_done)
  end
  if self.every > 0 and (s + 1) % self.every == 0 and t.rank == 0 then
    rec.params = J.hash_tensors(local_parameters(t))
    rec.optim = J.hash_tensors(t.optimizer:state_dict().tensors)
  end
  self:write(rec)
  if not self.expect then return false end
  local want = self.expect.steps[s]
  if t.rank == 0 then
    if not want then
      error(('replay: step %d is not in the journal %s (it ends at step %d)'):format(s, t.cfg.replay, self.expect.last), 0)
    end
    -- the first step after a resume may make collectives the journaled step
    -- did not (a policy's lazy set-up): compared from the second step on
    local k = J.first_difference(rec, want, not self.checked and { collectives = true } or nil)
    if k then
      error(('replay: step %d differs from the journal: %s is %s, the journal has %s'):format(s, k,
        tostring(rec[k] or (rec.changes and #rec.changes) or 0), tostring(want[k] or (want.changes and #want.changes) or 0)), 0)
    end
    self.checked = (self.checked or 0) + 1
  end
  self:apply_replayed(s + 1)
  return self.replay_to > 0 and s + 1 >= self.replay_to
end

function Journal:close()
  if self.coll then require('gptlua.dist').on_collective = nil; self.coll = nil end
  if self.file then self.file:close(); self.file = nil end
  if self.expect and self.t.rank == 0 then
    -- printed even when quiet: it is what a replay is run for
    io.write(('replay: %d steps match the journal %s bit for bit\n'):format(self.checked or 0, self.t.cfg.replay))
    io.stdout:flush()
  end
end

-- ----------------------------------------------------------- replay CLI --
local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local REPLAY_USAGE = [[
usage: gptlua replay RUN_DIR [--from STEP] [--to STEP]
Re-runs RUN_DIR from its checkpoint at STEP (default: its earliest) with the
same recipe, arguments and world size, into a temporary directory, and
checks every step against RUN_DIR/journal.jsonl bit for bit (same device,
deterministic kernels): exits 0 when all match, 1 at the first difference,
naming the step and the quantity.
]]

local function opt_value(args, i, name)
  local a = args[i]
  local v = a:match('^%-%-' .. name .. '=(.*)$')
  if v then return v, i end
  if a == '--' .. name then return args[i + 1], i + 1 end
end

-- the arguments of the original run, less those replay sets itself
-- (as config.parse_args reads them: `--key value` takes the next argument
-- unless it is an option; a boolean key only a true/false word)
local REPLAY_SETS = { resume = 'string', overwrite = 'boolean', out_dir = 'string', replay = 'string',
                      replay_to = 'number', journal = 'boolean' }
local function kept_args(args)
  local out, i = {}, 1
  args = args or {}
  while args[i] do
    local a = args[i]
    local k, eq = a:match('^%-%-([%w_%.%-]+)(=?)')
    local kind = k and REPLAY_SETS[(k:gsub('%-', '_'))]
    if kind then
      local nxt = args[i + 1]
      if eq == '' and type(nxt) == 'string' and nxt:sub(1, 2) ~= '--' and (kind ~= 'boolean' or require('gptlua.config').BOOLEAN_WORDS[nxt]) then
        i = i + 1    -- its value goes with it
      end
    else out[#out + 1] = a end
    i = i + 1
  end
  return out
end
J.kept_args = kept_args

function J.replay_main(args)
  local dir, from, to
  local i = 1
  while args[i] do
    local a = args[i]
    if a == '-h' or a == '--help' then io.write(REPLAY_USAGE) return 0 end
    local v, j = opt_value(args, i, 'from')
    if v then from = tonumber(v) or -1; i = j
    else
      v, j = opt_value(args, i, 'to')
      if v then to = tonumber(v) or -1; i = j
      elseif a:sub(1, 1) == '-' then io.stderr:write('gptlua replay: unknown option ', a, '\n', REPLAY_USAGE) return 1
      elseif not dir then dir = a
      else io.stderr:write('gptlua replay: one run directory, got a second: ', a, '\n') return 1 end
    end
    i = i + 1
  end
  if not dir then io.stderr:write(REPLAY_USAGE) return 1 end
  if (from and (from < 0 or from % 1 ~= 0)) or (to and (to < 1 or to % 1 ~= 0)) then
    io.stderr:write('gptlua replay: --from and --to expect step numbers\n') return 1
  end
  local note
  dir, note = require('gptlua.runs').resolve(dir)   -- a run's name: its newest run
  if note then io.stderr:write('gptlua replay: ', note, '\n') end
  dir = dir:gsub('/+$', '')
  local jpath = dir .. '/journal.jsonl'
  local journal = J.read(jpath)
  local ckpt = require 'gptlua.checkpoint'
  local list = ckpt.list(dir .. '/checkpoints')
  local have = {}
  for _, c in ipairs(list) do have[#have + 1] = tostring(c.step) end
  local chosen
  for _, c in ipairs(list) do
    if (from == nil and not chosen) or c.step == from then chosen = c end
  end
  if not chosen then
    error(('replay: no checkpoint %sin %s/checkpoints (there: %s)'):format(from and ('of step ' .. from .. ' ') or '',
      dir, #have > 0 and table.concat(have, ', ') or 'none'), 0)
  end
  -- the header of the job that ran the steps after the checkpoint
  local head
  for _, h in ipairs(journal.headers) do if h.from <= chosen.step then head = h end end
  if not head or not head.recipe then error(('replay: %s has no header for step %d'):format(jpath, chosen.step), 0) end
  if journal.last < chosen.step then error(('replay: %s has no steps after %d'):format(jpath, chosen.step), 0) end
  local tmp = os.tmpname()
  os.remove(tmp)
  local cmd = { GPTLUA.exe }
  if head.world > 1 then cmd[#cmd + 1] = '-n ' .. head.world end
  cmd[#cmd + 1] = quote(head.recipe)
  for _, a in ipairs(kept_args(head.args)) do cmd[#cmd + 1] = quote(a) end
  for _, a in ipairs({ '--out_dir=' .. tmp, '--resume=' .. chosen.path, '--replay=' .. jpath,
      '--replay_to=' .. (to or journal.last + 1) }) do
    cmd[#cmd + 1] = quote(a)
  end
  local line = table.concat(cmd, ' ')
  io.write(('replay: %s from step %d to %d on %d rank%s\n'):format(dir, chosen.step, to or journal.last + 1, head.world,
    head.world == 1 and '' or 's'))
  io.stdout:flush()
  local ok, how, code = os.execute(line)
  os.execute('rm -rf ' .. quote(tmp))
  if type(ok) == 'number' then code = ok / 256 end   -- LuaJIT's os.execute: the raw wait status
  return (ok == true or code == 0) and 0 or 1
end

-- ------------------------------------------------------------- diff CLI --
local function journal_of(p)
  p = p:gsub('/+$', '')
  if p:match('%.jsonl$') then return p end
  return p .. '/journal.jsonl'
end

-- a value as text, tables with their keys in order (so equal tables read
-- alike), strings quoted (an empty one shows as '')
local function show_value(v)
  if type(v) == 'string' then return ("'%s'"):format(v) end
  if type(v) ~= 'table' then return tostring(v) end
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  local parts = {}
  for _, k in ipairs(keys) do parts[#parts + 1] = tostring(k) .. '=' .. show_value(v[k]) end
  return '{' .. table.concat(parts, ', ') .. '}'
end

-- the config keys on which two headers differ, as "key a vs b" strings
local function config_differences(a, b)
  local out = {}
  local ca, cb = a and a.config or {}, b and b.config or {}
  local keys = {}
  for k in pairs(ca) do keys[k] = true end
  for k in pairs(cb) do keys[k] = true end
  local names = {}
  for k in pairs(keys) do
    if k ~= 'name' and k ~= 'out_dir' and k ~= 'resume' and k ~= 'replay' and k ~= 'replay_to'
        and show_value(ca[k]) ~= show_value(cb[k]) then names[#names + 1] = k end
  end
  table.sort(names)
  for _, k in ipairs(names) do out[#out + 1] = ('%s %s vs %s'):format(k, show_value(ca[k]), show_value(cb[k])) end
  return out
end

-- two journal values (hex floats) in decimal, with as many digits as it
-- takes to tell them apart; exact: as the journal has them
local function two_values(x, y, exact)
  local nx, ny = type(x) == 'string' and tonumber(x), type(y) == 'string' and tonumber(y)
  if not (nx and ny and x:match('^%-?0x')) then return show_value(x), show_value(y) end
  if exact then return x, y end
  for digits = 6, 17 do
    local f = '%.' .. digits .. 'g'
    if f:format(nx) ~= f:format(ny) or digits == 17 then return f:format(nx), f:format(ny) end
  end
end

-- the live changes a journal recorded up to step s, in order: {step, text}
local function changes_until(j, s)
  local out = {}
  for step = j.first, math.min(s, j.last) do
    local rec = j.steps[step]
    for _, c in ipairs(rec and rec.changes or {}) do   -- (c.step: the first step it applies to)
      if (c.step or step) > s then break end
      local what = c.kind == 'set' and ('set' .. show_value(c.values or {}))
        or c.kind == 'reload' and ('reload %s from %s'):format(tostring(c.hook), tostring(c.path))
        or show_value(c)
      out[#out + 1] = { c.step or step, what }
    end
  end
  return out
end

-- what explains a divergence at step s: the first live change only one run
-- made (or made at another step), else the config differences, else nothing recorded
local function explanation(a, b, s, names, cfg)
  local ca, cb = changes_until(a, s), changes_until(b, s)
  for i = 1, math.max(#ca, #cb) do
    local x, y = ca[i], cb[i]
    if not (x and y and x[1] == y[1] and x[2] == y[2]) then
      local c, who = x or y, x and names[1] or names[2]
      return ('the live change at step %d in %s: %s'):format(c[1], who, c[2])
    end
  end
  if #cfg > 0 then return 'the config difference: ' .. table.concat(cfg, ', ') end
  return 'no recorded live change or config difference (the code, the data, the engine or nondeterminism)'
end

function J.diff_main(args)
  local exact = false
  local runs = {}
  for _, x in ipairs(args) do
    if x == '--exact' then exact = true else runs[#runs + 1] = x end
  end
  if #runs ~= 2 or runs[1] == '-h' or runs[1] == '--help' then
    io.write('usage: gptlua diff RUN_A RUN_B [--exact]\nThe first step where the journals of two runs diverge, what '
      .. 'differs (decimal; --exact: the journal\'s hex floats) and the live change or config difference that explains '
      .. 'it; exits 0 when they agree, 1 when they differ.\n')
    return #runs == 2 and 0 or 1
  end
  -- exact directories: runs/a and runs/a-2 are what they say here (runs/a-1: runs/a)
  for i, r in ipairs(runs) do
    local first, note = require('gptlua.runs').first(r)
    if note then io.stderr:write('diff: ', note, '\n') end
    runs[i] = first
  end
  args = runs
  local a, b = J.read(journal_of(args[1])), J.read(journal_of(args[2]))
  local cfg = config_differences(a.headers[1], b.headers[1])
  if #cfg > 0 then io.write('config differs: ', table.concat(cfg, ', '), '\n') end
  local first, last = math.max(a.first, b.first), math.min(a.last, b.last)
  for s = first, last do
    local ra, rb = a.steps[s], b.steps[s]
    if ra and rb then
      local k = J.first_difference(ra, rb)
      if k then
        local va, vb
        if k == 'changes' then va, vb = tostring(ra.changes and #ra.changes or 0), tostring(rb.changes and #rb.changes or 0)
        else va, vb = two_values(ra[k], rb[k], exact) end
        io.write(('%s and %s diverge at step %d: %s %s vs %s\n'):format(args[1], args[2], s, k, va, vb))
        io.write(('explained by %s\n'):format(explanation(a, b, s, args, cfg)))
        return 1
      end
    end
  end
  if a.last ~= b.last then
    io.write(('%s and %s agree on steps %d..%d; one goes on to step %d\n'):format(args[1], args[2], first, last,
      math.max(a.last, b.last)))
    return 1
  end
  io.write(('%s and %s agree on every step (%d..%d)\n'):format(args[1], args[2], first, last))
  return #cfg > 0 and 1 or 0
end

return J
