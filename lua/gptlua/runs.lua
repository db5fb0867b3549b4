-- gptlua.runs — which directory a training run writes, and its id (issue 15).
--
-- A run writes out_dir/name: metrics.jsonl and checkpoints/.  A new run
-- never mixes with an earlier one (nanoGPT overwrote it, PyTorch Lightning
-- writes version_N/): it
--   * continues one with --resume: the run of this name (name, name-2, ...)
--     that saved a checkpoint last, among those of the same model, or the
--     run whose latest checkpoint --resume=PATH names (PATH: a checkpoint,
--     or a run directory meaning its latest one);
--   * replaces it with --overwrite (the directory is deleted first);
--   * otherwise takes the first of name, name-2, name-3, ... that does not
--     exist yet, creating it with mkdir, which is atomic, so two runs
--     started at once get two directories.  A run resumed from some other
--     checkpoint (another run's, or an earlier one of this run) is a new run
--     too: it starts from that checkpoint in a directory of its own.
-- Each run has an id (name, UTC start time, random suffix) kept in its
-- checkpoints, so a resumed run keeps its id; metrics records carry it.
local ffi = require 'ffi'
local ckpt = require 'gptlua.checkpoint'

local R = {}

local libc = require 'gptlua.libc'

local EEXIST = 17
local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- seconds since the epoch, to the microsecond (metrics timestamps)
R.time = libc.realtime

-- a fresh run id: name-YYYYmmddTHHMMSS-xxxxxx (UTC, 6 random hex digits)
function R.new_id(name)
  local f = io.open('/dev/urandom', 'rb')
  local bytes = f and f:read(3) or tostring(R.time())
  if f then f:close() end
  local hex = bytes:gsub('.', function(c) return ('%02x'):format(c:byte()) end):sub(1, 6)
  return ('%s-%s-%s'):format(name, os.date('!%Y%m%dT%H%M%S'), hex)
end

-- canonical absolute path of an existing p, or nil
function R.realpath(p)
  local r = ffi.C.realpath(p, nil)
  if r == nil then return nil end
  local s = ffi.string(r)
  ffi.C.free(r)
  return s
end

-- Creates the first free one of out_dir/name, name-2, ...; returns its path
-- and its number (1 for name itself).
function R.claim(out_dir, name)
  ckpt.check_dir(out_dir, 'run')
  ckpt.mkdir_p(out_dir)
  for k = 1, 100000 do
    local path = k == 1 and (out_dir .. '/' .. name) or ('%s/%s-%d'):format(out_dir, name, k)
    if ffi.C.mkdir(path, tonumber('755', 8)) == 0 then return path, k end
    local e = ffi.errno()
    if e ~= EEXIST then
      error(('run: cannot create %s: %s'):format(path, ffi.string(ffi.C.strerror(e))), 0)
    end
  end
  error(('run: no free directory name for %s under %s'):format(name, out_dir), 0)
end

-- the path of run number k (as claim numbers them)
function R.path(out_dir, name, k)
  return k == 1 and (out_dir .. '/' .. name) or ('%s/%s-%d'):format(out_dir, name, k)
end

-- the runs of this name under out_dir: {k = number, path = dir} for name, name-2, ...
function R.list(out_dir, name)
  local out = {}
  local p = io.popen('ls -1 ' .. quote(out_dir) .. ' 2>/dev/null')
  for entry in p:lines() do
    local k
    if entry == name then k = 1
    elseif entry:sub(1, #name + 1) == name .. '-' then
      k = tonumber(entry:sub(#name + 2):match('^%d+$'))
      if k and k < 2 then k = nil end   -- name-1 is not a name claim gives
    end
    if k then out[#out + 1] = { k = k, path = out_dir .. '/' .. entry } end
  end
  p:close()
  table.sort(out, function(a, b) return a.k < b.k end)
  return out
end

local function read_state(ckpt_path)
  local f = io.open(ckpt_path .. '/state.json', 'rb')
  if not f then return nil end
  local s = f:read('*a')
  f:close()
  local ok, st = pcall(require('cjson').decode, s)
  return ok and type(st) == 'table' and st or nil
end

-- What a run does with its directory, decided from the filesystem alone so
-- that every rank decides alike: returns {checkpoint = path to load or nil,
-- k = the number of the run it continues in place (nil: a new run)}.
-- --resume without a path continues the run of this name whose latest
-- checkpoint was saved last among those whose model fits this run
-- (fits(state) says; when none fits, the newest, whose load then says why
-- it does not fit); a path continues its run when it is that run's latest
-- checkpoint.
function R.plan(cfg, fits)
  local out = { base = cfg.out_dir .. '/' .. cfg.name }
  if cfg.resume == '' or cfg.resume == false then return out end
  local spec = (cfg.resume == true or cfg.resume == 'true') and 'latest' or cfg.resume
  out.spec = spec
  if spec == 'latest' then
    ckpt.check_dir(out.base .. '/checkpoints', 'resume')  -- a file there is not "no checkpoint yet"
    local best, best_fit
    for _, run in ipairs(R.list(cfg.out_dir, cfg.name)) do
      local latest = ckpt.resolve('latest', run.path .. '/checkpoints')
      local st = latest and read_state(latest)
      if latest then
        local c = { k = run.k, checkpoint = latest, saved = st and tonumber(st.saved_at) or 0 }
        if not best or c.saved > best.saved then best = c end
        if st and fits(st) and (not best_fit or c.saved > best_fit.saved) then best_fit = c end
      end
    end
    local pick = best_fit or best
    if pick then out.checkpoint, out.k = pick.checkpoint, pick.k end
    return out
  end
  if not ckpt.exists(spec) then error(('resume: checkpoint %s not found'):format(spec), 0) end
  if not ckpt.exists(spec .. '/state.json') then  -- a run directory, or its checkpoints/: the latest there
    spec = ckpt.resolve('latest', spec .. '/checkpoints') or ckpt.resolve('latest', spec) or spec
  end
  out.checkpoint = spec
  local real = R.realpath(spec)
  for _, run in ipairs(R.list(cfg.out_dir, cfg.name)) do
    local latest = ckpt.resolve('latest', run.path .. '/checkpoints')
    if latest and R.realpath(latest) == real then out.k = run.k end
  end
  return out
end

-- seconds since the epoch when path was last written (0: it does not exist)
local function mtime(path)
  local p = io.popen('stat -c %Y ' .. quote(path) .. ' 2>/dev/null')
  local t = tonumber(p:read('*l') or '')
  p:close()
  return t or 0
end
R.mtime = mtime

-- `dir/name-1`, when no such directory exists, for the first run of that
-- name (dir/name): that directory and a line saying so; any other path as
-- it is.  (Commands that take directories as they are still take this.)
function R.first(path)
  local clean = tostring(path):gsub('/+$', '')
  local dir, name = clean:match('^(.*)/([^/]+)$')
  if not dir then dir, name = '.', clean end
  local base = name:match('^(.+)%-1$')
  if base and not ckpt.exists(clean) and ckpt.exists(dir .. '/' .. base) then
    return dir .. '/' .. base, ('%s: the first run named %s, %s/%s'):format(path, base, dir, base)
  end
  return path
end

-- A run addressed by its name, as the README's commands write it: `dir/name`
-- stands for the newest run of that name (name, name-2, ...: the one whose
-- metrics.jsonl, else directory, was written last; keep(path), when given,
-- says which may be chosen: attach wants a live socket), `dir/name-1` for
-- the first.  Returns the directory and, when it is not path itself, a
-- line saying which run was chosen.  Any other path is returned as it is.
function R.resolve(path, keep)
  local first, said = R.first(path)
  if said then return first, said end
  local clean = tostring(path):gsub('/+$', '')
  local dir, name = clean:match('^(.*)/([^/]+)$')
  if not dir then dir, name = '.', clean end
  if ckpt.exists(clean .. '/state.json') then return path end   -- a checkpoint
  local list = R.list(dir, name)
  if #list < 2 then return path end
  local best, best_t
  for _, run in ipairs(list) do
    if not keep or keep(run.path) then
      local t = math.max(mtime(run.path .. '/metrics.jsonl'), mtime(run.path))
      if not best or t >= best_t then best, best_t = run, t end
    end
  end
  if not best then return path end
  local chosen = best.path
  if dir == '.' and not clean:find('/', 1, true) then chosen = chosen:gsub('^%./', '') end
  return chosen, ('%s: the newest of %d runs named %s is %s (%s-1 names the first)'):format(path, #list, name, chosen,
    clean)
end

-- Rank 0's part: makes the run's directory as plan says (claiming a new one,
-- or deleting out_dir/name first with overwrite); returns its number k and
-- a line saying what happened, or nil.
function R.open(cfg, plan)
  if plan.k then return plan.k end
  if cfg.overwrite then
    local existed = ckpt.exists(plan.base)
    if existed then os.execute('rm -rf ' .. quote(plan.base)) end
    local _, k = R.claim(cfg.out_dir, cfg.name)
    return k, existed and ('overwrite: replaced %s'):format(plan.base) or nil
  end
  local path, k = R.claim(cfg.out_dir, cfg.name)
  if k == 1 then return k end
  return k, ('run directory %s exists: this run writes %s (--resume continues that run, --overwrite replaces it)')
    :format(plan.base, path)
end

return R
