-- gptlua.data — token shards and the batch loader (engine/shards.c, loader.c).
--
--   local data = require 'gptlua.data'
--   local L = data.loader{ batch_size = B, block_size = T,
--     -- exactly one source:
--     tokens = int32_tensor_or_table,          -- in memory
--     files = {shard paths} or 'dir',          -- shards; a dir: its <split> files (list_shards)
--     split = 'train', shard_format = 'auto',  --   gptlua's or llm.c's by magic; 'nanogpt': raw uint16
--     text = 'path.txt', tokenizer = t,        -- a text file (char tokenizer by default)
--     source = 'random', vocab_size = V,       -- uniform random tokens (benchmarks)
--     rank = 0, world_size = 1, seed = 1337, sampling = 'random' | 'sequential',
--     bos_aligned = false, bos_id = nil, vocab_size = nil, prefetch = 4, device = 'cpu',
--     recycle = false }
--   local x, y = L:next_batch()      -- int64 (B, T); y is x shifted by one token
--   local st = L:state(); L:set_state(st)   -- plain table, exact resume (any rank count)
--   L:close()
--
-- Batches: the global stream of rows is a function of (seed, sampling, data,
-- block_size) only.  Each step consumes batch_size * world_size global rows;
-- rank r gets rows [r*B, (r+1)*B) of them, so the ranks' batches together are
-- the world_size = 1 batch of size B * world_size.  'random' draws each row's
-- window uniformly (nanoGPT's get_batch, from a counter-based RNG); 'sequential'
-- walks the data in order with stride T (epoch after epoch).
--
-- A background C thread assembles batches ahead into a ring of `prefetch`
-- tensor pairs; next_batch hands over a filled pair (no copy) and the ring
-- gets fresh tensors from the caching allocator, so in steady state the only
-- allocation per step is the returned tensors themselves.  They come from the
-- allocator's cache once earlier batches are freed (gl.scope around a step,
-- or LuaJIT's collector, which runs late as it does not see tensor memory;
-- fresh pages cost page faults).  recycle = true frees the
-- previous batch on each next_batch call instead: the steady state then
-- touches no new memory, and the previous x, y (the exact objects returned;
-- views of them stay valid) raise 'tensor has been freed' if used again.
--
-- For a CUDA device the ring holds pinned host buffers (recycled by the C
-- loader once their copy has run), and Loader:_transfer starts each batch's
-- host-to-device copy on the device's copy stream (cuda.copy_async) one
-- batch ahead: next_batch returns the batch whose copy started on the
-- previous call, after making the compute stream wait for it, and starts
-- the next one, which overlaps the step's compute.  Nothing waits on the
-- host.  state() and sample() count only the batches handed out.
local gl = require 'gptlua'
local tok = require 'gptlua.tokenizer'
local ffi, lib = gl.ffi, gl.lib
local G = require 'gptlua.ffi'
local printable = require('gptlua.check').printable
local check, check_ptr = G.check, G.check_ptr
local Tensor = gl.Tensor

local M = {}
local Loader = {}
Loader.__index = Loader
Loader.__name = 'Loader'
M.Loader = Loader

local SAMPLING = { random = 0, sequential = 1 }


