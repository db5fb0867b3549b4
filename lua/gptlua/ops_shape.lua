-- gptlua.ops_shape — differentiable lookups and shape ops: embedding,
-- index_select, gather, cat, stack, split and chunk.  Functions land in
-- gptlua.ops (gl.*) and as Tensor methods.

local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local A = require 'gptlua.autograd'
local O = require 'gptlua.ops'
local check = require 'gptlua.check'
local ffi, lib = G.ffi, G.lib
local record = A.record
local empty_like = O.empty_like
local norm_dim = O.norm_dim

local function shape_str(s) return '{' .. table.concat(s, ',') .. '}' end

-- ---------------------------------------------------------------- embedding
-- embedding(ids, weight): the rows of weight (vocab, C) at integer ids ->
-- shape ids.shape .. {C}
function O.embedding(ids, table_)
  local oshape = ids:size(); oshape[#oshape + 1] = table_.shape[2]
  local out = Tensor.empty(oshape, { dtype = table_.dtype, device = table_.device })
  G.check(lib.gl_embedding_forward(out.c, table_.c, ids.c), 2)
  return record(out, { table_ }, function(_, g)
    local dt = empty_like(table_)
    local gc = g:is_contiguous() and g or g:contiguous()
    G.check(lib.gl_embedding_backward(dt.c, gc.c, ids.c), 2)
    return dt
  end, { ids }, 'embedding')
end

-- index_select(x, dim, idx) and gather(x, dim, idx)
function O.index_select(x, dim, idx)
  local d = norm_dim(x, dim, 'index_select')
  local oshape = x:size(); oshape[d] = idx:numel()
  local out = empty_like(x, oshape)
  G.check(lib.gl_index_select(out.c, x.c, d - 1, idx.c), 2)
  return record(out, { x }, function(_, g)
    local gx = O.zeros(x.shape, { dtype = g.dtype, device = g.device })
    G.check(lib.gl_index_add(gx.c, d - 1, idx.c, g.c), 2)
    return gx
  end, { idx }, 'index_select')
end
-- gather(x, dim, index): x's elements along dim at index (torch.gather: the
-- output has index's shape)
function O.gather(x, dim, idx)
  local d = norm_dim(x, dim, 'gather')
  local out = empty_like(x, idx.shape)
  G.check(lib.gl_gather(out.c, x.c, d - 1, idx.c), 2)
  return record(out, { x }, function(_, g)
    local gx = O.zeros(x.shape, { dtype = g.dtype, device = g.device })
    G.check(lib.gl_scatter_add(gx.c, d - 1, idx.c, g.c), 2)
    return gx
  end, { idx }, 'gather')
end
Tensor.index_select, Tensor.gather = O.index_select, O.gather


-- ---------------------------------------------------------------- shape ops
-- cat(list, dim): copies each piece into a narrow of the output
function O.cat(list, dim)
  if #list == 0 then error('cat: expected a non-empty list of tensors', 2) end
  local first = list[1]
  local d = norm_dim(first, dim or 1, 'cat')
  local shape = first:size()
  local total = 0
  for i, t in ipairs(list) do
    if #t.shape ~= #shape then error(('cat: tensor %d has %d dims, expected %d'):format(i, #t.shape, #shape), 2) end
    for k = 1, #shape do
      if k ~= d and t.shape[k] ~= shape[k] then
        error(('cat: tensor %d has shape %s, expected %s except in dim %d'):format(i, shape_str(t.shape),
          shape_str(shape), d), 2)
      end
    end
    total = total + t.shape[d]
  end
  shape[d] = total
  local out = empty_like(first, shape)
  local pos = 1
  local starts = {}
  A.no_grad(function()
    for i, t in ipairs(list) do
      starts[i] = pos
      local slot = out:narrow(d, pos, t.shape[d])
      slot:copy_(t)
      O.drop_view(slot)  -- (a view left to the scope's end would keep out's storage after out is released)
      pos = pos + t.shape[d]
    end
  end)
  return record(out, list, function(_, g)
    local grads = {}
    for i, t in ipairs(list) do grads[i] = g:narrow(d, starts[i], t.shape[d]) end
    return unpack(grads, 1, #list)
  end, nil, 'cat')
end
-- stack(list, dim): tensors of one shape joined along a new dim
function O.stack(list, dim)
  local parts = {}
  for i, t in ipairs(list) do parts[i] = t:unsqueeze(dim or 1) end
  return O.cat(parts, dim or 1)
end
-- split(x, size, dim): pieces of `size` (the last may be smaller)
function O.split(x, size, dim)
  local d = norm_dim(x, dim or 1, 'split')
  check.integer(size, 'split', 'size', 1)
  local out, pos = {}, 1
  while pos <= x.shape[d] do
    local n = math.min(size, x.shape[d] - pos + 1)
    out[#out + 1] = x:narrow(d, pos, n)
    pos = pos + n
  end
  return out
end
-- chunk(x, n, dim): x cut into n pieces along dim (the last may be smaller)
function O.chunk(x, n, dim)
  local d = norm_dim(x, dim or 1, 'chunk')
  check.integer(n, 'chunk', 'n', 1)
  return O.split(x, math.ceil(x.shape[d] / n), d)
end
Tensor.split, Tensor.chunk = O.split, O.chunk


return O
