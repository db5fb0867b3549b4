-- The per-step journal, `gptlua replay` and `gptlua diff` (issue 18): a
-- 30-step run of spec/dist/live_recipe.lua replayed from its step-10
-- checkpoint matches its journal bit for bit on 1 and 2 ranks (mpirun); a
-- replay with one weight changed after step 16 stops at step 17 naming the
-- loss; a change made live (through the control socket) is replayed at its
-- step; diff names the first step and quantity where two runs part; on 2
-- ranks a step whose collectives differ between the ranks is caught.
local cjson = require 'cjson'
local J = require 'gptlua.journal'
local H = require 'support.mpi'

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end

local function records(path)
  local out = {}
  for line in io.open(path):read('*a'):gmatch('[^\n]+') do out[#out + 1] = cjson.decode(line) end
  return out
end

-- a 30-step run (checkpoints at 10, 20, 30) in a new directory; returns the run's directory
local function run30(launch, extra)
  local dir = H.tmpdir()
  local o, rc = H.sh(('%s %s spec/dist/live_recipe.lua --out_dir=%s --max_iters=30 --checkpoint_interval=10 %s')
    :format(H.EXE, launch, dir, extra or ''), 120)
  assert.equal(0, rc, o)
  return dir .. '/live', dir
end

describe('hash_tensors', function()
  it('equal tensors hash alike; one changed element, or a name, changes the hash', function()
    local gl = require 'gptlua'
    gl.manual_seed(1)
    local a = gl.randn({ 3, 5 })
    local b = a:clone()
    local h = J.hash_tensors({ w = a, v = gl.ones({ 7 }, { dtype = 'float64' }) })
    assert.truthy(h:match('^%x+$') and #h == 16, h)
    assert.equal(h, J.hash_tensors({ w = b, v = gl.ones({ 7 }, { dtype = 'float64' }) }))
    assert.equal(J.hash_tensors({ w = a:t():contiguous() }), J.hash_tensors({ w = a:t() }))  -- a view: its elements
    assert.are_not.equal(J.hash_tensors({ w = a }), J.hash_tensors({ u = a }))
    b:view({ 15 }):narrow(1, 9, 1):add_(1e-6)
    assert.are_not.equal(J.hash_tensors({ w = a }), J.hash_tensors({ w = b }))
  end)
end)

describe('replay', function()
  it('re-runs with the run\'s arguments less those it sets itself', function()
    assert.same({ '--max_iters=30', '--name', 'x', '--dist=ddp' }, J.kept_args({ '--max_iters=30', '--out_dir', '/tmp/a',
      '--name', 'x', '--resume=runs/x', '--overwrite', '--dist=ddp', '--journal=true', '--replay_to', '5' }))
    assert.same({ '--n_layer', '2' }, J.kept_args({ '--resume', '--n_layer', '2', '--overwrite', 'true' }))
  end)
end)

describe('the journal', function()
  local run, dir
  setup(function() run, dir = run30('') end)
  teardown(function() os.execute('rm -rf ' .. dir) end)

  it('holds a header and one record per step: exact numbers, RNG, data position, hashes every K steps', function()
    local recs = records(run .. '/journal.jsonl')
    assert.equal(31, #recs)
    assert.equal(1, recs[1].journal)
    assert.equal(0, recs[1].from)
    assert.equal(1, recs[1].world)
    assert.equal('spec/dist/live_recipe.lua', recs[1].recipe)
    for s = 0, 29 do
      local r = recs[s + 2]
      assert.equal(s, r.step)
      assert.truthy(r.loss:match('^0x1%.%x*p[+-]%d+$'), r.loss)   -- a hex float: the exact value
      assert.truthy(r.grad_norm:match('^0x'), r.grad_norm)
      assert.equal((s + 1) * 2, r.data)                          -- batch_size rows a step
      assert.is_number(r.rng)
      assert.equal((s + 1) % 5 == 0, r.params ~= nil)            -- journal_hash_interval = 5
      assert.equal((s + 1) % 5 == 0, r.optim ~= nil)
    end
    assert.equal(tonumber(recs[2].loss), tonumber(recs[2].loss))
  end)

  it('replay from step 10 matches bit for bit; --to stops early', function()
    local o, rc = H.sh(('%s replay %s --from 10'):format(H.EXE, run), 120)
    assert.equal(0, rc, o)
    has(o, 'replay: 20 steps match the journal ' .. run .. '/journal.jsonl bit for bit')
    o, rc = H.sh(('%s replay %s --from=20 --to=25'):format(H.EXE, run), 120)
    assert.equal(0, rc, o)
    has(o, 'replay: 5 steps match the journal')
  end)

  it('a replay with one weight changed is caught at the step it affects', function()
    local o, rc = H.sh(('env PERTURB_AT=17 %s replay %s --from 10'):format(H.EXE, run), 120)
    assert.equal(1, rc, o)
    has(o, 'replay: step 17 differs from the journal: loss is 0x')
  end)

  it('replay and diff: bad input is a one-line error', function()
    local o, rc = H.sh(('%s replay %s --from 7'):format(H.EXE, run), 60)
    assert.equal(1, rc)
    has(o, ('replay: no checkpoint of step 7 in %s/checkpoints (there: 10, 20, 30)'):format(run))
    o, rc = H.sh(('%s replay /nonexistent/run'):format(H.EXE), 60)
    assert.equal(1, rc)
    has(o, 'journal: cannot read /nonexistent/run/journal.jsonl: /nonexistent/run/journal.jsonl: No such file or directory')
    o, rc = H.sh(('%s replay %s --from x'):format(H.EXE, run), 60)
    assert.equal(1, rc)
    has(o, 'gptlua replay: --from and --to expect step numbers')
    local bad = H.tmpdir()
    io.open(bad .. '/journal.jsonl', 'w'):write('{"journal": 1}\nnot json\n')
    o, rc = H.sh(('%s diff %s %s'):format(H.EXE, run, bad), 60)
    assert.equal(1, rc)
    has(o, bad .. '/journal.jsonl:2: not a JSON object')
    os.execute('rm -rf ' .. bad)
  end)

  it('diff: the same run twice agrees; another learning rate parts at step 0 on the lr', function()
    local same, same_dir = run30('')
    local o, rc = H.sh(('%s diff %s %s'):format(H.EXE, run, same), 60)
    assert.equal(0, rc, o)
    has(o, 'agree on every step (0..29)')
    local other, other_dir = run30('', '--learning_rate=2e-3')
    o, rc = H.sh(('%s diff %s %s'):format(H.EXE, run, other), 60)
    assert.equal(1, rc, o)
    has(o, 'config differs: learning_rate 0.001 vs 0.002')
    has(o, ('%s and %s diverge at step 0: lr 0.0005 vs 0.001\n'):format(run, other))
    has(o, 'explained by the config difference: learning_rate 0.001 vs 0.002\n')
    o = H.sh(('%s diff %s %s --exact'):format(H.EXE, run, other), 60)
    has(o, ('diverge at step 0: lr %s vs %s\n'):format(('%a'):format(5e-4), ('%a'):format(1e-3)))
    -- a string key differs: both values quoted, the empty one as ''
    local third, third_dir = run30('', '--data_dir=somewhere')
    o, rc = H.sh(('%s diff %s %s'):format(H.EXE, run, third), 60)
    assert.equal(1, rc, o)
    has(o, "config differs: data_dir '' vs 'somewhere'\n")
    has(o, 'agree on every step (0..29)')
    os.execute('rm -rf ' .. same_dir .. ' ' .. other_dir .. ' ' .. third_dir)
  end)

  it('a change made live is journaled at its step and replayed there', function()
    local d = H.tmpdir()
    local live = d .. '/live'
    local script = ('LIVE_PAUSE_AT=12 %s spec/dist/live_recipe.lua --out_dir=%s --max_iters=30 --checkpoint_interval=10 '
      .. '> %s/log 2>&1 & pid=$!; '
      .. 'for i in $(seq 1 600); do %s attach %s --timeout=60 -e "trainer.step" 2>/dev/null | grep -qx 12 && break; sleep 0.1; done; '
      .. '%s attach %s --timeout=60 -e "set{ learning_rate = 2e-3 }" -e "resume()"; wait $pid; echo "exit=$?"')
      :format(H.EXE, d, d, H.EXE, live, H.EXE, live)
    local o = H.sh("bash -c '" .. script .. "'", 120)
    has(o, 'set at step 12: {"learning_rate":0.002}')
    has(o, 'exit=0')
    local j = J.read(live .. '/journal.jsonl')
    assert.equal(1, #j.steps[12].changes)
    assert.equal('set', j.steps[12].changes[1].kind)
    -- replayed from 10: the change is applied again before step 12, so every step matches
    local r, rc = H.sh(('%s replay %s --from 10'):format(H.EXE, live), 120)
    assert.equal(0, rc, r)
    has(r, 'replay: 20 steps match')
    -- against the run without the change: the lr parts at step 12
    r, rc = H.sh(('%s diff %s %s'):format(H.EXE, live, run), 60)
    assert.equal(1, rc, r)
    has(r, 'diverge at step 12: lr 0.002 vs 0.001\n')
    has(r, ('explained by the live change at step 12 in %s: set{learning_rate=0.002}\n'):format(live))
    os.execute('rm -rf ' .. d)
  end)
end)

describe('the journal of a 2-rank run (mpirun)', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  it('replays from step 10 bit for bit; a changed weight is caught at step 17', function()
    local run, dir = run30('-n 2 --launcher=mpi')
    local recs = records(run .. '/journal.jsonl')
    assert.equal(2, recs[1].world)
    assert.equal(31, #recs)
    local o, rc = H.sh(('%s replay %s --from 10'):format(H.EXE, run), 120)
    assert.equal(0, rc, o)
    has(o, 'replay: ' .. run .. ' from step 10 to 30 on 2 ranks')
    has(o, 'replay: 20 steps match')
    o, rc = H.sh(('env PERTURB_AT=17 %s replay %s --from 10'):format(H.EXE, run), 120)
    assert.equal(1, rc, o)
    has(o, 'replay: step 17 differs from the journal: loss is 0x')
    os.execute('rm -rf ' .. dir)
  end)

  it('journals a hash of each step\'s collectives; ranks whose collectives differ stop, naming the step', function()
    local run, dir = run30('-n 2 --launcher=mpi')
    local recs = records(run .. '/journal.jsonl')
    for i = 2, #recs do assert.truthy(recs[i].collectives:match('^%x+$'), recs[i].collectives) end
    os.execute('rm -rf ' .. dir)
    local d = H.tmpdir()
    local o, rc = H.sh(('env COLL_MISMATCH_AT=7 %s -n 2 --launcher=mpi spec/dist/live_recipe.lua --out_dir=%s --max_iters=30')
      :format(H.EXE, d), 120)
    assert.is_not.equal(0, rc, o)
    has(o, 'journal: the ranks made different collectives in step 7 (op, group or sizes differ; rank ')
    os.execute('rm -rf ' .. d)
  end)
end)