-- Sorted paths of the regular files dir/<prefix>*<suffix>.
function M.list_files(dir, prefix, suffix)
  local p = check_ptr(lib.gl_list_files(dir, prefix or '', suffix or ''), 2)
  local s = ffi.string(p)
  lib.gl_data_free(p)
  local out = {}
  for line in s:gmatch('[^\n]+') do out[#out + 1] = line end
  return out
end

-- Sorted shard paths of a split in dir: the .bin files whose name has the
-- split as an underscore-separated word, which covers gptlua's
-- train_000000.bin, llm.c's tiny_shakespeare_val.bin and
-- fineweb_train_000001.bin, and nanoGPT's train.bin.
function M.list_shards(dir, split)
  split = split or 'train'
  local out = {}
  for _, p in ipairs(M.list_files(dir, '', '.bin')) do
    local name = '_' .. p:match('([^/]*)%.bin$') .. '_'
    if name:find('_' .. split .. '_', 1, true) then out[#out + 1] = p end
  end
  return out
end

-- shard_format names -> engine/gl_data.h's GL_SHARD_*
M.SHARD_FORMATS = { auto = 0, nanogpt = 1 }
local function shard_format(f, what)
  local v = M.SHARD_FORMATS[f or 'auto']
  if not v then error(("%s: shard_format expected 'auto' or 'nanogpt', got %s"):format(what, printable(f)), 3) end
  return v
end

-- Header of a shard as a table (validates it, not the payload).  format:
-- 'auto' (gptlua's or llm.c's, by magic) or 'nanogpt' (raw uint16); for
-- llm.c and nanoGPT files vocab_size is 0 (unknown) and format says which.
function M.shard_header(path, format)
  local h = ffi.new('gl_shard_header')
  check(lib.gl_shard_read_header(path, shard_format(format, 'data.shard_header'), h), 2)
  local magic = ffi.string(h.magic, 8):gsub('%z+$', '')
  return { version = h.version, token_bytes = h.token_bytes, vocab_size = tonumber(h.vocab_size),
           n_tokens = tonumber(h.n_tokens), checksum = h.checksum,
           format = ({ GLTOKENS = 'gptlua', ['LLM.C'] = 'llm.c', RAW16 = 'nanogpt' })[magic] }
end

-- What shards say about their vocabulary: vocab_size, the largest a
-- gptlua header names (0 when none does: llm.c and nanoGPT files have no
-- vocabulary), and max_id, the largest token of the files without one
-- (-1 when there are none), read in full as the loader's own check does.
function M.shards_vocab(files, format)
  local fmt = shard_format(format, 'data.shards_vocab')
  local vocab, max_id = 0, -1
  for _, f in ipairs(files) do
    local hv = M.shard_header(f, format).vocab_size
    if hv > 0 then
      vocab = math.max(vocab, hv)
    else
      local s = ffi.gc(check_ptr(lib.gl_shard_open(f, 0, fmt), 2), lib.gl_shard_close)
      max_id = math.max(max_id, tonumber(lib.gl_shard_max_id(s)))
      ffi.gc(s, nil); lib.gl_shard_close(s)
    end
  end
  return { vocab_size = vocab, max_id = max_id }
end

-- All tokens of a shard (fully validated) as an int32 tensor.
function M.read_shard(path, vocab_limit, format)
  local s = check_ptr(lib.gl_shard_open(path, vocab_limit or 0, shard_format(format, 'data.read_shard')), 2)
  s = ffi.gc(s, lib.gl_shard_close)
  local t = Tensor.wrap(lib.gl_shard_tokens(s, 0, lib.gl_shard_n_tokens(s)))
  ffi.gc(s, nil); lib.gl_shard_close(s)
  return t
end

-- A shard writer: w:append(ids) (int32/int64 tensor or Lua table), w:count(),
-- w:close() (atomic rename into place), w:abort().
local Writer = {}
Writer.__index = Writer
function M.shard_writer(path, vocab_size)
  local c = check_ptr(lib.gl_shard_writer_open(path, vocab_size), 2)
  return setmetatable({ c = ffi.gc(c, lib.gl_shard_writer_abort), path = path }, Writer)
end
function Writer:append(ids)
  if not self.c then error('shard_writer: already closed', 2) end
  if getmetatable(ids) ~= Tensor then ids = gl.tensor(ids, { dtype = 'int32' }) end
  if ids.dtype ~= 'int32' and ids.dtype ~= 'int64' then ids = ids:to('int64') end
  check(lib.gl_shard_writer_append(self.c, ids:contiguous():view(-1).c), 2)
end
function Writer:count() return tonumber(lib.gl_shard_writer_count(self.c)) end
function Writer:close()
  if not self.c then error('shard_writer: already closed', 2) end
  local c = self.c
  self.c = nil
  ffi.gc(c, nil)
  check(lib.gl_shard_writer_close(c), 2)
end
function Writer:abort()
  if not self.c then return end
  local c = self.c
  self.c = nil
  ffi.gc(c, nil)
  lib.gl_shard_writer_abort(c)
end

local function read_file(path, what) return require('gptlua.util').read_file(path, what, 2) end  -- a tail call

-- A plain text file for the character-level recipes:
-- {tokenizer = t, train = int32 tensor, val = int32 tensor}.  The split is
-- nanoGPT's: the first (1 - val_fraction) of the bytes train, the rest val.
-- opts: tokenizer (default: tok.char over the whole file), val_fraction (0.1).
function M.text_file(path, opts)
  opts = opts or {}
  local text = read_file(path, 'data.text_file')
  local t = opts.tokenizer or tok.char(text)
  local vf = opts.val_fraction or 0.1
  if vf < 0 or vf >= 1 then error('data.text_file: val_fraction expected in [0, 1), got ' .. tostring(vf), 2) end
  local n_train = math.floor(#text * (1 - vf))
  return { tokenizer = t, train = t:encode(text:sub(1, n_train), { tensor = true }),
           val = t:encode(text:sub(n_train + 1), { tensor = true }) }
end

-- an integer option in [min, max] (the shared check: refuses 2.5, NaN, inf)
local function int_opt(opts, k, default, min, max)
  local v = opts[k]
  if v == nil then v = default end
  return require('gptlua.check').integer(v, 'data.loader', k, min, max, 4)
end

-- ------------------------------------------------------------ prepare
local function mkdir_p(path)
  local ok = pcall(require('gptlua.checkpoint').mkdir_p, path)
  local f = ok and io.open(path .. '/.gptlua_probe', 'wb')
  if not f then error('data.prepare: cannot create directory ' .. path, 3) end
  f:close(); os.remove(path .. '/.gptlua_probe')
end

local function quote(p) return "'" .. p:gsub("'", "'\\''") .. "'" end
local function rm_rf(p) os.execute('rm -rf ' .. quote(p)) end
local function path_exists(p) local f = io.open(p, 'rb'); if f then f:close() end; return f ~= nil end

-- The output directory of prepare, checked before any work: an existing
-- one is refused unless force (it is replaced whole, never written into).
-- Returns the path without trailing slashes.
function M.check_output(out, force, level)
  if type(out) ~= 'string' or out:match('^/*$') then
    error(('data.prepare: out must be a directory path, got %s'):format(tostring(out)), (level or 1) + 1)
  end
  out = out:gsub('/+$', '')
  if path_exists(out) and not force then
    error(('data.prepare: output %s already exists (force = true, or prepare.lua --force, replaces it)'):format(out),
      (level or 1) + 1)
  end
  return out
end

local function file_size(path)
  local f, err = io.open(path, 'rb')
  if not f then error('data.prepare: cannot open ' .. err, 3) end
  local n = f:seek('end')
  f:close()
  return n
end

-- shards <dir>/<split>_000000.bin, ... of at most shard_tokens tokens each
local function shard_sink(dir, split, vocab, shard_tokens)
  local s = { files = {}, tokens = 0 }
  function s.append(ids)
    local off, n = 0, ids:numel()
    while off < n do
      if not s.w then
        local path = ('%s/%s_%06d.bin'):format(dir, split, #s.files)
        s.w = M.shard_writer(path, vocab)
        s.files[#s.files + 1] = path
      end
      local k = math.min(shard_tokens - s.w:count(), n - off)
      s.w:append(ids:narrow(1, off + 1, k))
      off, s.tokens = off + k, s.tokens + k
      if s.w:count() >= shard_tokens then s.w:close(); s.w = nil end
    end
  end
  function s.close() if s.w then s.w:close(); s.w = nil end end
  function s.abort() if s.w then s.w:abort(); s.w = nil end end
  return s
end

-- Tokenizes text files into shards.  opts: input (file or directory: every
-- regular file in it, sorted), tokenizer (a Tokenizer), out (directory),
-- val_fraction (0.01: the last bytes of the input), shard_tokens (1e8),
-- block_bytes (read size, 8 MB), progress (true: a status line with MB/s and
-- ETA), force (replace an existing out; without it an existing out is
-- refused), tokenizer_file (a name: the tokenizer is saved there in out).
-- Everything is written into out.partial (a leftover of a killed run is
-- removed first) and renamed to out when complete, so out is either the
-- whole result or untouched.  Each file is a document, BOS-prefixed when the tokenizer has BOS;
-- the val part starts a new document.  Files are read in blocks cut where
-- encoding the pieces equals encoding the whole (Tokenizer:safe_cut).
-- Returns {train = {paths}, val = {paths}, train_tokens, val_tokens, bytes, seconds}.
function M.prepare(opts)
  local t = opts.tokenizer
  if getmetatable(t) ~= tok.Tokenizer then error('data.prepare: tokenizer expected a Tokenizer', 2) end
  if type(opts.input) ~= 'string' or type(opts.out) ~= 'string' then
    error('data.prepare: input and out expected paths', 2)
  end
  local vf = opts.val_fraction or 0.01
  if type(vf) ~= 'number' or not (vf >= 0 and vf < 1) then
    error('data.prepare: val_fraction expected in [0, 1), got ' .. tostring(vf), 2)
  end
  local shard_tokens = require('gptlua.check').integer(opts.shard_tokens or 1e8, 'data.prepare', 'shard_tokens', 1)
  local final = M.check_output(opts.out, opts.force, 2)
  local out = final .. '.partial'
  local block = opts.block_bytes or 8 * 2 ^ 20
  local inputs
  local ok_dir, listed = pcall(M.list_files, opts.input)
  if ok_dir then inputs = listed else inputs = { opts.input } end
  if #inputs == 0 then error('data.prepare: no files in ' .. opts.input, 2) end
  local total = 0
  for _, f in ipairs(inputs) do total = total + file_size(f) end
  rm_rf(out)
  mkdir_p(out)
  local now = require('gptlua.cli').now
  local sinks = { train = shard_sink(out, 'train', t.vocab_size, shard_tokens),
                  val = shard_sink(out, 'val', t.vocab_size, shard_tokens) }
  local val_start = math.floor(total * (1 - vf) + 0.5)
  local split, done, t0, last_print = 'train', 0, now(), 0
  local function progress(final)
    if not opts.progress then return end
    local el = now() - t0
    if not final and el - last_print < 0.5 then return end
    last_print = el
    local rate = done / math.max(el, 1e-9)
    io.stdout:write(('\rprepare: %.1f/%.1f MB  %.1f MB/s  ETA %ds  train %d tok  val %d tok%s')
      :format(done / 1e6, total / 1e6, rate / 1e6, math.floor((total - done) / math.max(rate, 1)),
              sinks.train.tokens, sinks.val.tokens, final and '\n' or ''))
    io.stdout:flush()
  end
  -- encodes a piece of a document; the first non-empty piece gets BOS
  local first
  local function emit(text)
    if #text == 0 then return end
    sinks[split].append(t:encode(text, { tensor = true, bos = first and t.bos_id ~= nil }))
    first = false
  end
  local ok, err = pcall(function()
    for _, path in ipairs(inputs) do
      local f = assert(io.open(path, 'rb'))
      local carry = ''
      first = true
      while true do
        local chunk = f:read(block)
        local buf = chunk and carry .. chunk or carry
        local cut = #buf
        if chunk then
          cut = t:safe_cut(buf)
          if cut == 0 then carry = buf end
        end
        if not chunk or cut > 0 then
          local piece = buf:sub(1, cut)
          carry = buf:sub(cut + 1)
          if split == 'train' and done + #piece > val_start then
            -- the val part begins at the last newline cut before the boundary
            local at = val_start - done
            local c = t:safe_cut(piece:sub(1, at))
            if c == 0 then c = at end
            emit(piece:sub(1, c))
            split, first = 'val', true
            emit(piece:sub(c + 1))
          else
            emit(piece)
          end
          done = done + #piece
          progress(false)
        end
        if not chunk then break end
      end
      f:close()
    end
  end)
  if ok then
    ok, err = pcall(function()
      sinks.train.close(); sinks.val.close()
      if opts.tokenizer_file then t:save(out .. '/' .. opts.tokenizer_file) end
    end)
  end
  if not ok then sinks.train.abort(); sinks.val.abort(); rm_rf(out); error(err, 2) end
  -- into place: an existing output (force) is moved aside, then removed
  local old = path_exists(final) and final .. '.old'
  if old then rm_rf(old); assert(os.rename(final, old)) end
  local rok, rerr = os.rename(out, final)
  if not rok then
    if old then os.rename(old, final) end
    rm_rf(out)
    error(('data.prepare: cannot rename %s to %s: %s'):format(out, final, tostring(rerr)), 2)
  end
  if old then rm_rf(old) end
  progress(true)
  local function moved(files)
    for i, f in ipairs(files) do files[i] = final .. f:sub(#out + 1) end
    return files
  end
  return { train = moved(sinks.train.files), val = moved(sinks.val.files), train_tokens = sinks.train.tokens,
           val_tokens = sinks.val.tokens, bytes = total, seconds = now() - t0, out = final }
end

-- ------------------------------------------------------------ loader
function M.loader(opts)
  if type(opts) ~= 'table' then error('data.loader: expected a table of options', 2) end
  local B = int_opt(opts, 'batch_size', nil, 1)
  local T = int_opt(opts, 'block_size', nil, 1)
  local world = int_opt(opts, 'world_size', 1, 1)
  local rank = int_opt(opts, 'rank', 0, 0)
  local seed = int_opt(opts, 'seed', 1337, 0)
  local sampling = opts.sampling or 'random'
  if SAMPLING[sampling] == nil then
    error(("data.loader: sampling expected 'random' or 'sequential', got %s"):format(tostring(sampling)), 2)
  end
  local kinds = {}
  for _, k in ipairs({ 'tokens', 'files', 'text' }) do if opts[k] ~= nil then kinds[#kinds + 1] = k end end
  if opts.source ~= nil then
    if opts.source ~= 'random' then error("data.loader: source expected 'random', got " .. tostring(opts.source), 2) end
    kinds[#kinds + 1] = 'source'
  end
  if #kinds ~= 1 then
    error(('data.loader: expected exactly one of tokens, files, text, source; got %s')
      :format(#kinds == 0 and 'none' or table.concat(kinds, ', ')), 2)
  end
  local self = setmetatable({ batch_size = B, block_size = T, rank = rank, world_size = world, seed = seed,
                              sampling = sampling, bos_aligned = opts.bos_aligned and true or false,
                              device = opts.device or 'cpu', tokenizer = opts.tokenizer,
                              recycle = opts.recycle and true or false }, Loader)
  local bos = opts.bos_id or (opts.tokenizer and opts.tokenizer.bos_id)
  if self.bos_aligned and bos == nil then error('data.loader: bos_aligned needs bos_id (or a tokenizer with <|bos|>)', 2) end
  self.bos_id = bos
  if opts.tokenizer ~= nil and getmetatable(opts.tokenizer) ~= tok.Tokenizer then
    error('data.loader: tokenizer expected a Tokenizer, got ' .. type(opts.tokenizer), 2)
  end
  -- the vocabulary every source must fit: tokens, shard headers
  local vocab = opts.vocab_size or (opts.tokenizer and opts.tokenizer.vocab_size) or 0
  local vocab_whose = opts.vocab_size and "the loader's vocab_size (the tokenizer's or the model's)"
    or "the tokenizer's vocabulary"
  local cfg = ffi.new('gl_loader_config')
  cfg.batch_size, cfg.block_size, cfg.rank, cfg.world_size = B, T, rank, world
  cfg.seed, cfg.sampling, cfg.bos_aligned, cfg.bos_id = seed, SAMPLING[sampling], self.bos_aligned and 1 or 0, bos or -1
  cfg.vocab_size, cfg.prefetch = vocab, int_opt(opts, 'prefetch', 4, 2, 64)
  cfg.shard_format = shard_format(opts.shard_format, 'data.loader')
  self.c = ffi.gc(check_ptr(lib.gl_loader_new(cfg), 2), lib.gl_loader_free)
  if self.device ~= 'cpu' then
    local id = Tensor.device_id(self.device, 'data.loader: device')
    check(lib.gl_loader_pin_memory(self.c, 1), 2)
    -- recorded after each batch's copy; one is enough: a batch is handed out
    -- (the compute stream waits for the event) before the next copy starts
    self._copied = require('gptlua.cuda').Event(id)
  end

  if opts.text then
    local text = read_file(opts.text, 'data.loader')
    self.tokenizer = self.tokenizer or tok.char(text)
    opts = setmetatable({ tokens = self.tokenizer:encode(text, { tensor = true }) }, { __index = opts })
  end
  if opts.tokens then
    local t = opts.tokens
    if getmetatable(t) ~= Tensor then t = gl.tensor(t, { dtype = 'int32' }) end
    if t.device ~= 'cpu' then t = t:to('cpu') end
    if t.dtype ~= 'int32' and t.dtype ~= 'int64' and t.dtype ~= 'uint16' then t = t:to('int64') end
    t = t:contiguous():view(-1)
    self.tokens = t  -- the C side reads it in place: keep it alive
    check(lib.gl_loader_add_tokens(self.c, t.c), 2)
  elseif opts.files then
    local files = opts.files
    if type(files) == 'string' then
      files = M.list_shards(files, opts.split)
      if #files == 0 then
        error(('data.loader: no shards of split %s in %s (expected .bin files such as %s_000000.bin, '
          .. 'name_%s.bin, %s.bin)'):format(opts.split or 'train', opts.files, opts.split or 'train',
          opts.split or 'train', opts.split or 'train'), 2)
      end
    end
    self.files = files
    for _, f in ipairs(files) do
      -- a shard written for a bigger vocabulary is another tokenization, even
      -- where its tokens happen to fall below the limit
      local sv = vocab > 0 and M.shard_header(f, opts.shard_format).vocab_size
      if sv and sv > vocab then
        error(('data.loader: shard %s has vocabulary %d, larger than %s %d'):format(f, sv, vocab_whose, vocab), 2)
      end
      check(lib.gl_loader_add_shard(self.c, f), 2)
    end
  elseif opts.source == 'random' then
    check(lib.gl_loader_add_random(self.c, int_opt(opts, 'n_tokens', 2 ^ 40, 1)), 2)
  end
  check(lib.gl_loader_start(self.c, 0), 2)
  self.n_tokens = tonumber(lib.gl_loader_n_tokens(self.c))
  self.n_windows = tonumber(lib.gl_loader_n_windows(self.c))
  self._x, self._y = ffi.new('gl_tensor *[1]'), ffi.new('gl_tensor *[1]')
  return self
end

local function next_host_batch(self)
  check(lib.gl_loader_next(self.c, self._x, self._y), 3)
  return Tensor.wrap(self._x[0]), Tensor.wrap(self._y[0])
end

-- Starts moving a (pinned) CPU batch to the loader's device on the copy
-- stream; returns the pending batch {x, y, event}.  The device tensors are
-- kept out of any tensor scope until handed out (the copy may outlive the
-- step that started it); the CPU pair goes back to the C loader's pool once
-- the copy has run.
function Loader:_transfer(x, y)
  local cuda, ev = require 'gptlua.cuda', self._copied
  local dx = Tensor.empty(x.shape, { dtype = x.dtype, device = self.device }):keep()
  local dy = Tensor.empty(y.shape, { dtype = y.dtype, device = self.device }):keep()
  cuda.copy_async(dx, x, ev)
  cuda.copy_async(dy, y, ev)
  x:free(); y:free()
  return { x = dx, y = dy, event = ev }
end

-- the pending batch's tensors as fresh views owned by the caller (and its
-- tensor scope), ordered after the copy on the compute stream
local function hand_out(p)
  p.event:wait('compute')
  local x = p.x:_as_strided(p.x.shape, Tensor.contiguous_strides(p.x.shape), 0)
  local y = p.y:_as_strided(p.y.shape, Tensor.contiguous_strides(p.y.shape), 0)
  p.x:free(); p.y:free()
  return x, y
end

-- drops the batch copied ahead (restart, close): its rows are not consumed
local function drop_ahead(self)
  local p = self._ahead
  if p then
    self._ahead = nil
    p.x:free(); p.y:free()
  end
end

function Loader:next_batch()
  if not self.c then error('Loader:next_batch: the loader is closed', 2) end
  if self._prev_x then self._prev_x:free(); self._prev_y:free(); self._prev_x, self._prev_y = nil, nil end
  local x, y
  if self.device == 'cpu' then
    x, y = next_host_batch(self)
  else
    local p = self._ahead or self:_transfer(next_host_batch(self))
    self._ahead = nil
    x, y = hand_out(p)
    self._ahead = self:_transfer(next_host_batch(self))
  end
  if self.recycle then self._prev_x, self._prev_y = x, y end
  return x, y
end

-- seconds the last next_batch waited for the producer (0 in steady state)
function Loader:last_wait() return self.c and lib.gl_loader_last_wait(self.c) or 0 end

-- global rows consumed so far (all ranks together; a batch copied ahead to
-- the device is not consumed until next_batch hands it out)
function Loader:sample()
  local s = tonumber(lib.gl_loader_sample(self.c))
  if self._ahead then s = s - self.batch_size * self.world_size end
  return s
end

-- A plain, serialisable table.  `sample` (global rows consumed) is what
-- resumes; the rest identifies the stream and describes where it is.
function Loader:state()
  if not self.c then error('Loader:state: the loader is closed', 2) end
  local s = self:sample()
  local pos = ffi.new('gl_loader_pos')
  check(lib.gl_loader_position(self.c, s, pos), 2)
  return { version = 1, sample = s, seed = self.seed, sampling = self.sampling, block_size = self.block_size,
           bos_aligned = self.bos_aligned, n_tokens = self.n_tokens, n_windows = self.n_windows,
           epoch = tonumber(pos.epoch), source = tonumber(pos.source) + 1, offset = tonumber(pos.offset) }
end

-- Continues exactly where `st` was taken (batch_size and world_size may
-- differ; the stream must be the same).
function Loader:set_state(st)
  if not self.c then error('Loader:set_state: the loader is closed', 2) end
  if type(st) ~= 'table' or type(st.sample) ~= 'number' then error('Loader:set_state: expected a table from Loader:state()', 2) end
  for _, k in ipairs({ 'seed', 'sampling', 'block_size', 'bos_aligned', 'n_tokens' }) do
    if st[k] ~= nil and st[k] ~= self[k] then
      error(('Loader:set_state: the state is for %s = %s, this loader has %s (a different data stream)')
        :format(k, printable(st[k]), tostring(self[k])), 2)
    end
  end
  drop_ahead(self)
  check(lib.gl_loader_start(self.c, st.sample), 2)
end

function Loader:close()
  if not self.c then return end
  drop_ahead(self)
  local c = self.c
  self.c = nil
  ffi.gc(c, nil)
  lib.gl_loader_free(c)
end

function Loader:__tostring()
  return ('Loader(B=%d, T=%d, rank %d/%d, %s, %d tokens)'):format(self.batch_size, self.block_size, self.rank,
    self.world_size, self.sampling, self.n_tokens or 0)
end

-- every entry point checks its arguments and its options' fields
-- (gptlua.check): "data.loader: bos_id must be a finite integer < 2^62, got ..."
local check = require 'gptlua.check'
check.options('loader_opts', { batch_size = 'count', block_size = 'count', world_size = 'count?', rank = 'size?',
  seed = 'size?', sampling = 'string?', bos_id = 'integer?', vocab_size = 'size?', prefetch = 'integer?',
  n_tokens = 'count?', device = 'device?', text = 'string?', source = 'string?', split = 'string?',
  bos_aligned = 'boolean?', recycle = 'boolean?', shard_format = 'string?' })
check.options('prepare_opts', { input = 'string', out = 'string', tokenizer = 'opts', val_fraction = 'real?',
  shard_tokens = 'count?', block_bytes = 'count?', tokenizer_file = 'string?', force = 'boolean?' })
check.wrap_table(M, { list_files = 'dir:string, prefix:string?, suffix:string?', list_shards = 'dir:string, split:string?',
  shard_header = 'path:string, format:string?', shards_vocab = 'files:opts, format:string?', read_shard = 'path:string, vocab_limit:size?, format:string?', shard_writer = 'path:string, vocab_size:count',
  text_file = 'path:string, opts:opts?', prepare = 'opts:prepare_opts', loader = 'opts:loader_opts' }, 'data.')
check.wrap_table(Loader, { set_state = 'self:opts, state:opts' }, 'Loader:')

return M
