-- The per-arch resource check (recipes/tools/cuda_resources.lua, `make
-- cuda-resources`): it names every kernel and arch where registers x
-- threads or shared memory do not fit, and nothing else.  The compiled
-- fixture needs nvcc (pending without it); the rest runs on ptxas lines
-- written here, against the real sources.
local S = require 'support.mpi'
local R = dofile(S.ROOT .. '/recipes/tools/cuda_resources.lua')

local NVCC
for _, p in ipairs({ '/usr/local/cuda/bin/nvcc' }) do
  local f = io.open(p, 'rb')
  if f then f:close(); NVCC = p end
end
if not NVCC then
  local p = io.popen('command -v nvcc 2>/dev/null')
  NVCC = p:read('*l')
  p:close()
  if NVCC == '' then NVCC = nil end
end

local TOOL = 'luajit recipes/tools/cuda_resources.lua'

local function write(path, s)
  local f = assert(io.open(path, 'wb'))
  f:write(s)
  f:close()
end

-- a resource file of one kernel entry per arch, as ptxas -v prints it
local function resource_file(dir, src, mangled, regs, smem)
  local parts = { 'source ' .. src }
  for _, a in ipairs({ '80', '86', '89', '90' }) do
    parts[#parts + 1] = '== sm_' .. a
    parts[#parts + 1] = ("ptxas info    : Compiling entry function '%s' for 'sm_%s'"):format(mangled, a)
    parts[#parts + 1] = ('ptxas info    : Used %d registers, used 1 barriers, %d bytes smem, 480 bytes cmem[0]')
                        :format(regs, smem)
  end
  local path = dir .. '/res.txt'
  write(path, table.concat(parts, '\n') .. '\n')
  return path
end

-- add_norm_forward_kernel<AnyPtr, float, false, false> (kernels/rows.cu)
local ADD_NORM = '_Z23add_norm_forward_kernelI6AnyPtrfLb0ELb0EEvT_S1_S1_S1_S1_S1_S0_S0_5CuIdxILi6EEllllllllT0_'

describe('cuda-resources: the per-arch resource check', function()
  it('counts a block\'s registers in warps of 256-register units', function()
    assert.equal(65536, R.block_registers(255, 256))   -- 256 threads x 255 registers: exactly an SM's file
    assert.equal(73728, R.block_registers(255, 288))   -- one warp more does not fit
    assert.equal(65536, R.block_registers(64, 1024))
    assert.equal(73728, R.block_registers(65, 1024))   -- 65 registers round up to 72 per thread
  end)

  it('evaluates launch arguments from the sources\' enum constants', function()
    local env = R.constants({ 'enum { A = 128, B = A / 32 };', 'enum { SH = 48 << 10, M = SH - (1 << 10) };' })
    assert.equal(4, env.B)
    assert.equal(48128, env.M)
    assert.equal(256, R.eval('A * 2', env))
    assert.equal(512, R.eval('(size_t)A * sizeof(float)', env))
    assert.is_nil(R.eval('threads', env))
  end)

  it('passes a kernel launched under its guard with a little static shared memory', function()
    local dir = S.tmpdir()
    local out, rc = S.sh(('%s check %s'):format(TOOL, resource_file(dir, 'kernels/rows.cu', ADD_NORM, 40, 128)))
    assert.equal(0, rc, out)
    assert.matches('4 kernel instances x archs checked %(sm_80 sm_86 sm_89 sm_90%) in 1 sources: every one fits', out)
  end)

  it('fails one whose static shared memory and its guard\'s dynamic bound pass 48 KiB, on every arch', function()
    local dir = S.tmpdir()
    local out, rc = S.sh(('%s check %s'):format(TOOL, resource_file(dir, 'kernels/rows.cu', ADD_NORM, 40, 2048)))
    assert.equal(1, rc, out)
    for _, a in ipairs({ '80', '86', '89', '90' }) do
      assert.matches(('does not fit: sm_%s add_norm_forward_kernel<AnyPtr, float, false, false>[^\n]*: 2048 bytes of '
                      .. 'static %%+ 48128 of dynamic shared memory, sm_%s allows 49152 per block without the opt%%-in')
                     :format(a, a), out)
    end
  end)

  it('fails 1024 threads of 65 registers (more than the SM\'s 65536)', function()
    local dir = S.tmpdir()
    local out, rc = S.sh(('%s check %s'):format(TOOL, resource_file(dir, 'kernels/rows.cu', ADD_NORM, 65, 128)))
    assert.equal(1, rc, out)
    assert.matches('sm_90 add_norm_forward_kernel[^\n]*65 registers x 1024 threads = 73728 registers per block, '
                   .. 'sm_90 has 65536', out)
  end)

  it('fails when the guard that bounds a launch\'s dynamic shared memory is gone from the source', function()
    local dir = S.tmpdir()
    local f = assert(io.open(S.ROOT .. '/kernels/rows.cu', 'rb'))
    local src = f:read('*a')
    f:close()
    local n
    src, n = src:gsub('if %(C %* %(wide %? 8 : 4%) > ADD_NORM_MAX_SHARED%)', 'if (false)')
    assert.equal(1, n)
    write(dir .. '/rows.cu', src)
    local out, rc = S.sh(('%s check %s'):format(TOOL, resource_file(dir, dir .. '/rows.cu', ADD_NORM, 40, 128)))
    assert.equal(1, rc, out)
    assert.matches('add_norm_forward_kernel: the guard that bounds its dynamic shared memory is gone', out)
  end)

  local it_nvcc = NVCC and it or function(name) pending(name .. ' (nvcc not found)') end
  it_nvcc('names each kernel of the fixture on exactly the archs it does not fit (ptxas -v)', function()
    local dir = S.tmpdir()
    local res = dir .. '/overfull.txt'
    local out, rc = S.sh(('env NVCC=%s CUDA_RES_FLAGS="-O3 -std=c++17" %s compile spec/fixtures/cuda_resources/overfull.cu %s 80 86 89 90')
                         :format(NVCC, TOOL, res), 300)
    assert.equal(0, rc, out)
    out, rc = S.sh(('%s check %s'):format(TOOL, res))
    assert.equal(1, rc, out)
    local named = {}
    for a, k in out:gmatch('does not fit: sm_(%d+) ([%w_]+)') do named[#named + 1] = k .. '@' .. a end
    table.sort(named)
    assert.same({ 'big_shared_kernel@86', 'big_shared_kernel@89', 'many_registers_kernel@80', 'many_registers_kernel@86',
                  'many_registers_kernel@89', 'many_registers_kernel@90' }, named)
    assert.matches('many_registers_kernel%(float%*, float const%*, int%): %d+ registers x 1024 threads', out)
    assert.matches('sm_86 big_shared_kernel%(float%*%): 0 bytes of static %+ 102400 of dynamic shared memory, sm_86 allows 101376', out)
    assert.matches('unbounded_kernel: cannot bound the block size "threads"', out)
    assert.is_nil(out:find('small_kernel', 1, true), out)
    assert.matches('16 kernel instances x archs checked %(sm_80 sm_86 sm_89 sm_90%) in 1 sources: 7 problems', out)
  end)
end)
