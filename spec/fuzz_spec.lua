-- The fuzzers' corpora (engine/fuzz/corpus/, `make fuzz`) replayed through
-- the ordinary build: every seed and every input a fuzzer once found a
-- failure with (finding-*) must be accepted or refused with a one-line
-- message.  The Lua targets run as the fuzzer runs them
-- (engine/fuzz/targets.lua); the C parsers through their Lua entry points.
local gl = require 'gptlua'
local data = require 'gptlua.data'
local tok = require 'gptlua.tokenizer'
local ckpt = require 'gptlua.checkpoint'

local corpus = gl.root .. '/engine/fuzz/corpus/'
local function inputs(target)
  local out = {}
  for line in io.popen('ls -1 ' .. corpus .. target):lines() do out[#out + 1] = corpus .. target .. '/' .. line end
  assert.is_true(#out > 0, 'no corpus for ' .. target)
  return out
end
local function read(p) local f = assert(io.open(p, 'rb')); local s = f:read('*a'); f:close(); return s end
local function one_line(what, ok, err)
  if not ok then
    assert.equal('string', type(err), what)
    assert.is_nil(err:find('\n', 1, true), what .. ': ' .. err)
    assert.is_nil(err:find('attempt to ', 1, true), what .. ': ' .. err)
  end
end

describe('fuzz corpora', function()
  GPTLUA.root = GPTLUA.root or gl.root
  local targets = dofile(gl.root .. '/engine/fuzz/targets.lua')

  it('replays the Lua targets (checkpoint state, config) without a finding', function()
    for _, t in ipairs({ 'checkpoint_state', 'config' }) do
      for _, p in ipairs(inputs(t)) do
        local ok, err = pcall(targets[t], read(p))
        assert.is_true(ok, p .. ': ' .. tostring(err))
      end
    end
    targets.cleanup()
  end)

  it('reads the C targets\' inputs or refuses them in one line', function()
    for _, p in ipairs(inputs('safetensors')) do one_line(p, pcall(ckpt.load_safetensors, p)) end
    for _, p in ipairs(inputs('shards')) do one_line(p, pcall(data.read_shard, p)) end
    -- the tokenizer inputs are the ranks file, then NUL and the sidecar
    local dir = os.tmpname()
    os.remove(dir)
    os.execute('mkdir -p ' .. dir)
    for _, p in ipairs(inputs('tokenizer')) do
      local s = read(p)
      local cut = s:find('\0', 1, true)
      local f = io.open(dir .. '/t.bpe', 'wb'); f:write(cut and s:sub(1, cut - 1) or s); f:close()
      os.remove(dir .. '/t.bpe.json')
      if cut then f = io.open(dir .. '/t.bpe.json', 'wb'); f:write(s:sub(cut + 1)); f:close() end
      one_line(p, pcall(tok.load, dir .. '/t.bpe'))
    end
    os.execute('rm -rf ' .. dir)
  end)

  it('quotes a value from a file on one line (finding: a newline in state.json format)', function()
    local ok, err = pcall(targets.checkpoint_state, read(corpus .. 'checkpoint_state/finding-format-newline.json'))
    targets.cleanup()
    assert.is_true(ok, tostring(err))
    assert.equal("the string 'a\\nb\\0c'", require('gptlua.check').describe('a\nb\0c'))
  end)

  it('refuses state.json file names that are not plain names in the checkpoint and checksums that are not hex (findings: a newline in either)', function()
    local src = gl.root .. '/engine/fuzz/checkpoint'
    local dir = os.tmpname()
    os.remove(dir)
    os.execute(('mkdir -p %s && cp %s/*.safetensors %s/'):format(dir, src, dir))
    local cjson = require 'cjson'
    local state = cjson.decode(read(src .. '/state.json'))
    local cases = { { 'model.safet\nsors', '3df80942cf383943' }, { '../step_0000001/model.safetensors', '3df80942cf383943' },
      { '..', '3df80942cf383943' }, { 'model.safetensors', '3the string \'model.safet\nsors\'df80942cf383943' } }
    for _, c in ipairs(cases) do
      state.files = { [c[1]] = c[2] }
      local f = io.open(dir .. '/state.json', 'wb'); f:write(cjson.encode(state)); f:close()
      local ok, err = pcall(ckpt.load, dir)
      assert.is_false(ok)
      assert.truthy(err:find('field files expected file names with checksums (16 hex digits)', 1, true), err)
      assert.is_nil(err:find('\n', 1, true), err)
    end
    os.execute('rm -rf ' .. dir)
  end)

  it('quotes command-line values, recipe keys and loader states on one line (findings: newlines in them)', function()
    local train = require 'gptlua.train'
    local cases = {
      { function() train.resolve_config({}, { '--n_layer=1\n2' }) end, 'config: --n_layer expects a finite number, got "1\\n2"' },
      { function() train.resolve_config({}, { '--bias=yes\nno' }) end, 'config: --bias expects true or false, got "yes\\nno"' },
      { function() train.resolve_config({}, { 'a\nb' }) end, 'config: cannot parse argument "a\\nb"' },
      { function() train.resolve_config({ ['x\ny'] = 1 }, {}) end, 'config: unknown key x\\ny in the recipe' },
      { function() train.resolve_config({ name = 5, n_layer = '1\n' }, {}) end, 'must be a ' },
      { function() train.resolve_config({}, { '--model=n\nx' }) end, "config: unknown model 'n\\nx'" },
      { function() train.resolve_config({}, { '--dtype=f\n' }) end, "got 'f\\n'" },
      { function() train.resolve_config({}, { '--device=cpu\n' }) end, "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'cpu\\n'" },
    }
    local loader = data.loader({ tokens = gl.zeros({ 64 }, { dtype = 'int32' }), batch_size = 1, block_size = 4 })
    cases[#cases + 1] = { function() loader:set_state({ sample = 0, sampling = 'random\n' }) end,
      "Loader:set_state: the state is for sampling = random\\n, this loader has random" }
    for _, c in ipairs(cases) do
      local ok, err = pcall(c[1])
      assert.is_false(ok)
      assert.truthy(err:find(c[2], 1, true), err)
      assert.is_nil(err:find('\n', 1, true), err)
    end
    loader:close()
  end)

  it('refuses vocabularies past 2^31 in shards, whose ids would turn negative as int32 (finding: token -2147413649)', function()
    local ok, err = pcall(data.shard_header, corpus .. 'shards/finding-vocab-past-int32.bin')
    assert.is_false(ok)
    assert.truthy(err:find('vocab_size 4294906224 is past 2^31 (token ids are int32)', 1, true), err)
    local path = os.tmpname()
    ok, err = pcall(data.shard_writer, path, 2 ^ 31 + 1)
    assert.is_false(ok)
    assert.truthy(err:find('gl_shard_writer_open: vocab_size expected in [1, 2^31], got 2147483649', 1, true), err)
    local w = data.shard_writer(path, 2 ^ 31)  -- the largest: ids up to 2^31-1
    w:append(gl.tensor({ 2 ^ 31 - 1, 0 }, { dtype = 'int64' }))
    w:close()
    assert.same({ 2 ^ 31 - 1, 0 }, data.read_shard(path):tolist())
    os.remove(path)
  end)

  it('refuses a shard header whose token count overflows the file size (finding: UBSan in check_header)', function()
    local ok, err = pcall(data.shard_header, corpus .. 'shards/finding-n-tokens-overflow.bin')
    assert.is_false(ok)
    assert.truthy(err:find('n_tokens 2305843009213693950 is not plausible', 1, true), err)
  end)
end)
