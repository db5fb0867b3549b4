-- gptlua.dist.fsdp_fp8 — FSDP's FP8 all-gather: the weights of the linear
-- layers the FP8 policy chose (gptlua.fp8: Linear.fp8) travel as float8
-- codes, quantized on each rank's shard, where the unit's other parameters
-- travel in their own dtype (torchao's float8 all-gather).
--
-- The gathered codes and scales are those gl.fp8_linear quantizes in one
-- process from the whole weight, byte for byte: each rank computes its
-- pieces' amax (gl_fp8_amax), one all-reduce (max) over the shard group
-- makes them the whole weight's (on the device: nothing waits on the host),
-- and each rank casts its pieces with them (gl_fp8_cast, the cast
-- gl_fp8_quantize makes).  A weight W (R, C) lies in the unit's flat buffer
-- row-major and the shards cut it anywhere, so a rank's piece is a
-- partial first row, whole rows and a partial last row: for amax each has
-- its own slots (a row's amax for 'rowwise', one per part for the
-- tensorwise amax and the column amax), which the all-reduce's max folds
-- with the other ranks' parts of the same rows.
--
-- The products and the forms they need: the forward's W (rows scaled along
-- the inner dim C) is the gathered q; the input gradient's W^T is scaled
-- along W's columns.  Tensorwise that is q's bytes transposed (one scale);
-- rowwise it is another set of codes (one scale per column), gathered as a
-- second float8 buffer only when a backward will use it (a forward that
-- keeps the unit for backward, or backward's re-gather): rowwise moves 2
-- bytes per weight element there, tensorwise 1.  The weight gradient
-- (dy^T x) does not read W.  Masters, optimizer and the gradients'
-- reduce-scatter are untouched; the checkpoint and detach gathers stay
-- exact (high precision).
--
-- Layout: the unit's high-precision parameters gather into u.full as
-- their own concatenation (each rank sends its shard's high-precision
-- pieces in flat order, all_gather with per-rank counts), the FP8 weights
-- into u.full8 (and u.full8c, rowwise's column form) likewise, so every
-- parameter is one contiguous range of its buffer.  An FP8 weight stays
-- freed while gathered and carries its codes in W.fp8_gathered, which
-- gl.fp8_linear uses instead of quantizing W.
local gl = require 'gptlua'
local G = require 'gptlua.ffi'
local Tensor = gl.Tensor
local lib = G.lib

local M = {}

local E4M3 = 'float8_e4m3fn'

-- the FP8-chosen weights of the model: weight tensor -> recipe
function M.chosen(model)
  local nn = require 'gptlua.nn'
  local out = {}
  for _, m in ipairs(model:modules()) do
    -- (a weight tp cut, m.tp_cut, gathers in its dtype: its FP8 scales span
    -- the tp group too, which gl.fp8_linear's split reduces over)
    if getmetatable(m) == nn.Linear and m.fp8 and not m.tp_cut then out[m.weight] = m.fp8 end
  end
  return out
end

-- The unit's FP8 gather plan, or nil when none of its parameters is
-- chosen; S ranks, c elements per shard.  For every rank q its segments
-- {i = param index, lo, hi (flat), fp8}; offsets of each parameter in the
-- gathered buffers; the amax slots of each FP8 weight.
function M.plan(u, chosen, S)
  local recipe
  for _, p in ipairs(u.params) do
    local r = chosen[p]
    if r then
      if recipe and recipe ~= r then error(('fsdp: unit %s mixes fp8 recipes %s and %s'):format(u.name, recipe, r), 3) end
      if u.dtype ~= 'float32' and u.dtype ~= 'bfloat16' then return nil end
      recipe = r
    end
  end
  if not recipe then return nil end
  local P = { recipe = recipe, ranks = {}, hp_off = {}, f8_off = {}, slots = {}, nhp = 0, nf8 = 0, nslots = 0 }
  for i, p in ipairs(u.params) do
    if chosen[p] then
      local R, C = p.shape[1], p.shape[2]
      P.f8_off[i] = P.nf8
      P.nf8 = P.nf8 + R * C
      -- tensorwise: 3 part slots; rowwise: R row slots, then 3 x C column-part slots
      P.slots[i] = P.nslots
      P.nslots = P.nslots + (recipe == 'tensorwise' and 3 or R + 3 * C)
    else
      P.hp_off[i] = P.nhp
      P.nhp = P.nhp + p:numel()
    end
  end
  P.hp_counts, P.f8_counts = {}, {}
  for q = 0, S - 1 do
    local lo_r, hi_r, segs, nh, nf = q * u.c, (q + 1) * u.c, {}, 0, 0
    for i, p in ipairs(u.params) do
      local lo, hi = math.max(u.offs[i], lo_r), math.min(u.offs[i] + p:numel(), hi_r)
      if hi > lo then
        local f = chosen[p] ~= nil
        segs[#segs + 1] = { i = i, lo = lo, hi = hi, fp8 = f, at = f and nf or nh }
        if f then nf = nf + hi - lo else nh = nh + hi - lo end
      end
    end
    P.ranks[q] = segs
    P.hp_counts[q + 1], P.f8_counts[q + 1] = nh, nf
  end
  return P
end

-- the parts of a piece [a, b) of a row-major (R, C) matrix: {start, rows,
-- cols, row, col, part} with part 1 (a partial first row, or the piece
-- within one row), 2 (whole rows), 3 (a partial last row)
local function parts(a, b, C)
  local r0, c0, r1, c1 = math.floor(a / C), a % C, math.floor(b / C), b % C
  if r0 == r1 then return { { start = a, rows = 1, cols = c1 - c0, row = r0, col = c0, part = 1 } } end
  local out, r = {}, r0
  if c0 > 0 then out[#out + 1] = { start = a, rows = 1, cols = C - c0, row = r0, col = c0, part = 1 }; r = r0 + 1 end
  if r1 > r then out[#out + 1] = { start = r * C, rows = r1 - r, cols = C, row = r, col = 0, part = 2 } end
  if c1 > 0 then out[#out + 1] = { start = r1 * C, rows = 1, cols = c1, row = r1, col = 0, part = 3 } end
  return out
end

local function sv(t, shape, strides, off) return t:_as_strided(shape, strides, t:storage_offset() + off) end

-- Starts the FP8 gather of unit u (the policy self, plan P): amax,
-- all-reduce, cast, then the all-gathers; cols: gather the column form
-- too (rowwise).  Sets u.full, u.full8 (u.full8c), u.f8 (the scales) and
-- u.works.
function M.start(self, u, P, cols)
  local rw = P.recipe == 'rowwise'
  cols = cols and rw
  local s, dev = self.s, u.device
  local segs = P.ranks[s]
  local amax = gl.zeros({ math.max(P.nslots, 1) }, { dtype = 'float32', device = dev }):keep()
  local send_h = gl.empty({ P.hp_counts[s + 1] }, { dtype = u.dtype, device = dev }):keep()
  local send_8 = gl.empty({ P.f8_counts[s + 1] }, { dtype = E4M3, device = dev }):keep()
  local send_c = cols and gl.empty({ P.f8_counts[s + 1] }, { dtype = E4M3, device = dev }):keep() or nil
  local scales = {}
  gl.scope(function()
    local base = s * u.c
    -- this rank's amax parts, and its high-precision pieces packed
    for _, g in ipairs(segs) do
      local src = g.lo - base
      if not g.fp8 then
        G.check(lib.gl_copy(sv(send_h, { g.hi - g.lo }, { 1 }, g.at).c, sv(u.pshard, { g.hi - g.lo }, { 1 }, src).c), 2)
      else
        local p, off = u.params[g.i], u.offs[g.i]
        local C, sl = p.shape[2], P.slots[g.i]
        for _, r in ipairs(parts(g.lo - off, g.hi - off, C)) do
          local x = sv(u.pshard, { r.rows, r.cols }, { C, 1 }, src + r.start - (g.lo - off))
          if rw then
            G.check(lib.gl_fp8_amax(sv(amax, { r.rows }, { 1 }, sl + r.row).c, x.c, 1), 2)
            local xt = sv(u.pshard, { r.cols, r.rows }, { 1, C }, src + r.start - (g.lo - off))
            local R = p.shape[1]
            G.check(lib.gl_fp8_amax(sv(amax, { r.cols }, { 1 }, sl + R + (r.part - 1) * C + r.col).c, xt.c, 1), 2)
          else
            G.check(lib.gl_fp8_amax(sv(amax, { 1 }, { 1 }, sl + r.part - 1).c, x.c, 0), 2)
          end
        end
      end
    end
  end)
  -- the whole weights' amax over the shard group (max of the parts)
  if self.shard.size > 1 then self.shard:all_reduce_async(amax, 'max'):wait() end
  gl.scope(function()
    for i, p in ipairs(u.params) do
      if P.f8_off[i] then
        local R, C, sl = p.shape[1], p.shape[2], P.slots[i]
        local f = {}
        if rw then
          f.rows = sv(amax, { R }, { 1 }, sl)
          local colamax = gl.empty({ C }, { dtype = 'float32', device = dev }):keep()
          G.check(lib.gl_fp8_amax(colamax.c, sv(amax, { C, 3 }, { 1, C }, sl + R).c, 1), 2)
          f.cols = colamax
        else
          local whole = gl.empty({ 1 }, { dtype = 'float32', device = dev }):keep()
          G.check(lib.gl_fp8_amax(whole.c, sv(amax, { 1, 3 }, { 3, 1 }, sl).c, 0), 2)
          f.rows, f.cols = whole, whole
        end
        f.s = gl.empty({ rw and R or 1 }, { dtype = 'float32', device = dev }):keep()
        G.check(lib.gl_fp8_scale_inv(f.s.c, f.rows.c, lib.GL_F8E4M3), 2)
        if rw then
          f.sc = gl.empty({ C }, { dtype = 'float32', device = dev }):keep()
          G.check(lib.gl_fp8_scale_inv(f.sc.c, f.cols.c, lib.GL_F8E4M3), 2)
        else
          f.sc = f.s
        end
        f.rows:keep()
        scales[i] = f
      end
    end
    -- this rank's pieces cast with the whole weights' amax
    local base = s * u.c
    for _, g in ipairs(segs) do
      if g.fp8 then
        local p, off, f = u.params[g.i], u.offs[g.i], scales[g.i]
        local C = p.shape[2]
        for _, r in ipairs(parts(g.lo - off, g.hi - off, C)) do
          local at = r.start - (g.lo - off)
          local x = sv(u.pshard, { r.rows, r.cols }, { C, 1 }, g.lo - base + at)
          local q = sv(send_8, { r.rows, r.cols }, { r.cols, 1 }, g.at + at)
          local a = rw and sv(f.rows, { r.rows }, { 1 }, r.row) or f.rows
          G.check(lib.gl_fp8_cast(q.c, x.c, a.c), 2)
          if cols then  -- scaled per column: the transposed piece cast row by row, moved back
            local xt = sv(u.pshard, { r.cols, r.rows }, { 1, C }, g.lo - base + at)
            local qt = gl.empty({ r.cols, r.rows }, { dtype = E4M3, device = dev })
            G.check(lib.gl_fp8_cast(qt.c, xt.c, sv(f.cols, { r.cols }, { 1 }, r.col).c), 2)
            local dst = sv(send_c, { r.cols, r.rows }, { 1, r.cols }, g.at + at)
            G.check(lib.gl_copy(dst.c, qt.c), 2)
          end
        end
      end
    end
  end)
  amax:free()
  u.full = gl.empty({ P.nhp }, { dtype = u.dtype, device = dev }):keep()
  u.full8 = gl.empty({ P.nf8 }, { dtype = E4M3, device = dev }):keep()
  u.full8c = cols and gl.empty({ P.nf8 }, { dtype = E4M3, device = dev }):keep() or nil
  u.f8, u.f8_sends = scales, { send_h, send_8, send_c }
  u.works = {
    self.shard:all_gather_async(u.full, send_h, { counts = P.hp_counts }),
    self.shard:all_gather_async(u.full8, send_8, { counts = P.f8_counts }),
    cols and self.shard:all_gather_async(u.full8c, send_c, { counts = P.f8_counts }) or nil,
  }
end

-- the bytes the unit's gathered buffers hold (the policy's stats.live)
function M.bytes(u)
  local B = require 'gptlua.dist.policies.base'
  return B.bytes(u.full) + B.bytes(u.full8) + (u.full8c and B.bytes(u.full8c) or 0)
end

-- waits for the gathers, binds the parameters: high-precision ones as
-- views of u.full, FP8 ones freed with their codes in p.fp8_gathered
function M.finish(self, u, P)
  for k = 1, 3 do if u.works[k] then u.works[k]:wait() end end
  u.works = nil
  for k = 1, 3 do if u.f8_sends[k] then u.f8_sends[k]:free() end end
  u.f8_sends = nil
  local B = require 'gptlua.dist.policies.base'
  for i, p in ipairs(u.params) do
    if P.f8_off[i] then
      local R, C, f = p.shape[1], p.shape[2], u.f8[i]
      Tensor.release(p)
      rawset(p, 'fp8_gathered', { recipe = P.recipe, q = B.view(u.full8, P.f8_off[i], { R, C }), s = f.s,
        qc = P.recipe == 'tensorwise' and B.view(u.full8, P.f8_off[i], { R, C })
          or (u.full8c and B.view(u.full8c, P.f8_off[i], { R, C })) or nil, sc = f.sc })
    else
      Tensor.rebind(p, B.view(u.full, P.hp_off[i], p.shape).c)
    end
  end
end

-- frees the FP8 gather's buffers and the weights' codes
function M.release(u)
  for _, p in ipairs(u.params) do
    local g = rawget(p, 'fp8_gathered')
    if g then
      rawset(p, 'fp8_gathered', nil)
      g.q:free(); if g.qc then g.qc:free() end
    end
  end
  for _, f in pairs(u.f8 or {}) do
    f.s:free(); if f.sc ~= f.s then f.sc:free() end
    if f.cols ~= f.rows then f.cols:free() end
    f.rows:free()
  end
  u.f8 = nil
  u.full8:free(); u.full8 = nil
  if u.full8c then u.full8c:free(); u.full8c = nil end
end

return M
