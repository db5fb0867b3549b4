-- gptlua.checkpoint — safetensors files and training checkpoints.
--
-- A checkpoint is a directory step_NNNNNNN/ holding model.safetensors,
-- optim.safetensors and state.json (step, RNG, data position, config, and
-- the size and FNV-1a checksum of each file).  It is written into a
-- temporary directory and renamed into place, so a crash never leaves a
-- half-written checkpoint under a real name; load verifies every checksum
-- before reading anything into the model.
local gl = require 'gptlua'
local cjson = require 'cjson'
local ffi, lib = gl.ffi, gl.lib
local describe = require('gptlua.check').describe

local M = {}

local G = require 'gptlua.ffi'

-- the C arguments of a file's tensors: count, names and tensors in name
-- order (the order both writers store them in), the metadata's JSON
local function file_args(tensors, metadata)
  local names = {}
  for n in pairs(tensors) do names[#names + 1] = n end
  table.sort(names)
  local cnames = ffi.new('const char *[?]', math.max(#names, 1))
  local cts = ffi.new('const gl_tensor *[?]', math.max(#names, 1))
  for i, n in ipairs(names) do
    cnames[i - 1] = n
    cts[i - 1] = tensors[n].c
  end
  return #names, cnames, cts, metadata and cjson.encode(metadata) or nil, names
end

-- save_safetensors(path, {name = tensor}, metadata_table_of_strings)
function M.save_safetensors(path, tensors, metadata)
  local n, cnames, cts, meta, names = file_args(tensors, metadata)
  G.check(lib.gl_safetensors_save(path, n, cnames, cts, meta), 2)
  return names
end

-- load_safetensors(path) -> {name = tensor (cpu)}, metadata table or nil
function M.load_safetensors(path)
  local f = lib.gl_safetensors_open(path)
  if f == nil then error(ffi.string(lib.gl_last_error()), 2) end
  local out = {}
  local ok, err = pcall(function()
    for i = 0, lib.gl_safetensors_count(f) - 1 do
      local name = ffi.string(lib.gl_safetensors_name(f, i))
      out[name] = gl.Tensor.wrap(lib.gl_safetensors_get(f, i))
    end
  end)
  local meta = lib.gl_safetensors_metadata(f)
  meta = meta ~= nil and cjson.decode(ffi.string(meta)) or nil
  lib.gl_safetensors_close(f)
  if not ok then error(err, 2) end
  return out, meta
end

function M.checksum(path)
  local h = ffi.new('uint64_t[1]')
  G.check(lib.gl_file_checksum(path, h), 2)
  return string.format('%016x', h[0]):gsub('ULL', '')
end

local function sh(cmd) return os.execute(cmd) end
local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
-- mkdir_p(dir): makes dir and its missing parents (mode 0755) with mkdir(2)
-- itself, not system('mkdir -p'): system() ignores SIGINT while its child
-- runs, so a Ctrl-C landing then was lost and the run went on.  Raises
-- "cannot create directory DIR: reason" when dir is not a directory after.
require 'gptlua.libc'   -- mkdir, access, strerror
function M.mkdir_p(dir)
  local sofar = dir:sub(1, 1) == '/' and '' or nil
  local err
  for part in dir:gmatch('[^/]+') do
    sofar = sofar and sofar .. '/' .. part or part
    if ffi.C.mkdir(sofar, tonumber('755', 8)) ~= 0 then
      local e = ffi.errno()
      if e ~= 17 then err = ffi.string(ffi.C.strerror(e)) end  -- 17: EEXIST
    end
  end
  -- "dir/." exists only when dir is a directory (ENOTDIR for a file)
  if ffi.C.access(dir .. '/.', 0) ~= 0 then
    local e = ffi.errno()
    error(('cannot create directory %s: %s'):format(dir, err or ffi.string(ffi.C.strerror(e))), 0)
  end
end
local function exists(p) local f = io.open(p, 'rb'); if f then f:close(); return true end return false end
M.exists = exists

-- refuses a directory path of which some part exists as a file (a
-- checkpoints path that is a file is not "no checkpoints yet")
function M.check_dir(dir, what)
  local sofar = dir:sub(1, 1) == '/' and '' or nil
  for part in dir:gmatch('[^/]+') do
    sofar = sofar and sofar .. '/' .. part or part
    local f = exists(sofar) and io.open(sofar .. '/', 'rb')
    if f then f:close()
    elseif exists(sofar) then
      error(('%s: %s is a file, expected a directory%s'):format(what, sofar,
        sofar == dir and '' or ' (on the path ' .. dir .. ')'), 0)
    end
  end
end

local function write_file(path, s)
  local f = assert(io.open(path, 'wb'))
  f:write(s)
  f:close()
end
local function read_file(path)
  local f, err = io.open(path, 'rb')
  if not f then return nil, err end
  local s = f:read('*a')
  f:close()
  return s
end

-- list of checkpoint directories (sorted by step) under dir
function M.list(dir)
  local out = {}
  local p = io.popen('ls -1 ' .. quote(dir) .. ' 2>/dev/null')
  for name in p:lines() do
    local step = name:match('^step_(%d+)$')
    if step then out[#out + 1] = { step = tonumber(step), path = dir .. '/' .. name } end
  end
  p:close()
  table.sort(out, function(a, b) return a.step < b.step end)
  return out
end

-- the last part of every save: state.json (with the files' checksums) into
-- the complete temporary directory, which is then renamed to final, so a
-- reader sees the whole checkpoint or none
local function publish(tmp, final, state, files, step)
  state.files, state.step, state.format = files, step, 'gptlua-checkpoint-1'
  write_file(tmp .. '/state.json', cjson.encode(state))
  if exists(final) then sh('rm -rf ' .. quote(final)) end
  local rok, rerr = os.rename(tmp, final)
  if not rok then error('checkpoint: rename to ' .. final .. ' failed: ' .. tostring(rerr)) end
end

-- save(dir, step, {model = {name=tensor}, optim = {name=tensor}, state = table}, keep_last, writer)
-- With a writer (M.writer) only the host copies are made now and the files
-- are written in the background: the checkpoint is published (and the
-- others pruned) when the writer is done, at a later writer:poll() or
-- writer:finish(); returns the final path and true (pending) then.
function M.save(dir, step, parts, keep_last, writer)
  M.check_dir(dir, 'checkpoint')
  local state = parts.state or {}
  if type(state.config) ~= 'table' then  -- load refuses a checkpoint without it
    error(('checkpoint.save: state.config expected a table (the run\'s config), got %s'):format(type(state.config)), 2)
  end
  if writer then writer:finish() end  -- one save in flight: the previous one is published first
  M.mkdir_p(dir)
  local final = string.format('%s/step_%07d', dir, step)
  local tmp = final .. '.tmp.' .. tostring(os.time()) .. tostring(math.random(1e9))
  M.mkdir_p(tmp)
  local names = { 'model.safetensors', 'optim.safetensors' }
  local ok, err = pcall(function()
    if writer then
      writer:add(tmp .. '/' .. names[1], parts.model)
      writer:add(tmp .. '/' .. names[2], parts.optim or {})
      writer:start({ tmp = tmp, final = final, dir = dir, step = step, keep_last = keep_last, state = state })
      return
    end
    local files = {}
    M.save_safetensors(tmp .. '/' .. names[1], parts.model)
    M.save_safetensors(tmp .. '/' .. names[2], parts.optim or {})
    for _, n in ipairs(names) do files[n] = M.checksum(tmp .. '/' .. n) end
    publish(tmp, final, state, files, step)
  end)
  if not ok then sh('rm -rf ' .. quote(tmp)); error(err, 2) end
  if writer then return final, true end
  M.prune(dir, keep_last, final)
  return final
end

-- save_collective(comm, dir, step, o): a checkpoint several ranks write
-- parts of (sharded optimizer state, pipeline stages); collective over comm.
-- Rank 0 makes dir/step_N.tmp-<o.tag>; every rank's o.write(tmp, put)
-- writes its files there, each with put(path, tensors) (as
-- save_safetensors); then rank 0 checksums o.files (every file's name),
-- writes state.json (o.state with files, step and format) and renames the
-- directory to step_N, so a reader sees all of it or none; then prunes to
-- o.keep_last.  Returns the final path on every rank.  With o.writer
-- (M.writer, one on every rank) put makes host copies only, and the
-- checkpoint is published once every rank's writer is done (see
-- Writer:poll); returns the final path and true (pending) then.
function M.save_collective(comm, dir, step, o)
  local final = ('%s/step_%07d'):format(dir, step)
  local tmp = final .. '.tmp-' .. o.tag
  local writer = o.writer
  if writer then writer:finish() end  -- (collective) the previous save is published first
  if comm.rank == 0 then
    M.mkdir_p(dir)
    sh('rm -rf ' .. quote(tmp))
    M.mkdir_p(tmp)
  end
  comm:barrier()
  if writer then
    o.write(tmp, function(path, tensors) writer:add(path, tensors) end)
    writer:start({ tmp = tmp, final = final, dir = dir, step = step, keep_last = o.keep_last, state = o.state,
                   comm = comm, files = o.files })
    return final, true
  end
  o.write(tmp, M.save_safetensors)
  comm:barrier()
  if comm.rank == 0 then
    local ok, err = pcall(function()
      local state, files = o.state, {}
      for _, n in ipairs(o.files) do files[n] = M.checksum(tmp .. '/' .. n) end
      publish(tmp, final, state, files, step)
    end)
    if not ok then sh('rm -rf ' .. quote(tmp)); error(err, 0) end
    M.prune(dir, o.keep_last, final)
  end
  comm:barrier()  -- nobody reads or prunes before the rename
  return final
end

-- keep_last: leaves the newest keep_last checkpoints under dir, the one just
-- written (path `just_saved`) always among them, whatever the step numbers
-- of the others (a run resumed from an earlier step must not lose the
-- checkpoint it just wrote to a higher-numbered one).
function M.prune(dir, keep_last, just_saved)
  if not keep_last or keep_last <= 0 then return end
  local others = {}
  for _, c in ipairs(M.list(dir)) do if c.path ~= just_saved then others[#others + 1] = c end end
  for i = 1, #others - (keep_last - 1) do sh('rm -rf ' .. quote(others[i].path)) end
end

-- Removes what a killed save left under dir: step_N.tmp.* (this file's
-- temporaries) and step_N.tmp-shards (sharded policies'); returns their
-- names.  Run once at a run's start, before any rank saves.
function M.clean_temporaries(dir)
  local removed = {}
  local p = io.popen('ls -1a ' .. quote(dir) .. ' 2>/dev/null')
  for name in p:lines() do
    if name:match('^step_%d+%.tmp') then removed[#removed + 1] = name end
  end
  p:close()
  for _, name in ipairs(removed) do sh('rm -rf ' .. quote(dir .. '/' .. name)) end
  return removed
end

-- resolves 'latest' (or true) under dir, or a path; nil if none exists
function M.resolve(spec, dir)
  if spec == true or spec == 'latest' or spec == '' then
    local all = M.list(dir)
    return all[#all] and all[#all].path or nil
  end
  return spec
end

-- the fields every checkpoint's state.json holds: without them a resume would
-- start from a guess (and then save over the checkpoint), so load refuses it
local STATE_FIELDS = {
  { 'step', 'number', 'an integer step >= 0' },
  { 'files', 'table', 'an object of file checksums' },
  { 'config', 'table', "an object holding the run's config" },
}

-- load(path) -> {model = {...}, optim = {...}, state = {...}} after
-- verifying the format, the fields above and every file's checksum
function M.load(path)
  local s, err = read_file(path .. '/state.json')
  if not s then error(('checkpoint: %s is not a checkpoint (no state.json: %s)'):format(path, tostring(err)), 2) end
  local ok, state = pcall(cjson.decode, s)
  if not ok or type(state) ~= 'table' then error(('checkpoint: %s/state.json is corrupted'):format(path), 2) end
  if state.format ~= 'gptlua-checkpoint-1' then
    error(('checkpoint: %s has format %s, expected gptlua-checkpoint-1'):format(path, describe(state.format)), 2)
  end
  for _, f in ipairs(STATE_FIELDS) do
    local v = state[f[1]]
    if v == nil then
      error(('checkpoint: %s/state.json has no %s (expected %s); not loaded'):format(path, f[1], f[3]), 2)
    elseif type(v) ~= f[2] or (f[2] == 'number' and (v ~= v or v < 0 or v % 1 ~= 0)) then
      error(('checkpoint: %s/state.json field %s expected %s, got %s; not loaded'):format(path, f[1], f[3],
        type(v) == 'table' and 'a table' or describe(v)), 2)
    end
  end
  for name, sum in pairs(state.files) do
    -- a file of this checkpoint, by its plain name (no path out of it)
    if type(name) ~= 'string' or not name:match('^[%w_%-][%w_%.%-]*$') or type(sum) ~= 'string'
      or not sum:match('^' .. ('%x'):rep(16) .. '$') then
      error(('checkpoint: %s/state.json field files expected file names with checksums (16 hex digits), got %s: %s; not loaded')
        :format(path, describe(name), describe(sum)), 2)
    end
    local p = path .. '/' .. name
    if not exists(p) then error(('checkpoint: %s is missing %s'):format(path, name), 2) end
    local got = M.checksum(p)
    if got ~= sum then
      error(('checkpoint: %s failed verification (checksum %s, expected %s); not loaded'):format(p, got, sum), 2)
    end
  end
  local model = M.load_safetensors(path .. '/model.safetensors')
  local optim = M.load_safetensors(path .. '/optim.safetensors')
  -- a pipeline-parallel run's stages write their own parts (gptlua.dist.pp_checkpoint): merged here
  local parts = state.parts
  if parts ~= nil and type(parts) ~= 'table' then
    error(('checkpoint: %s/state.json field parts expected an object of file lists, got %s; not loaded'):format(path,
      describe(parts)), 2)
  end
  for what, into in pairs({ model = model, optim = optim }) do
    local list = parts and parts[what] or {}
    if type(list) ~= 'table' then
      error(('checkpoint: %s/state.json field parts.%s expected a list of files, got %s; not loaded'):format(path, what,
        describe(list)), 2)
    end
    for _, name in ipairs(list) do
      if type(name) ~= 'string' or state.files[name] == nil then
        error(('checkpoint: %s/state.json field parts.%s expected files listed in files, got %s; not loaded'):format(path,
          what, describe(name)), 2)
      end
      for k, t in pairs(M.load_safetensors(path .. '/' .. name)) do
        if into[k] ~= nil then error(('checkpoint: %s: %s is in two of its files; not loaded'):format(path, k), 2) end
        into[k] = t
      end
    end
  end
  return { model = model, optim = optim, state = state }
end

-- ------------------------------------------------------------ the writer
-- M.writer(on_saved): the background writer of asynchronous saves (the C
-- thread of engine/ckpt_writer.c and what is published when it is done).
-- At a save, only host copies are made (pinned on a GPU); the thread
-- writes and checksums the files; the checkpoint is published (state.json,
-- the rename, pruning, on_saved(path)) by the first poll() that finds the
-- writer done, or by finish(), which waits.  A crash before the publish
-- leaves a temporary directory, which the next run removes
-- (clean_temporaries): the previous checkpoint stays the latest.  The
-- staging memory is the writer's until close(), which the trainer calls at
-- the end of a run: no garbage collection decides when it is freed.
--
-- A collective job (save_collective) is published by rank 0 once every
-- rank's files are written: each rank, once its own thread is done, leaves
-- a marker file with its files' checksums in the temporary directory, and
-- rank 0 publishes when it finds all comm.size of them; finish() is then
-- collective (every rank waits, a barrier, rank 0 publishes).
local Writer = {}
Writer.__index = Writer
local MARK = '.written.rank'

function M.writer(on_saved)
  local c = lib.gl_ckpt_writer_new()
  if c == nil then error(ffi.string(lib.gl_last_error()), 2) end
  return setmetatable({ c = c, on_saved = on_saved, added = {} }, Writer)
end

function Writer:add(path, tensors)
  if not self.c then error('checkpoint writer: used after close()', 2) end
  local n, cnames, cts, meta = file_args(tensors)
  G.check(lib.gl_ckpt_writer_add(self.c, path, n, cnames, cts, meta), 2)
  self.added[#self.added + 1] = path:match('[^/]+$')
end

-- job: tmp, final, dir, step, keep_last, state, and for a collective job comm and files
function Writer:start(job)
  job.added, self.added = self.added, {}
  -- the state as it is now: the run goes on changing its tables (history, config)
  job.state_json = cjson.encode(job.state)
  job.state = nil
  G.check(lib.gl_ckpt_writer_start(self.c), 2)
  self.job = job
end

-- the finished job's checksums by file name; raises the writer's error
function Writer:_checksums(job)
  local sums, h = {}, ffi.new('uint64_t[1]')
  for i, name in ipairs(job.added) do
    G.check(lib.gl_ckpt_writer_checksum(self.c, i - 1, h), 3)
    sums[name] = string.format('%016x', h[0]):gsub('ULL', '')
  end
  return sums
end

function Writer:_publish(job, files)
  publish(job.tmp, job.final, cjson.decode(job.state_json), files, job.step)
  M.prune(job.dir, job.keep_last, job.final)
  job.published = true
  if not job.comm then self.job = nil end  -- a collective job stays until finish(), on every rank alike
  if self.on_saved then self.on_saved(job.final) end
end

-- a collective job: this rank's marker (written, then renamed into place);
-- rank 0 publishes when every rank's marker is there
function Writer:_collective_done(job)
  if not job.marked then
    local name = ('%s/%s%05d'):format(job.tmp, MARK, job.comm.rank)
    write_file(name .. '.part', cjson.encode(self:_checksums(job)))
    assert(os.rename(name .. '.part', name))
    job.marked = true
  end
  if job.comm.rank ~= 0 or job.published then return end
  local files = {}
  for r = 0, job.comm.size - 1 do
    local s = read_file(('%s/%s%05d'):format(job.tmp, MARK, r))
    if not s then return end
    for k, v in pairs(cjson.decode(s)) do files[k] = v end
  end
  for _, n in ipairs(job.files) do
    if not files[n] then error(('checkpoint: no rank wrote %s of %s'):format(n, job.final), 0) end
  end
  for r = 0, job.comm.size - 1 do os.remove(('%s/%s%05d'):format(job.tmp, MARK, r)) end
  self:_publish(job, files)
end

-- At a step boundary: publishes the job the thread has finished (never waits).
function Writer:poll()
  local job = self.job
  if not job or job.published or (job.marked and job.comm.rank ~= 0) then return end
  local busy = lib.gl_ckpt_writer_busy(self.c)
  if busy == 1 then return end
  if busy ~= 0 then self.job = nil; G.check(busy, 2) end
  if job.comm then self:_collective_done(job)
  else self:_publish(job, self:_checksums(job)) end
end

-- Waits for the job in flight and publishes it; collective (over the job's
-- comm) for a collective job, so every rank of it calls finish at the same point.
function Writer:finish()
  local job = self.job
  if not job then return end
  local rc = lib.gl_ckpt_writer_wait(self.c)
  if rc ~= 0 then self.job = nil; G.check(rc, 2) end
  if not job.comm then return self:_publish(job, self:_checksums(job)) end
  self:_collective_done(job)
  job.comm:barrier()   -- every rank's marker is written
  self:_collective_done(job)
  if job.comm.rank == 0 then assert(job.published, 'checkpoint: a collective save was not published') end
  self.job = nil
  job.comm:barrier()   -- published before any rank goes on
end

-- On a rank that is failing: waits for its own thread and publishes what
-- it can without communicating (a collective job: this rank's marker, and on
-- rank 0 the publish when every other rank's marker is there already).
function Writer:salvage()
  local job = self.job
  if not job or job.published or lib.gl_ckpt_writer_wait(self.c) ~= 0 then return end
  if job.comm then self:_collective_done(job) else self:_publish(job, self:_checksums(job)) end
end

-- waits for and publishes the last save, then stops the thread and frees the staging
function Writer:close()
  if not self.c then return end
  local ok, err = pcall(self.finish, self)
  lib.gl_ckpt_writer_free(self.c)
  self.c = nil
  if not ok then error(err, 2) end
end

-- every entry point checks its arguments (gptlua.check): "checkpoint.save: step must be ..."
local check = require 'gptlua.check'
check.options('checkpoint_parts', { model = 'tensor_dict', optim = 'tensor_dict?', state = 'opts?' })
check.wrap_table(M, {
  save_safetensors = 'path:string, tensors:tensor_dict, metadata:opts?', load_safetensors = 'path:string',
  checksum = 'path:string', mkdir_p = 'dir:string', check_dir = 'dir:string, what:string?', list = 'dir:string',
  save = 'dir:string, step:size, parts:checkpoint_parts, keep_last:integer?, writer:any',
  resolve = 'spec:any, dir:string?', load = 'path:string',
}, 'checkpoint.')

return M
