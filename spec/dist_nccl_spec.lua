-- CUDA tensors in gptlua.dist and the data loader: which backend carries
-- them (NCCL, or MPI through host memory), GPU binding, the NCCL backend
-- (engine/mpi/nccl.c), asynchronous host-to-device copies
-- (cuda.copy_async) and the loader's pinned, prefetched device batches.
-- Everything that can run without a GPU runs in `make test` (selection
-- logic, error paths, the setup scripts on 2 CPU ranks); the describes
-- tagged #cuda run under `make test-cuda` and are pending without a GPU
-- (NCCL on 2 ranks also needs 2 GPUs).
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local cuda = require 'gptlua.cuda'
local data = require 'gptlua.data'
local launch = require 'gptlua.dist.launch'
local ffi, lib = gl.ffi, gl.lib

local ROOT = GPTLUA.root
local EXE = GPTLUA.exe
local MPIRUN = launch.which('mpirun')
local NGPU = cuda.device_count()

local H = require 'support.mpi'
local sh, mpirun = H.sh, H.mpirun

local assert_ranks_ok = H.assert_ranks_ok

-- it() when `ok`, else pending with the reason
local function it_if(ok, why, name, fn)
  if ok then it(name, fn) else pending(name .. ' (' .. why .. ')') end
end
local NO_GPU = 'no CUDA device on this machine'

local function raises(pattern, f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, 'expected an error matching ' .. pattern)
  assert.truthy(tostring(err):find(pattern, 1, true), tostring(err))
end

describe('gptlua.dist backend selection for CUDA tensors', function()
  it('binds local ranks to GPUs round-robin', function()
    assert.equal(0, dist.gpu_for(0, 8))
    assert.equal(3, dist.gpu_for(3, 8))
    assert.equal(1, dist.gpu_for(3, 2))
    assert.equal(0, dist.gpu_for(2, 1))
    assert.is_nil(dist.gpu_for(0, 0))
  end)

  it('uses NCCL only with the library, a GPU per rank, and not when MPI is asked for', function()
    local base = { backend = 'auto', nccl_version = 22809, device = 1, local_size = 2, device_count = 2 }
    local function plan(over)
      local o = {}
      for k, v in pairs(base) do o[k] = v end
      for k, v in pairs(over) do o[k] = v end
      return dist.nccl_plan(o)
    end
    assert.is_true(plan({}))
    assert.is_true(plan({ backend = 'nccl', local_size = 1 }))
    local ok, why = plan({ backend = 'mpi' })
    assert.is_false(ok); assert.equal("backend 'mpi' was requested", why)
    ok, why = plan({ nccl_version = 0 })
    assert.is_false(ok); assert.truthy(why:find('built without NCCL', 1, true))
    ok, why = plan({ device = false, device_count = 0 })
    assert.is_false(ok); assert.equal('no CUDA device is available', why)
    ok, why = plan({ local_size = 3, device_count = 1, device = 0 })
    assert.is_false(ok)
    assert.equal("3 ranks on this node share 1 GPU and NCCL needs a GPU per rank (backend = 'mpi' lets ranks share GPUs)", why)
  end)

  it('rejects an unknown backend before starting anything', function()
    raises("dist.init: backend expected 'auto', 'mpi' or 'nccl', got gloo", dist.init, { backend = 'gloo' })
  end)

  it('keeps a world of one local, on cuda:0 when there is a GPU', function()
    local world = dist.init()
    assert.equal('local', world:route(gl.zeros({ 1 }), gl.zeros({ 1 })))
    assert.is_false(world.nccl)
    assert.equal(NGPU > 0 and 'cuda:0' or 'cpu', dist.device())
  end)
end)

