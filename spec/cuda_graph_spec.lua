-- CUDA graphs through gptlua.cuda (cuda.graph, kernels/runtime.cu's
-- gl_cuda_graph_*): a captured sequence of ops replayed N times gives the
-- same bits as the ops run N times; memory the capture allocates stays the
-- graph's (its addresses are recorded) until the graph is freed; a host
-- read inside the capture is refused with a message naming what broke it.
-- Runs on a GPU and under the CUDA simulator (build/sim/gptlua); pending
-- without either.
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'
local twin = require 'support.cuda_twin'
local DEV = twin.DEV

local gpu_it = twin.gpu_it(it, pending)

local function same_bits(a, b, what)
  local x, y = a:to('cpu'):float():contiguous(), b:to('cpu'):float():contiguous()
  assert.are.same(x.shape, y.shape)
  local n = x:numel()
  local xf, yf = x:view({ n }), y:view({ n })
  local ffi = require 'ffi'
  local dx, dy = ffi.cast('float *', xf:data_ptr()), ffi.cast('float *', yf:data_ptr())
  for i = 0, n - 1 do
    if dx[i] ~= dy[i] and not (dx[i] ~= dx[i] and dy[i] ~= dy[i]) then
      error(('%s: element %d is %.9g replayed, %.9g run directly'):format(what, i, dx[i], dy[i]), 2)
    end
  end
end

describe('cuda.graph: capture and replay #cuda', function()
  -- one "step" on persistent tensors: acc += relu(x @ W) * 0.5, W -= 0.01 * x^T relu(.)
  local function make_state(seed)
    gl.manual_seed(seed)
    local st = {}
    st.W = gl.randn({ 24, 40 }):to(DEV):keep()
    st.x = gl.randn({ 16, 24 }):to(DEV):keep()
    st.acc = gl.zeros({ 16, 40 }):to(DEV):keep()
    return st
  end
  local function step(st)
    gl.no_grad(function()
      local h = gl.relu(gl.matmul(st.x, st.W))
      st.acc:add_(h * 0.5)
      local gW = gl.matmul(st.x:t(), h)
      st.W:add_(gW * -0.01)
    end)
  end
  local function inputs(n)
    gl.manual_seed(7)
    local xs = {}
    for i = 1, n do xs[i] = gl.randn({ 16, 24 }) end
    return xs
  end

  gpu_it('replays N steps bit for bit like N steps run directly', function()
    local xs = inputs(4)
    local direct = make_state(3)
    for i = 1, 4 do direct.x:copy_(xs[i]); step(direct) end
    local replayed = make_state(3)
    step(replayed)  -- warm-up: the caching allocator has the step's blocks
    replayed = make_state(3)
    local g = cuda.graph(function() step(replayed) end)
    assert.is_true(g.nodes >= 5, 'captured ' .. g.nodes .. ' nodes')
    for i = 1, 4 do replayed.x:copy_(xs[i]); g:replay() end
    same_bits(replayed.acc, direct.acc, 'acc')
    same_bits(replayed.W, direct.W, 'W')
    g:free()
    assert.has_error(function() g:replay() end, 'cuda.Graph:replay: the graph was freed')
  end)

  gpu_it('runs nothing while capturing', function()
    local st = make_state(5)
    local before = st.acc:to('cpu')
    local g = cuda.graph(function() step(st) end)
    same_bits(st.acc, before, 'acc after the capture')
    g:replay()
    assert.is_true(st.acc:abs():sum():item() > 0)
    g:free()
  end)

  gpu_it('keeps the memory the capture allocated and freed until the graph is freed', function()
    local st = make_state(9)
    local g = cuda.graph(function() step(st) end)
    assert.is_true(g.pool_bytes > 0, 'pool of ' .. g.pool_bytes .. ' bytes')
    -- blocks the capture freed are not handed out again while the graph lives:
    -- filling fresh tensors must not change what a replay computes
    local junk = {}
    for i = 1, 8 do junk[i] = gl.full({ 16, 40 }, 1e30, { device = DEV }) end
    local ref = make_state(9)
    step(ref)
    g:replay()
    same_bits(st.acc, ref.acc, 'acc beside new allocations')
    g:free()
  end)

  gpu_it('refuses a host read inside the capture and names it', function()
    local st = make_state(11)
    local ok, err = pcall(cuda.graph, function()
      step(st)
      return st.acc:sum():item()
    end)
    assert.is_false(ok)
    assert.matches('cuda.graph: the work on cuda:0 could not be captured', err, 1, true)
    assert.matches('capturing', err, 1, true)
    -- the stream left capture mode: ordinary work runs again
    step(st)
    assert.is_true(st.acc:abs():sum():item() > 0)
    assert.has_error(function() cuda.graph(42) end, 'cuda.graph: fn expected a function, got number')
  end)

  -- each op with ids (index_select, the MoE ops) queues a check the host
  -- reads at its next wait; a capture cannot wait, so a graphed step's
  -- checks must fit the table (CU_CHECK_SLOTS): hundreds do, and one too
  -- many is refused naming the op and the limit, not as a stray wait
  gpu_it('holds hundreds of id checks, and names the op past the table', function()
    local x = gl.randn({ 4, 3 }):to(DEV):keep()
    local idx = gl.tensor({ 2, 0, 3 }, { dtype = 'int64' }):to(DEV):keep()
    local out = gl.zeros({ 3, 3 }, { device = DEV }):keep()
    local function checks(n) for _ = 1, n do out:add_(gl.index_select(x, 1, idx)) end end
    out:zero_()
    checks(1000)
    local want = out:to('cpu'):tolist()
    local g = cuda.graph(function() checks(1000) end)
    out:zero_()
    g:replay()
    assert.are.same(want, out:to('cpu'):tolist())
    g:free()
    local ok, err = pcall(cuda.graph, function() checks(1100) end)
    assert.is_false(ok)
    assert.matches('the CUDA graph being captured queues more than 1024 id checks', err, 1, true)
  end)
end)
