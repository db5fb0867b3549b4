-- The CUDA simulator's sanitizer (spec/cudasim/sanitize.cpp, exec_block.cpp):
-- each class compute-sanitizer reports fires on a planted bug, naming the
-- class, kernel, block, thread and source line, and the correct twin of
-- every planted kernel (same shape, the bug fixed) is silent when the cases
-- are compiled at -O0, -O2 and -O3.  The kernels are
-- spec/cudasim/cases/sanitize.cu, built once per level
-- (build/sim/libgptlua_sanitize_O<level>.so); errors are sticky, so each
-- planted bug runs in a process of its own (spec/sim/run.lua san).
-- Tagged #cuda #sim: only under the simulator.
local S = require 'support.sim'
local E = S.E

-- name, class, expected code, text the report contains
local PLANTED = {
  { 'oob_store_poison', 'memcheck', E.IllegalAddress,
    'out%-of%-bounds global write of 4 bytes at 0x%x+: 0 bytes past the end of a 4000%-byte allocation' },
  { 'oob_read', 'memcheck', E.IllegalAddress, 'out%-of%-bounds global read of 4 bytes at 0x%x+: 0 bytes past the end' },
  { 'misaligned_global', 'memcheck', E.MisalignedAddress, 'misaligned global read of 4 bytes' },
  { 'shared_oob', 'memcheck', E.IllegalAddress, 'out%-of%-bounds shared write of 4 bytes' },
  { 'misaligned_shared', 'memcheck', E.MisalignedAddress, 'misaligned shared write of 4 bytes' },
  { 'dynamic_oob', 'memcheck', E.IllegalAddress,
    "out%-of%-bounds shared read of 4 bytes at 0x%x+: byte %-4 of the launch's 256%-byte dynamic shared buffer" },
  { 'uninit_shared', 'initcheck', E.LaunchFailure, 'read of 4 bytes of uninitialized shared memory' },
  { 'uninit_global', 'initcheck', E.LaunchFailure, 'read of 4 bytes of uninitialized global memory' },
  { 'reduce_no_barrier', 'racecheck', E.LaunchFailure, '%a+%-after%-%a+ hazard on shared memory' },
  { 'shift_no_barrier', 'racecheck', E.LaunchFailure, 'write%-after%-read hazard on shared memory' },
  { 'warp_exchange', 'racecheck', E.LaunchFailure, 'write%-after%-read hazard on shared memory' },
  { 'early_return_barrier', 'synccheck', E.IllegalInstruction,
    'this thread exited while 200 thread%(s%) of the block wait at the barrier at [^ ]*sanitize%.cu:%d+' },
  { 'syncwarp_bad_mask', 'synccheck', E.IllegalInstruction, '__syncwarp at [^ ]*sanitize%.cu:%d+: the calling lane 16 is not in mask 0x0000ffff' },
}

describe('cuda-sim sanitizer: each class fires on a planted bug #cuda #sim', function()
  for _, c in ipairs(PLANTED) do
    local name, class, code, text = c[1], c[2], c[3], c[4]
    it(class .. ': ' .. name, function()
      local _, out = S.expect('', 'san planted ' .. name .. ' 2', code)
      assert.matches(class .. ': ' .. text, out)
      -- where: kernel, block, thread, and (for accesses) the source line
      assert.matches('kernel ' .. name .. ' block %(%d+,0,0%) thread %(%d+,0,0%): ' .. class, out)
      if class ~= 'synccheck' then assert.matches(', at [^ ]*sanitize%.cu:%d+', out) end
    end)
  end

  it('the line named is the access itself (-O0: shared_oob stores through p[t])', function()
    local _, out = S.expect('', 'san planted shared_oob 0', E.IllegalAddress)
    local src = assert(io.open(S.ROOT .. '/spec/cudasim/cases/sanitize.cu')):read('a')
    local n, want = 0, nil
    for line in (src .. '\n'):gmatch('([^\n]*)\n') do
      n = n + 1
      if line:find('p[t] = (float)t;', 1, true) then want = n end
    end
    assert.matches('at [^ ]*sanitize%.cu:' .. want .. '[^%d]', out)
  end)

  it('every class can be turned off (GL_SIM_CHECKS=none): the planted bugs then pass unseen', function()
    for _, name in ipairs({ 'oob_store_poison', 'uninit_shared', 'reduce_no_barrier' }) do
      S.expect('GL_SIM_CHECKS=none', 'san planted ' .. name .. ' 2', 0)
    end
  end)
end)

describe('cuda-sim sanitizer: the correct twins are silent at every optimisation level #cuda #sim', function()
  for _, opt in ipairs({ '0', '2', '3' }) do
    it('-O' .. opt, function()
      local msg = S.expect('', 'san correct ' .. opt, 0)
      assert.are.equal('all silent', msg)
    end)
  end
end)