describe('gptlua.dist NCCL setup on MPI ranks', function()
  if not MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end

  it('picks NCCL exactly when every rank can use it, and reports why NCCL cannot start', function()
    local out, rc = mpirun(2, 'spec/dist/nccl_setup.lua', 'auto')
    assert_ranks_ok(out, rc, 2)
  end)

  it("fails backend 'nccl' with the reason on every rank, and still gives backend 'mpi' its world", function()
    local out, rc = mpirun(2, 'spec/dist/nccl_setup.lua', 'nccl')
    assert_ranks_ok(out, rc, 2)
  end)
end)

describe('CUDA transfers: argument and availability errors', function()
  it('checks copy_async arguments', function()
    if not cuda.built() then
      raises('built without CUDA', cuda.copy_async, gl.zeros({ 2 }), gl.zeros({ 2 }))
      assert.equal(0, cuda.copy_async_pending())
      return
    end
    raises('dst is float32 but src is int64, expected one dtype', cuda.copy_async, gl.zeros({ 2 }),
      gl.zeros({ 2 }, { dtype = 'int64' }))
    raises('dst has 2 elements but src has 3', cuda.copy_async, gl.zeros({ 2 }), gl.zeros({ 3 }))
    raises('expected contiguous tensors, got a strided dst', cuda.copy_async, gl.zeros({ 2, 3 }):transpose(1, 2),
      gl.zeros({ 3, 2 }))
    raises('both tensors are on the CPU, expected one on a CUDA device (use gl_copy)', cuda.copy_async,
      gl.zeros({ 2 }), gl.zeros({ 2 }))
    raises('dst and src expected tensors', cuda.copy_async, gl.zeros({ 2 }), 3)
    local freed = gl.zeros({ 2 })
    freed:free()
    raises('has been freed', cuda.copy_async, gl.zeros({ 2 }), freed)
    assert.equal(0, cuda.copy_async_pending())
    raises('stream expected "compute", "comm" or "copy", got bogus', cuda.stream, 0, 'bogus')
  end)

  it('refuses pinned loader batches without a GPU, and pinning after the start', function()
    local tokens = gl.arange(500, { dtype = 'int32' })
    if NGPU == 0 then
      raises(cuda.built() and 'pinned batches need a CUDA device, but none is available'
        or 'pinned batches need a CUDA device, but this engine was built without CUDA',
        data.loader, { tokens = tokens, batch_size = 2, block_size = 8, device = 'cuda:0' })
    end
    local L = data.loader { tokens = tokens, batch_size = 2, block_size = 8 }
    local rc = lib.gl_loader_pin_memory(L.c, 1)
    assert.equal(-1, rc)
    assert.truthy(ffi.string(lib.gl_last_error()):find('expected before the first gl_loader_start', 1, true))
    assert.equal(-1, lib.gl_loader_pin_memory(nil, 0))
    -- switching pinning off is always possible before the start
    local cfg = ffi.new('gl_loader_config')
    cfg.batch_size, cfg.block_size, cfg.world_size = 2, 8, 1
    local raw = ffi.gc(lib.gl_loader_new(cfg), lib.gl_loader_free)
    assert.equal(0, lib.gl_loader_pin_memory(raw, 0))
    assert.equal(0, lib.gl_loader_add_tokens(raw, tokens.c))
    assert.equal(0, lib.gl_loader_start(raw, 0))
    assert.same({ 2, 8 }, L:next_batch().shape)
    L:close()
  end)
end)

