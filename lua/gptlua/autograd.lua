-- gptlua.autograd — reverse-mode automatic differentiation.
--
-- Every differentiable op records a node on its output: the input tensors,
-- the values it saved, and a backward function mapping the output gradient
-- to input gradients.  backward() orders the graph once (reverse topological
-- order, computed iteratively), counts how many consumers each tensor has,
-- and walks it: a tensor's gradient is complete when its last consumer has
-- run, which is when a leaf's .grad is written and its hooks fire (exactly
-- once per backward, in reverse order of use — DDP starts its bucketed
-- all-reduce from there).  Each node drops its saved tensors as soon as its
-- backward has run; op-internal buffers it owns alone are released at once.
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local check = require 'gptlua.check'
local lib = G.lib

local A = {}
local grad_enabled = true

function A.is_grad_enabled() return grad_enabled end

-- set_grad_enabled(flag) -> previous flag (the scope form:
--   local prev = gl.set_grad_enabled(false) ... gl.set_grad_enabled(prev))
function A.set_grad_enabled(flag)
  local prev = grad_enabled
  grad_enabled = flag and true or false
  return prev
end

-- no_grad(fn, ...) runs fn with recording off and returns its results.
function A.no_grad(fn, ...)
  local prev = grad_enabled
  grad_enabled = false
  local res = { pcall(fn, ...) }
  grad_enabled = prev
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- In-place changes and autograd (as PyTorch).  In-place methods are not
-- recorded in the graph, so while grad mode is on none may change a tensor
-- that requires grad: a leaf (a parameter: its gradient would describe
-- other values), a view of one, or an op's output (the change would be
-- missing from its gradient).  Under gl.no_grad they are allowed: that is
-- how optimizers update parameters.  tensor.lua runs this check before
-- every in-place method and bumps the tensor's version counter after it.
Tensor.versions.check = function(t, what)
  if not grad_enabled then return end
  local base = rawget(t, '_base')
  if t.requires_grad and t.grad_fn == nil then
    error(what .. ': a leaf tensor that requires grad cannot be modified in place; use gl.no_grad', 3)
  elseif base and base.requires_grad and base.grad_fn == nil then
    error(what .. ': a view of a leaf tensor that requires grad cannot be modified in place; use gl.no_grad', 3)
  elseif t.requires_grad then
    error(what .. ': a tensor that requires grad cannot be modified in place (in-place ops are not recorded '
      .. 'for backward); use an out-of-place op, or gl.no_grad', 3)
  end
end

