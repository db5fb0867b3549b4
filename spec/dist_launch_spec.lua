-- Launching a training run on several ranks (issue 14): the policy a world
-- of several ranks trains with, launcher variables that disagree, and the
-- collective timeout as a config key.  The multi-rank cases run the tiny
-- recipe spec/dist/launch_recipe.lua under `gptlua -n 2`.
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local H = require 'support.mpi'
local EXE = H.EXE

local function env(t) return function(k) return t[k] end end

local function err_of(f, ...)
  local ok, e = pcall(f, ...)
  assert.is_false(ok, 'expected an error')
  return tostring(e)
end

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end

describe('gptlua.dist launcher variables', function()
  it('refuses sources that disagree, naming both and their values', function()
    local e = err_of(dist.discover, env({ RANK = '0', WORLD_SIZE = '1',
      OMPI_COMM_WORLD_RANK = '1', OMPI_COMM_WORLD_SIZE = '2' }))
    has(e, 'launcher variables disagree')
    has(e, 'torchrun (RANK=0, WORLD_SIZE=1: rank 0 of 1)')
    has(e, 'openmpi (OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2: rank 1 of 2)')
    e = err_of(dist.discover, env({ OMPI_COMM_WORLD_RANK = '0', OMPI_COMM_WORLD_SIZE = '2',
      PMI_RANK = '0', PMI_SIZE = '4' }))
    has(e, 'openmpi (OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=2: rank 0 of 2) but pmi (PMI_RANK=0, PMI_SIZE=4')
  end)

  it('reads SLURM only without a launcher (a Slurm step runs one task per node under it)', function()
    local d = dist.discover(env({ SLURM_PROCID = '0', SLURM_NTASKS = '1',
      OMPI_COMM_WORLD_RANK = '1', OMPI_COMM_WORLD_SIZE = '2' }))
    assert.same({ 'openmpi', 1, 2 }, { d.launcher, d.rank, d.size })
  end)

  it('refuses a rank outside the world and a value that is not an integer', function()
    has(err_of(dist.discover, env({ RANK = '2', WORLD_SIZE = '2' })),
      'torchrun (RANK=2, WORLD_SIZE=2: rank 2 of 2) expected a rank in 0..size-1')
    has(err_of(dist.discover, env({ RANK = 'x', WORLD_SIZE = '2' })), 'RANK expected an integer, got "x"')
  end)
end)

describe('dist_timeout', function()
  local recipe = dofile(H.ROOT .. '/spec/dist/launch_recipe.lua')
  local function with(over)
    local r = {}
    for k, v in pairs(recipe) do r[k] = v end
    for k, v in pairs(over) do r[k] = v end
    return r
  end

  it('is a config key, seconds, finite and > 0', function()
    assert.equal(600, (train.resolve_config(with({}), {})).dist_timeout)
    assert.equal(2.5, (train.resolve_config(with({}), { '--dist_timeout=2.5' })).dist_timeout)
    has(err_of(train.resolve_config, with({}), { '--dist_timeout=0' }), 'config: dist_timeout must be > 0 seconds, got 0')
    has(err_of(train.resolve_config, with({ dist_timeout = -1 }), {}), 'dist_timeout must be > 0 seconds, got -1')
    has(err_of(train.resolve_config, with({}), { '--dist_timeout=inf' }), '--dist_timeout expects a finite number')
    has(err_of(train.resolve_config, with({}), { '--dist_timeout' }), 'dist_timeout')
    has(err_of(dist.init, { timeout = math.huge }), 'dist.init: timeout expected a finite number of seconds > 0, got inf')
  end)

  it('reaches the communicator', function()
    local t = train.new(with({ dist = 'ddp', dist_timeout = 5 }), {})
    assert.equal(5, t.comm.timeout)
    dist.init({ timeout = dist.timeout })
    assert.equal(dist.timeout, t.comm.timeout)
  end)
end)

describe('gptlua -n 2 recipe', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local function run(args, envs)
    local out = H.tmpdir()
    local o, rc, secs = H.sh(('%s%s -n 2 spec/dist/launch_recipe.lua --out_dir=%s %s'):format(envs or '', EXE, out,
      args or ''), 60)
    return o, rc, out, secs
  end
  local function count(s, part)
    local n, i = 0, 1
    while true do
      local j = s:find(part, i, true)
      if not j then return n end
      n, i = n + 1, j + 1
    end
  end

  it('trains with ddp by default, and says so once', function()
    local out, rc, dir = run()
    assert.equal(0, rc, out)
    assert.equal(1, count(out, 'dist: ddp (default for 2 ranks), collective timeout 600 s'), out)
    assert.equal(1, count(out, 'x 2 ranks = 32 tokens/step'), out)
    assert.equal(1, count(out, 'step     2/2'), out)
    assert.truthy(io.open(dir .. '/launch/metrics.jsonl'), 'no metrics written')
    out, rc = run('--dist=zero1')
    assert.equal(0, rc, out)
    has(out, 'dist: zero1 (on 2 ranks)')
  end)

  it("refuses dist 'none' on several ranks before writing anything", function()
    local out, rc, dir = run('--dist=none')
    assert.is_true(rc ~= 0, out)
    has(out, "config: dist 'none' cannot run on 2 ranks: each would train alone and write " .. dir .. '/launch')
    assert.is_nil(io.open(dir .. '/launch/metrics.jsonl'), 'a run directory was written')
  end)

  it('refuses a stale RANK=0 WORLD_SIZE=1 under mpirun, even with --dist=ddp', function()
    local out, rc, dir = run('--dist=ddp', 'env RANK=0 WORLD_SIZE=1 ')
    assert.is_true(rc ~= 0, out)
    assert.truthy(out:find('dist: the launcher variables disagree: torchrun %(RANK=0, WORLD_SIZE=1: rank 0 of 1%) '
      .. 'but openmpi %(OMPI_COMM_WORLD_RANK=(%d), OMPI_COMM_WORLD_SIZE=2: rank %1 of 2%)'), out)
    assert.is_nil(io.open(dir .. '/launch/metrics.jsonl'), 'a run directory was written')
  end)

  it('aborts every rank after dist_timeout seconds when one never joins', function()
    local out, rc, _, secs = run('--dist_timeout=1', 'env GPTLUA_SPEC_SLEEP_RANK=1 ')
    H.assert_ended_by_itself(out, rc, secs)
    has(out, "[rank 0] gptlua.dist: timeout: broadcast on group 'world' (seq 1, 2 ranks) did not complete within 1.0 s")
  end)
end)