describe('asynchronous copies #cuda', function()
  local DEV = 'cuda:0'

  it_if(NGPU > 0, NO_GPU, 'copies host to device, device to host and within the device, in order', function()
    local pinned = cuda.HostBuffer(4 * 1000):tensor({ 1000 }, 'float32')
    pinned:copy_(gl.arange(1000))
    local d = gl.empty({ 1000 }, { device = DEV })
    cuda.copy_async(d, pinned)                       -- the compute stream waits for it
    d:mul_(2)
    local back = cuda.HostBuffer(4 * 1000):tensor({ 1000 }, 'float32')
    local done = cuda.Event(0)
    cuda.copy_async(back, d, done)                   -- behind the mul_ on the compute stream
    done:synchronize()
    assert.equal(0, back:max_abs_diff(gl.arange(1000) * 2))
    local d2 = gl.empty({ 1000 }, { device = DEV })
    cuda.copy_async(d2, d)
    assert.equal(0, d2:to('cpu'):max_abs_diff(gl.arange(1000) * 2))
    -- a pageable source works too (the driver stages it)
    local d3 = gl.empty({ 3 }, { dtype = 'int64', device = DEV })
    cuda.copy_async(d3, gl.tensor({ 7, 8, 9 }, { dtype = 'int64' }))
    assert.same({ 7, 8, 9 }, d3:to('cpu'):tolist())
  end)

  it_if(NGPU > 0, NO_GPU, 'holds both tensors until the copy has run, with an event the compute stream waits on', function()
    local n = 4 * 2 ^ 20
    local src = cuda.HostBuffer(4 * n):tensor({ n }, 'float32')
    src:fill_(3)
    local dst = gl.empty({ n }, { device = DEV })
    local done = cuda.Event(0)
    cuda.copy_async(dst, src, done)
    assert.is_true(cuda.copy_async_pending() >= 0)
    src = nil
    collectgarbage('collect')                         -- the engine still holds the pinned buffer
    done:wait('compute')
    assert.equal(3, dst:sum():item() / n)
    cuda.synchronize(0)
    assert.equal(0, cuda.copy_async_pending())
  end)

  it_if(NGPU > 1, 'needs 2 GPUs', 'refuses tensors of two devices and an event of another one', function()
    raises('expected one device (use gl_copy)', cuda.copy_async, gl.zeros({ 2 }, { device = 'cuda:0' }),
      gl.zeros({ 2 }, { device = 'cuda:1' }))
    raises('done is an event of cuda:1, expected one of cuda:0', cuda.copy_async,
      gl.zeros({ 2 }, { device = 'cuda:0' }), gl.zeros({ 2 }), cuda.Event(1))
  end)
end)

describe('loader on a GPU: pinned, prefetched batches #cuda', function()
  local tokens = gl.arange(20000, { dtype = 'int32' })

  local function pair(opts)
    local c, d = {}, {}
    for k, v in pairs(opts) do c[k], d[k] = v, v end
    d.device = 'cuda:0'
    return data.loader(c), data.loader(d)
  end

  it_if(NGPU > 0, NO_GPU, 'gives the CPU batches, with the same state and resume', function()
    for _, o in ipairs({ { batch_size = 4, block_size = 32, seed = 21 },
                         { batch_size = 3, block_size = 17, sampling = 'sequential', rank = 1, world_size = 2 } }) do
      o.tokens = tokens
      local C, D = pair(o)
      for step = 1, 12 do
        local cx, cy = C:next_batch()
        local dx, dy = D:next_batch()
        assert.equal('cuda:0', dx.device); assert.equal('int64', dx.dtype)
        assert.same(cx:tolist(), dx:to('cpu'):tolist())
        assert.same(cy:tolist(), dy:to('cpu'):tolist())
        assert.same(C:state(), D:state(), 'state after step ' .. step)
      end
      local st = D:state()
      local want = { C:next_batch() }
      D:set_state(st)
      local gx, gy = D:next_batch()
      assert.same(want[1]:tolist(), gx:to('cpu'):tolist())
      assert.same(want[2]:tolist(), gy:to('cpu'):tolist())
      C:close(); D:close()
    end
  end)

  it_if(NGPU > 0, NO_GPU, 'recycles its pinned buffers and does not wait in steady state', function()
    local B, T, K = 16, 128, 4
    local before = cuda.pinned_bytes()
    local D = data.loader { tokens = tokens, batch_size = B, block_size = T, prefetch = K, device = 'cuda:0',
      recycle = true }
    local waits = 0
    for i = 1, 60 do
      local t0 = os.clock()
      while os.clock() - t0 < 0.002 do end         -- a step's worth of host work: the producer keeps up
      D:next_batch()
      if i > 10 and D:last_wait() > 0 then waits = waits + 1 end
    end
    cuda.synchronize(0)
    -- the pool never holds more than 2 * (prefetch + 4) buffers of B x T int64
    local held = cuda.pinned_bytes() - before
    assert.is_true(held > 0 and held <= 2 * (K + 4) * B * T * 8, held .. ' pinned bytes')
    assert.is_true(waits <= 2, waits .. ' of 50 batches waited')
    assert.equal(0, cuda.copy_async_pending())
    D:close()
    collectgarbage('collect')
    assert.equal(before, cuda.pinned_bytes())
  end)

  it_if(NGPU > 0, NO_GPU, 'hands batches to the caller\'s tensor scope and keeps the one copied ahead', function()
    local C = data.loader { tokens = tokens, batch_size = 2, block_size = 8, seed = 5 }
    local D = data.loader { tokens = tokens, batch_size = 2, block_size = 8, seed = 5, device = 'cuda:0' }
    local kept
    for _ = 1, 3 do
      local want = C:next_batch():tolist()
      gl.scope(function()
        local x = D:next_batch()
        kept = x
        assert.same(want, x:to('cpu'):tolist())
      end)
      assert.is_true(kept:is_freed())
    end
    C:close(); D:close()
  end)
end)

