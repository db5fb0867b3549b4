-- Stragglers (gptlua.observe.stragglers): every log interval each rank's
-- compute and collective wait per step are gathered, and a rank computing
-- more than straggler_threshold over the median is named on the log and in
-- metrics.jsonl.  The slow rank sleeps 400 ms in every step (a test hook):
-- it is named whenever the normal ranks compute in under 400 / 1.5 ms per
-- step, and a normal rank, measured against the median (the mean) of the
-- other two, one of them the slow one, is not.
local H = require 'support.mpi'
local cjson = require 'cjson'

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end

local function run(extra, env)
  local dir = H.tmpdir()
  local out, rc = H.sh(('env %s %s -n 3 spec/dist/straggler_recipe.lua --out_dir=%s %s'):format(env or '', H.EXE, dir,
    extra or ''), 180)
  local recs = {}
  local f = io.open(dir .. '/straggler/metrics.jsonl')
  if f then
    for line in f:lines() do
      local r = cjson.decode(line)
      if r.compute_ms then recs[#recs + 1] = r end
    end
    f:close()
  end
  os.execute('rm -rf ' .. dir)
  return out, rc, recs
end

describe('stragglers', function()
  it('names the slowed rank on the log and in metrics.jsonl, with every rank\'s compute and wait', function()
    local out, rc, recs = run('', 'GPTLUA_TEST_SLOW_RANK=1:400')
    assert.equal(0, rc, out)
    assert.equal(3, #recs, out)   -- steps 2, 4, 6
    for _, r in ipairs(recs) do
      assert.same({ 1 }, r.stragglers)
      assert.equal(3, #r.compute_ms)
      assert.equal(3, #r.wait_ms)
      assert.is_true(r.compute_ms[2] >= 400, cjson.encode(r))
      -- the others waited for it in their collectives
      assert.is_true(r.wait_ms[1] > r.wait_ms[2] and r.wait_ms[3] > r.wait_ms[2], cjson.encode(r))
      has(out, ('stragglers at step %d (compute more than 50%% over the other ranks\' median): rank 1 computes'):format(r.step))
    end
  end)

  it('is off with straggler_threshold = 0', function()
    local out, rc, recs = run('--straggler_threshold=0', 'GPTLUA_TEST_SLOW_RANK=1:400')
    assert.equal(0, rc, out)
    assert.equal(0, #recs, out)
    assert.is_nil(out:find('stragglers', 1, true), out)
  end)
end)