-- Records a node producing `out` from `inputs` (a dense list of tensors).
-- backward(saved, grad_out, node) returns one gradient (or nil) per input.
-- `saved` lists the tensors whose values the backward reads (inputs,
-- outputs, indices; nils are skipped): their version counters are noted
-- here and compared before the backward runs, so a saved tensor modified
-- in place in between raises instead of giving a wrong gradient.
-- `owned` lists saved op-internal tensors that nothing else references:
-- they are released right after the node's backward.  A node whose
-- kernel can add an existing gradient into its result in the same pass sets
-- node.adds_into = j: backward then finds the gradient input j has so far
-- in node.taken_grad (nil if none yet) and returns the sum for input j.
function A.record(out, inputs, backward, saved, name, owned)
  if not grad_enabled then return out end
  local needs = false
  for i = 1, #inputs do
    if inputs[i].requires_grad then needs = true; break end
  end
  if not needs then return out end
  local versions
  if saved then
    versions = {}
    for i = 1, table.maxn(saved) do
      local t = saved[i]
      if t ~= nil then
        local c = Tensor.versions.counter(t)
        versions[#versions + 1] = { c, c[1] }
      end
    end
  end
  out.requires_grad = true
  out.grad_fn = { inputs = inputs, backward = backward, saved = saved, versions = versions, name = name,
    owned = owned }
  return out
end

-- the check before a node's backward: its saved tensors are as it saw them
local function check_versions(fn)
  local vs = fn.versions
  if vs == nil then return end
  for i = 1, #vs do
    local c, n = vs[i][1], vs[i][2]
    if c[1] ~= n then
      error(('backward: a tensor saved by %s was modified in place (version %d, expected %d)'):format(
        fn.name or 'an op', c[1], n), 0)
    end
  end
end

local release = Tensor.release

-- Number of consumer edges of every tensor reachable from root through
-- grad_fn (only edges into tensors that require grad count).
local function count_deps(root)
  local deps, seen = {}, { [root] = true }
  local stack = { root }
  while #stack > 0 do
    local t = stack[#stack]
    stack[#stack] = nil
    local fn = t.grad_fn
    if fn and fn.inputs then
      for _, x in ipairs(fn.inputs) do
        if x.requires_grad then
          deps[x] = (deps[x] or 0) + 1
          if not seen[x] then seen[x] = true; stack[#stack + 1] = x end
        end
      end
    end
  end
  return deps
end

local function gl_clone_raw(g)
  local c = Tensor.empty(g.shape, { dtype = g.dtype, device = g.device })
  G.check(lib.gl_copy(c.c, g.c))
  return c
end

local function add_into(acc, g)
  if acc == nil then return g end
  return acc:add(g)
end

-- Deferred weight gradients (the zero-bubble pipeline's B/W split,
-- dist/pipeline.lua): while a queue is set (A.defer_weight_grads), ops whose
-- backward makes a weight's gradient with a product of its own (linear,
-- mlp) compute the input gradient only and queue the rest with A.defer;
-- A.run_deferred(queue) runs it later.  Their leaves' hooks (DDP's
-- gradient-ready) wait until then: they fire once the gradient is whole.
local deferring = nil

local function fire_hooks(x)
  local hooks = x._hooks
  if hooks then for i = 1, #hooks do hooks[i](x) end end
end

local function finish_leaf(x, g)
  if g ~= nil then
    if x.grad == nil then
      -- a fresh buffer: never alias another tensor's gradient
      x.grad = gl_clone_raw(g):keep()
    else
      x.grad:add_(g)
    end
  end
  if deferring and deferring.pending[x] then deferring.owed[x] = true; return end  -- fired by run_deferred
  fire_hooks(x)
end

-- new_deferred() -> an empty queue; defer_weight_grads(queue or nil) sets
-- the queue backward's ops add to and returns the previous one
function A.new_deferred() return { pending = {}, owed = {} } end
function A.defer_weight_grads(queue)
  local prev = deferring
  deferring = queue
  return prev
end

-- defer(leaves, fn) (inside a node's backward): with a queue set, queues fn,
-- which returns one fresh gradient per tensor of leaves (parameters that
-- require grad; it holds what it reads), and returns true; without one
-- returns false and the op computes them now.
function A.defer(leaves, fn)
  local q = deferring
  if not q then return false end
  q[#q + 1] = { leaves = leaves, fn = fn }
  for _, x in ipairs(leaves) do q.pending[x] = (q.pending[x] or 0) + 1 end
  return true
end

-- deferrable(weights, node): may this node's backward defer these weights'
-- gradients?  Only parameters (leaves: a computed weight's gradient flows
-- on through the graph now) and not a graph kept for another backward.
function A.deferrable(weights, node)
  if deferring == nil or #weights == 0 or node.retaining then return false end
  for _, w in ipairs(weights) do if w.grad_fn ~= nil then return false end end
  return true
end

-- run_deferred(queue): the queued weight gradients, in order, added into
-- their leaves' .grad; a leaf's hooks fire when its last one is in.
function A.run_deferred(q)
  for k = 1, #q do
    local e = q[k]
    q[k] = nil
    local grads = { e.fn() }
    for j, x in ipairs(e.leaves) do
      local g = grads[j]
      if x.grad == nil then x.grad = g:keep()
      else x.grad:add_(g); release(g) end
      local n = q.pending[x] - 1
      q.pending[x] = n > 0 and n or nil
      if n == 0 and q.owed[x] then q.owed[x] = nil; fire_hooks(x) end
    end
  end
end

-- backward(root [, grad]): root must be a scalar unless grad is given.
-- backward(root [, grad [, opts]]): root must be a scalar unless grad is
-- given.  opts.retain_graph keeps the graph for another backward;
-- opts.free_activations releases each intermediate op output as soon as its
-- node has run (the trainer sets it: nothing outside the graph reads them).
--
-- Gradients are released as soon as they are consumed: a gradient tensor is
-- held by the grads[] slots that refer to it, and when the last slot lets
-- go (added into an accumulator, written into a leaf's .grad, or passed on
-- to the inputs) its storage is dropped.  Backward functions must return
-- fresh tensors, views, or the incoming gradient itself.
-- shared with the memory planner's dry run (same graph shape)
A.count_deps = count_deps

function A.backward(root, grad, opts)
  if not root.requires_grad then
    error('backward: tensor does not require grad (no differentiable op on a requires_grad tensor produced it)', 2)
  end
  local user_grad = grad ~= nil
  if user_grad then
    -- the gradient of root: every node's backward reads it as root's
    -- dtype, shape and device (no op converts it)
    local want = ('{%s} %s on %s'):format(table.concat(root.shape, ','), root.dtype, root.device)
    local mt = type(grad) == 'table' and getmetatable(grad)
    if not (mt and mt.__name == 'Tensor') then
      error(('backward: grad must be a Tensor like the output (%s), got %s'):format(want, check.describe(grad)), 2)
    end
    local same = #grad.shape == #root.shape
    for i = 1, #root.shape do same = same and grad.shape[i] == root.shape[i] end
    if grad.dtype ~= root.dtype or grad.device ~= root.device or not same then
      error(('backward: grad must be %s (the output\'s shape, dtype and device), got {%s} %s on %s'):format(want,
        table.concat(grad.shape, ','), grad.dtype, grad.device), 2)
    end
  end
  if grad == nil then
    if root:numel() ~= 1 then
      error(('backward: grad can be implicit only for a 1-element tensor, this one has shape {%s}'):format(
        table.concat(root.shape, ',')), 2)
    end
    grad = Tensor.full(root.shape, 1, { dtype = root.dtype, device = root.device })
  end
  local retain = opts and opts.retain_graph
  local free_activations = opts and opts.free_activations and not retain
  local prev = grad_enabled
  grad_enabled = false
  local ok, err = pcall(function()
    local held = {}
    local function hold(g) held[g] = (held[g] or 0) + 1 end
    local function drop(g)
      local n = held[g]
      if n == nil then return end
      if n <= 1 then held[g] = nil; release(g) else held[g] = n - 1 end
    end
    -- Kahn's algorithm: a tensor is ready once all its consumers have run
    local deps = count_deps(root)
    local grads = { [root] = grad }
    hold(grad)
    if user_grad then hold(grad) end  -- never release the caller's tensor
    local ready = { root }
    local function leaf_done(x)
      finish_leaf(x, grads[x])
      if grads[x] ~= nil then drop(grads[x]) end
      grads[x] = nil
    end
    while #ready > 0 do
      local t = ready[#ready]
      ready[#ready] = nil
      local fn = t.grad_fn
      if fn == nil then
        leaf_done(t)
      else
        local g = grads[t]
        grads[t] = nil
        if fn.inputs == nil then
          error('backward: the graph was already freed by an earlier backward (pass {retain_graph=true})', 0)
        end
        fn.retaining = retain  -- a backward may drop its captured views unless the graph is kept
        check_versions(fn)
        -- a node with adds_into = j adds the gradient its input j has so far
        -- into its own result, in its kernel's pass (gl.add_layer_norm's norm:
        -- the residual stream's gradient); it finds it in fn.taken_grad
        -- (fn.taken_alone: no other gradient is that tensor, so the node
        -- may add into it in place, as gl.linear's dx product does)
        local taken
        if fn.adds_into and g ~= nil then
          local xj = fn.inputs[fn.adds_into]
          taken = grads[xj]
          grads[xj] = nil
        end
        fn.taken_grad, fn.taken_alone = taken, taken ~= nil and held[taken] == 1
        local in_grads
        if g == nil then in_grads = {}
        elseif A.profile_node then in_grads = { A.profile_node(fn, g) }  -- a profile runs (gptlua.observe.profiler)
        else in_grads = { fn.backward(fn.saved, g, fn) } end
        fn.taken_grad, fn.taken_alone = nil, nil
        for j, x in ipairs(fn.inputs) do
          if x.requires_grad then
            local gx = in_grads[j]
            if gx ~= nil then
              if gx.shape and #gx.shape ~= #x.shape then gx = gx:view(x.shape) end
              local acc = grads[x]
              if acc == nil then
                grads[x] = gx; hold(gx)
              else
                local sum = acc:add(gx)
                grads[x] = sum; hold(sum)
                drop(acc)
                if held[gx] == nil and gx ~= g then release(gx) end
              end
            end
            deps[x] = deps[x] - 1
            if deps[x] == 0 then
              -- a leaf's gradient is final now: write it and fire its hooks
              if x.grad_fn == nil then leaf_done(x) else ready[#ready + 1] = x end
            end
          end
        end
        if g ~= nil then drop(g) end
        -- (after its inputs' gradients are held: the node may return it as one)
        if taken ~= nil then drop(taken) end
        if not retain then
          if fn.owned then for _, o in ipairs(fn.owned) do release(o) end end
          fn.saved, fn.inputs, fn.owned, fn.versions = nil, nil, nil, nil
          if free_activations and t ~= root then release(t) end
        end
      end
    end
  end)
  grad_enabled = prev
  if not ok then error(err, 2) end
end

-- Recomputation in backward: the mechanism of activation checkpointing
-- (A.checkpoint) and of FSDP's units that reshard after forward.  Runs
-- fn(args[1..args.n]) without recording (its temporaries go with a scope),
-- and records one node whose backward re-runs fn with recording on, under
-- the forward's RNG state, and backpropagates g through it.  Only the
-- input gradients survive the recomputation; parameters' gradients
-- accumulate in their .grad (never deferred here: the recomputation's
-- tensors go with its scope), and its activations are freed as they are
-- used.  hooks (all optional):
--   inputs          tensors the node depends on besides args' (FSDP: the
--                   unit's parameters, so the node exists when only they need
--                   gradients; it returns none for them)
--   after_forward(res)  sees fn's results (FSDP: releases the gathered
--                   parameters, checks that the unit returned one tensor)
--   before_backward(), after_backward()  around the recomputation (FSDP:
--                   gathers the parameters again; reduce-scatters the gradients)
--   name            the node's name
function A.recompute(fn, args, hooks)
  hooks = hooks or {}
  local n = args.n or table.maxn(args)
  local rng_state = A.get_rng_state and A.get_rng_state()
  -- the no-grad forward keeps nothing but its output
  local res = { Tensor.scope(A.no_grad, fn, unpack(args, 1, n)) }
  if hooks.after_forward then hooks.after_forward(res) end
  local out = res[1]
  if not grad_enabled then return unpack(res, 1, table.maxn(res)) end
  local inputs, saved = {}, {}
  for i = 1, n do if getmetatable(args[i]) == Tensor then inputs[#inputs + 1] = args[i] end end
  local ntensors = #inputs
  for i = 1, ntensors do saved[i] = inputs[i] end  -- the recomputation reads them
  for _, t in ipairs(hooks.inputs or {}) do inputs[#inputs + 1] = t end
  local function backward(_, g)
    if hooks.before_backward then hooks.before_backward() end
    local detached, rerun_args = {}, {}
    for i = 1, n do
      local a = args[i]
      if getmetatable(a) == Tensor then
        local d = a:detach()
        d.requires_grad = a.requires_grad
        detached[#detached + 1] = d
        rerun_args[i] = d
      else
        rerun_args[i] = a
      end
    end
    local saved_rng = A.get_rng_state and A.get_rng_state()
    if rng_state then A.set_rng_state(rng_state) end
    local prev = A.set_grad_enabled(true)
    local queue = A.defer_weight_grads(nil)
    local res2 = { pcall(Tensor.scope, function()
      local out2 = fn(unpack(rerun_args, 1, n))
      if getmetatable(out2) == Tensor and out2.requires_grad then A.backward(out2, g, { free_activations = true }) end
      local grads = {}
      for i, d in ipairs(detached) do
        local gx = d.grad
        if gx then gx._keep = nil end  -- an ordinary temporary of the backward from here
        grads[i] = gx
      end
      return unpack(grads, 1, #detached)
    end) }
    A.set_grad_enabled(prev)
    A.defer_weight_grads(queue)
    if saved_rng then A.set_rng_state(saved_rng) end
    if not res2[1] then error(res2[2], 0) end
    if hooks.after_backward then hooks.after_backward() end
    return unpack(res2, 2, ntensors + 1)
  end
  return A.record(out:detach(), inputs, backward, saved, hooks.name or 'checkpoint')
end

-- Activation checkpointing: fn's activations are not kept; backward
-- recomputes them (A.recompute).
function A.checkpoint(fn, ...)
  return A.recompute(fn, { n = select('#', ...), ... })
end

-- the public entry points check their arguments (gptlua.check.wrap)
A.backward = check.wrap('backward', 'root:tensor, grad:tensor?, opts:opts?', A.backward)
A.checkpoint = check.wrap('checkpoint', 'fn:callable', A.checkpoint)
A.no_grad = check.wrap('no_grad', 'fn:callable', A.no_grad)
A.set_grad_enabled = check.wrap('set_grad_enabled', 'flag:boolean', A.set_grad_enabled)

return A
