-- Runs addressed by name: `runs/NAME` stands for the newest run of that
-- name (NAME, NAME-2, ...) in `gptlua attach`, `gptlua plot` and
-- `recipes/sample.lua --ckpt`, each saying which run it chose; NAME-1 is the
-- first, also where several runs of a name are plotted or diffed; a path
-- that names one run exactly is taken as it is.
local runs = require 'gptlua.runs'
local H = require 'support.mpi'

local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end
local function has(s, part) assert.truthy(s:find(part, 1, true), s) end
local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- a run directory with a metrics.jsonl written at the given time (touch -d)
local function fake_run(path, when)
  os.execute(('mkdir -p %s && echo \'{"step":1,"loss":4}\' > %s/metrics.jsonl && touch -d %s %s/metrics.jsonl %s')
    :format(quote(path), quote(path), quote(when), quote(path), quote(path)))
end

describe('a run addressed by its name', function()
  it('is the newest run of that name, NAME-1 the first, an exact path itself', function()
    local d = tmpdir()
    fake_run(d .. '/r', '2026-01-01 10:00')
    assert.same({ d .. '/r' }, { runs.resolve(d .. '/r') })   -- one run: itself, nothing said
    fake_run(d .. '/r-2', '2026-01-01 12:00')
    fake_run(d .. '/r-3', '2026-01-01 11:00')
    fake_run(d .. '/rr', '2026-01-02 11:00')                    -- another name
    local path, note = runs.resolve(d .. '/r')
    assert.equal(d .. '/r-2', path)
    assert.equal(('%s/r: the newest of 3 runs named r is %s/r-2 (%s/r-1 names the first)'):format(d, d, d), note)
    assert.equal(d .. '/r-2', (runs.resolve(d .. '/r/')))
    -- only those keep() accepts
    assert.equal(d .. '/r-3', (runs.resolve(d .. '/r', function(p) return p ~= d .. '/r-2' end)))
    assert.same({ d .. '/r', ('%s/r-1: the first run named r, %s/r'):format(d, d) }, { runs.resolve(d .. '/r-1') })
    assert.same({ d .. '/r-3' }, { runs.resolve(d .. '/r-3') })
    assert.same({ d .. '/nothing' }, { runs.resolve(d .. '/nothing') })
    os.execute('rm -rf ' .. quote(d))
  end)

  it('in plot, sample.lua --ckpt and attach', function()
    local d = tmpdir()
    local base = ('%s spec/dist/live_recipe.lua --out_dir=%s --warmup_iters=0 --journal=false'):format(H.EXE, d)
    -- two finished runs named live; sample.lua takes the newer
    local o, rc = H.sh(base .. ' --max_iters=2 && ' .. base .. ' --max_iters=3 --seed=4')
    assert.equal(0, rc, o)
    o, rc = H.sh(('%s recipes/sample.lua --ckpt %s/live --n 3'):format(H.EXE, d))
    assert.equal(0, rc, o)
    has(o, ('sample: %s/live: the newest of 2 runs named live is %s/live-2'):format(d, d))
    -- plot: the newer run's curves
    o, rc = H.sh(('%s plot %s/live --out=%s/p.png'):format(H.EXE, d, d))
    has(o, ('plot: %s/live: the newest of 2 runs named live is %s/live-2'):format(d, d))
    -- two runs of the name, both named: exactly those
    o, rc = H.sh(('%s plot %s/live %s/live-2 --out=%s/p2.png'):format(H.EXE, d, d, d), 60)
    assert.equal(0, rc, o)
    assert.is_nil(o:find('the newest', 1, true), o)
    -- ... and NAME-1 among them is the first, as alone
    o, rc = H.sh(('%s plot %s/live-1 %s/live-2 --out=%s/p3.png'):format(H.EXE, d, d, d), 60)
    assert.equal(0, rc, o)
    has(o, ('plot: %s/live-1: the first run named live, %s/live'):format(d, d))
    -- diff takes directories as they are, NAME-1 the first (these runs keep
    -- no journal: diff names the one it read)
    o = H.sh(('%s diff %s/live-1 %s/live-2'):format(H.EXE, d, d), 60)
    has(o, ('diff: %s/live-1: the first run named live, %s/live'):format(d, d))
    has(o, ('cannot read %s/live/journal.jsonl'):format(d))
    -- attach: the running job, a third run of the name
    o, rc = H.sh('bash -c ' .. quote(table.concat({
      base .. (' > %s/log 2>&1 & pid=$!'):format(d),
      ('for i in $(seq 1 600); do [ -S %s/live-3/control.sock ] && break; sleep 0.1; done'):format(d),
      ('%s attach %s/live --timeout=60 -e "cfg.seed" -e "stop()"'):format(H.EXE, d),
      'wait $pid; echo "exit=$?"' }, '\n')), 120)
    has(o, ('gptlua attach: %s/live: the newest of 3 runs named live is %s/live-3'):format(d, d))
    has(o, '\n3\n')
    has(o, 'exit=0')
    os.execute('rm -rf ' .. quote(d))
  end)
end)
