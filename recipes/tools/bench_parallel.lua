-- recipes/tools/bench_parallel.lua — communication per step and rank of each mesh
-- layout (dp, tp, tp + sp, cp Ulysses and ring, tp x cp, ZeRO over dp), counted in the communicator and
-- compared with the model in ARCHITECTURE.md ("Tensor and sequence
-- parallel"), and the step time on CPU ranks.
--
--   gptlua recipes/tools/bench_parallel.lua [--ranks=4] [--steps=3] [--n_layer=2] [--n_embd=128]
--                                     [--block_size=64] [--batch_size=4]
--
-- Without a launcher it starts `gptlua -n RANKS` on itself.  Every layout
-- trains the same gpt2 (char data, float32) on the same global batch
-- (batch_size x RANKS rows: a layout with fewer dp ranks accumulates more
-- micro-steps).  Each collective a rank starts is counted with the bytes a
-- ring algorithm makes it send: all-reduce 2(n-1)/n of the tensor,
-- all-gather (n-1) x its input, reduce-scatter (n-1) x its output,
-- all-to-all (n-1)/n of its input, send the tensor; per step, by the mesh
-- dimension of the Comm (tp, cp, dp: the gradients' group, world).  The
-- model's column is what the layout should send (per optimizer step, per
-- rank; Tl = T/cp the rank's rows, Ck = C/tp the rank's K or V width):
--   tp   A (4L + 2) 2(tp-1)/tp B Tl C + A 3 2(tp-1)/tp B Tl   (+ sp: 2(tp-1)/tp P_repl
--        and the backward's gathers of the column-parallel inputs, A (2L + 1) (tp-1)/tp B Tl C)
--   cp   Ulysses: A L 8 (cp-1)/cp B Tl C/tp
--        ring:    A L (2(cp-1) + cp) 2 B Tl Ck  (K/V forward and backward, dK/dV
--                 one more hop; ring_attention.lua)
--   dp   2(n-1)/n P_rank (the rank's parameter elements; n = dp x cp)
-- with A micro-steps, L blocks, e bytes per element.  Step times are the
-- slowest rank's mean over --steps after one warm-up step; on a shared
-- machine they are noisy: compare them as ratios within one run.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local now = require('gptlua.cli').now

local opts = { ranks = '4', steps = '3', n_layer = '2', n_embd = '128', block_size = '64', batch_size = '4' }
local passthrough = {}
for _, a in ipairs(arg or {}) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then error('bench_parallel: unknown argument ' .. a, 0) end
  if not tonumber(v) then error(('bench_parallel: --%s expected a number, got %s'):format(k, v), 0) end
  opts[k] = v
  passthrough[#passthrough + 1] = a
end

local world = dist.init {}
if world.size == 1 then
  local cmd = ('%s -n %s %s %s 2>&1'):format(GPTLUA.exe, opts.ranks, arg[0], table.concat(passthrough, ' '))
  local p = io.popen(cmd)
  for line in p:lines() do print(line) end
  local ok = p:close()
  return ok and 0 or 1
end
local N = world.size

-- ------------------------------------------------ counting the bytes --
local Comm = dist.Comm
local counting = {}    -- Comm -> bytes sent, while a layout is measured
local function count(comm, bytes) counting[comm] = (counting[comm] or 0) + bytes end
local function esize(t) return t:numel() * gl.lib.gl_dtype_size(t.c.dtype) end
local function list_or_tensor(x, i)  -- a list's i-th entry or the tensor's 1/n
  if getmetatable(x) == gl.Tensor then return x end
  return x[i]
end
local model = {
  all_reduce = function(self, t) return 2 * (self.size - 1) / self.size * esize(t) end,
  all_gather = function(self, out, input) return (self.size - 1) * esize(input) end,
  reduce_scatter = function(self, out) return (self.size - 1) * esize(list_or_tensor(out, 1)) end,
  broadcast = function(self, t) return esize(t) end,
  send = function(self, t) return esize(t) end,
  all_to_all = function(self, out, input)
    local b = 0
    if getmetatable(input) == gl.Tensor then b = esize(input)
    else for i = 1, self.size do b = b + esize(input[i]) end end
    return (self.size - 1) / self.size * b
  end,
}
for name, bytes in pairs(model) do
  for _, m in ipairs({ name, name .. '_async' }) do
    local orig = Comm[m]
    Comm[m] = function(self, ...)
      if self.size > 1 then count(self, bytes(self, ...)) end
      return orig(self, ...)
    end
  end
end

-- ------------------------------------------------------------ layouts --
local L, C, T, Bsz = tonumber(opts.n_layer), tonumber(opts.n_embd), tonumber(opts.block_size), tonumber(opts.batch_size)
local layouts = {
  { name = 'ddp dp' .. N, args = {} },
  { name = 'ddp dp2 x tp2', args = { '--dp=2', '--tp=2' } },
  { name = 'ddp dp2 x tp2 + sp', args = { '--dp=2', '--tp=2', '--sp' } },
  { name = 'zero1 dp2 x tp2', args = { '--dp=2', '--tp=2', '--dist=zero1' } },
  { name = 'tp' .. N, args = { '--tp=' .. N } },
  { name = 'tp' .. N .. ' + sp', args = { '--tp=' .. N, '--sp' } },
  { name = 'ddp dp2 x cp2', args = { '--dp=2', '--cp=2' } },
  { name = 'cp' .. N, args = { '--cp=' .. N } },
  { name = 'ring dp2 x cp2', args = { '--dp=2', '--cp=2', '--cp_mode=ring' } },
  { name = 'ring cp' .. N, args = { '--cp=' .. N, '--cp_mode=ring' } },
  { name = 'tp2 x cp2', args = { '--tp=2', '--cp=2' }, four = true },
  { name = 'ring tp2 x cp2', args = { '--tp=2', '--cp=2', '--cp_mode=ring' }, four = true },
}

local function recipe()
  return { name = 'bench', model = 'gpt2', data = 'char', n_layer = L, n_head = 4, n_embd = C, block_size = T,
    batch_size = Bsz, total_batch_size = Bsz * T * N, vocab_size = 68, dropout = 0, dtype = 'float32',
    device = 'cpu', dist = 'ddp', quiet = true, eval_interval = 0, sample_length = 0, log_interval = 0,
    peak_flops = 1e12, max_iters = 100, out_dir = (os.getenv('TMPDIR') or '/tmp') .. '/gptlua_bench_parallel' }
end

local function fmt_mb(b) return ('%.3f'):format(b / 2 ^ 20) end

if world.rank == 0 then
  print(('%d ranks, gpt2 %d layers, width %d, context %d, global batch %d rows; bytes sent per rank per optimizer '
    .. 'step (MiB), counted / model'):format(N, L, C, T, Bsz * N))
  print(('%-22s %18s %18s %18s %10s %12s'):format('layout', 'tp', 'cp', 'dp', 'world', 'ms/step'))
end
for _, lay in ipairs(layouts) do
  if (N % 4 == 0 or not lay.args[1] or not lay.args[1]:match('dp=2')) and (not lay.four or N == 4) then
    local t = train.new(recipe(), lay.args)
    t:train_step()  -- warm-up (and the setup's broadcasts)
    counting = {}
    world:barrier()
    local steps = tonumber(opts.steps)
    local t0 = now()
    for _ = 1, steps do t:train_step() end
    local dt = world:all_reduce_number((now() - t0) / steps, 'max')
    local mesh = t.mesh
    local by = { tp = 0, cp = 0, dp = 0, world = 0 }
    local grads = t.policy.inner and t.policy.inner.comm or t.policy.comm
    for comm, b in pairs(counting) do
      local d = (mesh and comm == mesh.tp and 'tp') or (mesh and comm == mesh.cp and 'cp')
        or ((comm == grads) and 'dp') or 'world'
      by[d] = by[d] + b / steps
    end
    -- the model (see the header), per optimizer step and rank
    local tp, cp = mesh and mesh.size.tp or 1, mesh and mesh.size.cp or 1
    local dp = (mesh and mesh.size.dp or N) * cp
    local A, e = t.cfg.gradient_accumulation_steps, 4
    local P_rank, P_repl = 0, 0
    for _, p in ipairs(t.params) do
      P_rank = P_rank + p:numel()
      if not (t.tp_layout and t.tp_layout.sharded[p]) then P_repl = P_repl + p:numel() end
    end
    local Tl, Ck = T / cp, C / tp
    local want_tp = tp > 1 and A * ((4 * L + 2) * 2 * (tp - 1) / tp * Bsz * Tl * C + 3 * 2 * (tp - 1) / tp * Bsz * Tl) * e
      or 0
    if tp > 1 and t.cfg.sp then
      want_tp = want_tp + 2 * (tp - 1) / tp * P_repl * e + A * (2 * L + 1) * (tp - 1) / tp * Bsz * Tl * C * e
    end
    local want_dp = dp > 1 and 2 * (dp - 1) / dp * P_rank * e or 0
    local want_cp = cp > 1 and A * L * 8 * (cp - 1) / cp * Bsz * Tl * Ck * e or 0
    if cp > 1 and t.cfg.cp_mode == 'ring' then want_cp = A * L * (2 * (cp - 1) + cp) * 2 * Bsz * Tl * Ck * e end
    -- the slowest rank's counts (ranks of one layout send alike)
    for _, k in ipairs({ 'tp', 'cp', 'dp', 'world' }) do by[k] = world:all_reduce_number(by[k], 'max') end
    if world.rank == 0 then
      print(('%-22s %8s / %-7s %8s / %-7s %8s / %-7s %10s %12.1f'):format(lay.name, fmt_mb(by.tp), fmt_mb(want_tp),
        fmt_mb(by.cp), fmt_mb(want_cp), fmt_mb(by.dp), fmt_mb(want_dp), fmt_mb(by.world), 1000 * dt))
      io.stdout:flush()
    end
    t.policy:detach()
  end
end