describe('gptlua.dist with CUDA tensors #cuda', function()
  local have_mpi = MPIRUN ~= nil

  it_if(NGPU > 0 and have_mpi, NO_GPU, 'runs every collective over MPI on 2 ranks sharing a GPU', function()
    local out, rc = sh(EXE .. ' -n 2 spec/dist/cuda_collectives.lua mpi', 300)
    assert_ranks_ok(out, rc, 2, ' via mpi')
  end)

  it_if(NGPU > 0 and have_mpi, NO_GPU, 'runs every collective over NCCL in a world of one MPI rank', function()
    local out, rc = mpirun(1, 'spec/dist/cuda_collectives.lua', 'nccl')
    assert_ranks_ok(out, rc, 1, ' via nccl')
  end)

  it_if(NGPU > 0 and have_mpi, NO_GPU, 'picks NCCL with a GPU per rank, MPI when ranks share one', function()
    local out, rc = sh(EXE .. ' -n 2 spec/dist/cuda_collectives.lua auto', 300)
    assert_ranks_ok(out, rc, 2, NGPU >= 2 and ' via nccl' or ' via mpi')
    out, rc = mpirun(2, 'spec/dist/nccl_setup.lua', 'auto')
    assert_ranks_ok(out, rc, 2)
    out, rc = mpirun(2, 'spec/dist/nccl_setup.lua', 'nccl')
    assert_ranks_ok(out, rc, 2)
  end)

  it_if(NGPU > 1 and have_mpi, 'needs 2 GPUs', 'runs every collective over NCCL on 2 ranks', function()
    local out, rc = sh(EXE .. ' -n 2 spec/dist/cuda_collectives.lua nccl', 300)
    assert_ranks_ok(out, rc, 2, ' via nccl')
  end)

  it_if(NGPU > 1 and have_mpi, 'needs 2 GPUs', 'aborts every rank when one never joins an NCCL collective', function()
    local out, rc = mpirun(2, 'spec/dist/nccl_setup.lua', 'timeout')
    assert.is_true(rc ~= 0, out)
    assert.truthy(out:find("timeout: all_reduce on group 'world/nccl' (seq 1, 2 ranks) did not complete", 1, true), out)
    assert.truthy(out:find('Missing: rank 1 did not answer', 1, true), out)
    assert.falsy(out:find('unreachable', 1, true), out)
  end)
end)
