-- recipes/prepare.lua — tokenize text into token shards for training (it
-- trains nothing; it prints the time it took: training a BPE tokenizer is
-- most of it, tokenising is seconds for tiny Shakespeare's 1 MB).
--
--   gptlua recipes/prepare.lua --input FILE_OR_DIR --tokenizer PATH --out DIR
--                              [--val-fraction 0.01] [--vocab-size N] [--shard-tokens N] [--force] [--quiet]
--
-- --tokenizer PATH   a saved tokenizer (PATH + PATH.json, see Tokenizer:save);
--                    'char' builds a character tokenizer over the input.  If
--                    PATH does not exist and --vocab-size is given, a byte-level
--                    BPE tokenizer (GPT-4 split, special <|bos|>) is trained
--                    on the input first and saved to PATH.
-- Writes DIR/train_000000.bin ..., DIR/val_000000.bin ... (each file of the
-- input is a BOS-prefixed document; the last val-fraction of the bytes is
-- val), and DIR/tokenizer (+ .json) so the shards carry their tokenizer.
-- Everything is written into DIR.partial and renamed to DIR when complete;
-- an existing DIR is refused unless --force (which replaces it whole).
-- Example (the default data):
--   gptlua recipes/prepare.lua --input data/tinyshakespeare.txt \
--     --tokenizer out/shakespeare.tok --vocab-size 4096 --out out/shakespeare
local tok = require 'gptlua.tokenizer'
local data = require 'gptlua.data'
local check = require 'gptlua.check'

local config = require 'gptlua.config'

local USAGE = 'usage: gptlua recipes/prepare.lua --input FILE_OR_DIR --tokenizer PATH|char --out DIR ' ..
              '[--val-fraction 0.01] [--vocab-size N] [--shard-tokens N] [--force] [--quiet]'
-- each flag's type, by the type of its placeholder (config.parse_args reads
-- --key value and --key=value; dashes in keys become underscores); a flag
-- not given stays unset.  The sizes are read as text and checked below.
local FLAGS = { input = '', tokenizer = '', out = '', val_fraction = 0, vocab_size = '', shard_tokens = '',
                quiet = false, force = false }
local TOOL = { prefix = 'prepare', hint = 'gptlua recipes/prepare.lua --help lists them', dashes = true }

local function parse(args)
  for _, a in ipairs(args) do
    if a == '--help' or a == '-h' then io.write(USAGE, '\n'); return nil end
  end
  local o = config.parse_args(args, FLAGS, TOOL)
  -- sizes >= 1 (the shared check: refuses 0, -3, 2.5, nan, inf, 1e400)
  for _, k in ipairs({ 'vocab_size', 'shard_tokens' }) do
    if o[k] ~= nil then
      local flag = '--' .. k:gsub('_', '-')
      local n = tonumber(o[k])
      if not n then error(('prepare: %s expects a number, got %q'):format(flag, o[k]), 0) end
      o[k] = check.integer(n, 'prepare', flag, 1, nil, -1)
    end
  end
  for _, k in ipairs({ 'input', 'tokenizer', 'out' }) do
    if not o[k] or o[k] == '' then
      error(('prepare: --%s is required (gptlua recipes/prepare.lua --help)'):format(k:gsub('_', '-')), 0)
    end
  end
  return o
end

local function exists(path) local f = io.open(path, 'rb'); if f then f:close() end; return f ~= nil end

local function main(args)
  local o = parse(args)
  if not o then return 0 end
  -- refused before any work (a tokenizer may take minutes to train)
  o.out = data.check_output(o.out, o.force, -1)
  local t
  if o.tokenizer == 'char' then
    local files = select(2, pcall(data.list_files, o.input))
    if type(files) ~= 'table' then files = { o.input } end
    local parts = {}
    for i, p in ipairs(files) do local f = assert(io.open(p, 'rb')); parts[i] = f:read('*a'); f:close() end
    t = tok.char(table.concat(parts))
  elseif exists(o.tokenizer) then
    t = tok.load(o.tokenizer)
  elseif o.vocab_size then
    local files = select(2, pcall(data.list_files, o.input))
    if type(files) ~= 'table' then files = { o.input } end
    local t0 = os.clock()
    t = tok.train(files, o.vocab_size, { special_tokens = { '<|bos|>' } })
    t:save(o.tokenizer)
    if not o.quiet then
      print(('prepare: trained a %d-token BPE tokenizer in %.1f s CPU -> %s'):format(t.vocab_size, os.clock() - t0, o.tokenizer))
    end
  else
    error(('prepare: tokenizer %s does not exist (give --vocab-size N to train one)'):format(o.tokenizer), 0)
  end
  local r = data.prepare { input = o.input, tokenizer = t, out = o.out, val_fraction = o.val_fraction,
                           shard_tokens = o.shard_tokens, progress = not o.quiet, force = o.force,
                           tokenizer_file = 'tokenizer' }
  if not o.quiet then
    print(('prepare: %d train tokens in %d shard(s), %d val tokens in %d shard(s), %.1f MB in %.2f s -> %s')
      :format(r.train_tokens, #r.train, r.val_tokens, #r.val, r.bytes / 1e6, r.seconds, o.out))
  end
  return 0
end

return main({ ... })
