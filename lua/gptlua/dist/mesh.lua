-- gptlua.dist.mesh — the world arranged as a grid of named dimensions.
--
--   local mesh = dist.mesh{ dp = 2, tp = 2 }      -- 4 ranks
--   mesh.tp, mesh.dp                              -- a Comm per dimension
--   mesh.size.tp, mesh.coord.tp                   -- its size, this rank's place in it
--
-- Dimensions, outermost first: pp (pipeline parallel: the ranks that hold
-- consecutive stages of the model's blocks, gptlua.dist.pipeline), dp (data parallel: replicas or shards of the
-- model that see different batches), cp (context parallel: the ranks that
-- split one sequence), tp (tensor parallel: the ranks that split one
-- layer's matrices).  mesh.dp_cp is the group of dp x cp (the ranks with
-- this rank's tp coordinate): gradients of a layout with cp average over it.  tp is innermost, as Megatron-LM and torchtitan lay it out: the
-- ranks of a tp group are consecutive, so with one node per tp group its
-- per-block all-reduces stay inside the node.  pp is outermost (as
-- Megatron-LM's default order): a stage boundary carries one activation per
-- microbatch, point to point, the least traffic of any dimension, so it is
-- the one to cross nodes; each stage's dp x cp x tp block of ranks is then
-- contiguous.  So with dp = 2, tp = 2:
--
--   rank   0  1  2  3
--   dp     0  0  1  1      mesh.dp groups {0, 2} and {1, 3}
--   tp     0  1  0  1      mesh.tp groups {0, 1} and {2, 3}
--
-- Each dimension's Comm is a split of the world (color: the rank's
-- coordinates in the other dimensions, key: its coordinate in this one), so
-- a rank's place in the dimension is its rank in that Comm.  Policies take
-- the groups they need from the mesh and communicate only through Comm
-- methods (the planner runs them over a fake world).  A dimension left out
-- has size 1; dp left out (or 0) takes what the others leave of the world.
--
-- ep (expert parallelism, gptlua.dist.expert_parallel) is not a dimension
-- of the grid but a cut of dp: with ep > 1 (dividing dp), mesh.ep is the
-- group of ep consecutive dp ranks that split the experts, mesh.ep_replica
-- the dp / ep ranks that hold the same experts.
local M = {}

M.DIMS = { 'pp', 'dp', 'cp', 'tp' }   -- outermost first
local KNOWN = { pp = true, dp = true, cp = true, tp = true, ep = true, world = true }

local function fail(msg) error('dist.mesh: ' .. msg, 0) end  -- a user's error: one line

-- Checks sizes against the world's and returns {dp = , cp = , tp = }.
-- (No communication: the spec checks refusals in a world of one.)
function M.sizes(o, world_size)
  for k in pairs(o) do
    if not KNOWN[k] then
      fail(('unknown dimension %s (expected pp, dp, cp, tp or ep)'):format(tostring(k)))
    end
  end
  local s = {}
  for _, d in ipairs(M.DIMS) do
    local v = o[d]
    if v == nil then v = (d == 'dp') and 0 or 1 end
    if type(v) ~= 'number' or v ~= math.floor(v) or v < 0 or (v == 0 and d ~= 'dp') then
      fail(('%s expected a positive integer%s, got %s'):format(d, d == 'dp' and ' (or 0: the rest of the world)' or '',
        tostring(v)))
    end
    s[d] = v
  end
  local inner = s.cp * s.tp * s.pp
  if s.dp == 0 then
    if world_size % inner ~= 0 then
      if s.pp == 1 then
        fail(('tp %d x cp %d = %d does not divide the world of %d ranks'):format(s.tp, s.cp, inner, world_size))
      end
      fail(('pp %d x cp %d x tp %d = %d does not divide the world of %d ranks'):format(s.pp, s.cp, s.tp, inner,
        world_size))
    end
    s.dp = world_size / inner
  end
  if s.dp * inner ~= world_size then
    if s.pp == 1 then
      fail(('dp %d x cp %d x tp %d = %d ranks, but the world has %d'):format(s.dp, s.cp, s.tp, s.dp * inner, world_size))
    end
    fail(('pp %d x dp %d x cp %d x tp %d = %d ranks, but the world has %d'):format(s.pp, s.dp, s.cp, s.tp,
      s.dp * inner, world_size))
  end
  local ep = o.ep == nil and 1 or o.ep
  if type(ep) ~= 'number' or ep ~= math.floor(ep) or ep < 1 then
    fail(('ep expected a positive integer, got %s'):format(tostring(ep)))
  end
  if s.dp % ep ~= 0 then fail(('ep %d does not divide dp %d'):format(ep, s.dp)) end
  if o.ep ~= nil then s.ep = ep end  -- (asked for only: a mesh without ep reads as before)
  return s
end

local Mesh = {}
Mesh.__index = Mesh
M.Mesh = Mesh

function Mesh:__tostring()
  local parts = {}
  local pp = self.size.pp > 1  -- (pp named only when used: the layouts before it print as they did)
  for _, d in ipairs(M.DIMS) do
    if d ~= 'pp' or pp then parts[#parts + 1] = ('%s %d'):format(d, self.size[d]) end
  end
  if self.size.ep > 1 then parts[#parts + 1] = ('ep %d'):format(self.size.ep) end
  local at = { self.coord.dp, self.coord.cp, self.coord.tp }
  if pp then table.insert(at, 1, self.coord.pp) end
  return ('Mesh(%s; rank %d at %s)'):format(table.concat(parts, ' x '), self.world.rank, table.concat(at, ','))
end

-- mesh(o): o.pp, o.dp, o.cp, o.tp sizes; o.world the Comm to arrange (default:
-- dist.init()).  Collective over the world (one split per dimension).
function M.new(o)
  if type(o) ~= 'table' then fail('expected a table of dimension sizes, e.g. {dp = 2, tp = 2}') end
  local world = o.world or require('gptlua.dist').init()
  local size = M.sizes(o, world.size)
  size.ep = size.ep or 1
  -- coordinates: rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
  local r = world.rank
  local stride = M.strides(size)
  local coord = { tp = r % size.tp, cp = math.floor(r / size.tp) % size.cp,
                  dp = math.floor(r / stride.dp) % size.dp, pp = math.floor(r / stride.pp) }
  local self = setmetatable({ world = world, size = size, coord = coord }, Mesh)
  for _, d in ipairs(M.DIMS) do
    -- the ranks that differ only in d share a color: this rank with its d coordinate zeroed
    -- (the group's size and this rank's place: a fake world needs them, a real one checks them)
    local comm = world:split(r - coord[d] * stride[d], coord[d], { size = size[d], rank = coord[d] })
    self[d] = comm
  end
  -- dp x cp: the ranks sharing this rank's pp and tp coordinates
  self.dp_cp = size.cp == 1 and self.dp
    or world:split(coord.pp * size.tp + coord.tp, r, { size = size.dp * size.cp, rank = coord.dp * size.cp + coord.cp })
  if size.ep > 1 then self.ep, self.ep_replica = require('gptlua.dist.expert_parallel').groups(self.dp, size.ep) end
  return self
end

-- The ranks (world numbering) of dimension d's group this rank is in.
function M.strides(size)
  return { tp = 1, cp = size.tp, dp = size.tp * size.cp, pp = size.tp * size.cp * size.dp }
end

function Mesh:group_ranks(d)
  local stride = M.strides(self.size)[d]
  local base = self.world.rank - self.coord[d] * stride
  local out = {}
  for i = 0, self.size[d] - 1 do out[#out + 1] = base + i * stride end
  return out
end

return M
