-- Every make target builds what it runs: with an empty build directory,
-- `make -n` of each lists the link of the programs it then uses (make test
-- builds first, so there these are up to date and nothing is rebuilt).
local H = require 'support.mpi'
-- make as a user runs it, not as a child of the make running the specs (its jobserver and flags)
local MAKE = 'env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make'

describe('make targets', function()
  it('build what they need', function()
    local empty = os.tmpname()
    os.remove(empty)
    local needs = {
      ['test-cpu-specs'] = { 'gptlua' }, ['test-sim-specs'] = { 'sim/gptlua', 'sim-account/gptlua' },
      ['race-1-cuda_spec'] = { 'sim/gptlua' }, bench = { 'gptlua' }, acceptance = { 'gptlua' },
      ['bench-cuda'] = { 'gptlua' }, install = { 'gptlua', 'libgptlua.so' }, link = { 'gptlua' },
      ['rock-install'] = { 'libgptlua.so' }, ['embed-example'] = { 'libgptlua.so', 'embed_host' },
    }
    for target, programs in pairs(needs) do
      local o, rc = H.sh((MAKE .. ' -n BUILD=%s %s'):format(empty, target), 120)
      assert.equal(0, rc, target .. ': ' .. o)
      for _, p in ipairs(programs) do
        local pattern = ('-o ' .. empty .. '/' .. p):gsub('%p', '%%%0') .. '%f[%s]'
        assert.truthy(o:find(pattern), ('make %s does not build %s:\n%s'):format(target, p, o))
      end
    end
  end)
end)
