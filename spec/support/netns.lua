-- Two "nodes" on one machine: Linux network namespaces joined by a veth
-- pair, each running ranks that rendezvous over TCP as on separate hosts
-- (spec/dist_netns_spec.lua).  Needs root (CAP_NET_ADMIN) and `ip`; the
-- link may be shaped with tc's token bucket (tbf: a rate and a queue), not
-- netem (not in every kernel).
--
--   local NS = require 'support.netns'
--   local ok, why = NS.available()            -- false and the reason where it cannot run
--   NS.with({ rate = '20mbit' }, function(nodes)
--     -- nodes[i] = { name = <namespace>, addr = '10.231.X.i', ifname = <its veth> }
--     local out = NS.run_ranks(nodes, cmd_of_rank)   -- cmd_of_rank(r, node) -> a shell command
--   end)                                     -- the namespaces are removed, whatever fn did
local H = require 'support.mpi'

local M = {}

local function sh(cmd)
  local p = io.popen(cmd .. ' 2>&1; echo "__rc=$?"')
  local out = p:read('*a')
  p:close()
  return (out:gsub('__rc=%d+%s*$', '')), tonumber(out:match('__rc=(%d+)%s*$'))
end

-- a name of this process's own (specs of two suites may run side by side)
local function tag() return ('glt%d'):format(require('gptlua.dist.launch').getpid() % 100000) end

function M.available()
  local name = tag() .. 'p'
  local out, rc = sh('ip netns add ' .. name)
  if rc ~= 0 then return false, 'ip netns add failed: ' .. out:gsub('%s+$', '') end
  sh('ip netns del ' .. name)
  return true
end

-- Sets up two namespaces and a veth between them (10.231.N.1 and .2/24,
-- N from the pid), runs fn(nodes), removes both; returns fn's results.
-- o.rate (e.g. '20mbit'): both ends shaped by tc tbf to that rate.
function M.with(o, fn)
  local t = tag()
  local subnet = 1 + require('gptlua.dist.launch').getpid() % 250
  local nodes = {}
  for i = 1, 2 do
    nodes[i] = { name = ('%s-%d'):format(t, i), ifname = ('%sv%d'):format(t, i), addr = ('10.231.%d.%d'):format(subnet, i) }
  end
  local function down()
    for _, n in ipairs(nodes) do sh('ip netns del ' .. n.name) end
  end
  down()
  local steps = {
    ('ip netns add %s'):format(nodes[1].name), ('ip netns add %s'):format(nodes[2].name),
    ('ip link add %s type veth peer name %s'):format(nodes[1].ifname, nodes[2].ifname),
  }
  for _, n in ipairs(nodes) do
    steps[#steps + 1] = ('ip link set %s netns %s'):format(n.ifname, n.name)
    steps[#steps + 1] = ('ip -n %s addr add %s/24 dev %s'):format(n.name, n.addr, n.ifname)
    steps[#steps + 1] = ('ip -n %s link set %s up'):format(n.name, n.ifname)
    steps[#steps + 1] = ('ip -n %s link set lo up'):format(n.name)
    if o.rate then
      steps[#steps + 1] = ('ip netns exec %s tc qdisc add dev %s root tbf rate %s burst 32kbit latency 400ms')
        :format(n.name, n.ifname, o.rate)
    end
  end
  for _, cmd in ipairs(steps) do
    local out, rc = sh(cmd)
    if rc ~= 0 then down(); error(('netns: %s failed: %s'):format(cmd, out), 2) end
  end
  local res = { pcall(fn, nodes) }
  down()
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- Runs rank r (0-based) of #nodes in nodes[r + 1]'s namespace, all at once,
-- each with the torchrun-style variables (MASTER_ADDR: node 1's address,
-- GLOO_SOCKET_IFNAME: its own veth); cmd_of_rank(r, node) is the command.
-- Returns the ranks' output and their exit statuses (a list), within limit s.
function M.run_ranks(nodes, port, cmd_of_rank, limit)
  local parts = {}
  for r = 0, #nodes - 1 do
    local n = nodes[r + 1]
    parts[#parts + 1] = ('(ip netns exec %s env RANK=%d WORLD_SIZE=%d LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=%s '
      .. 'MASTER_PORT=%d GLOO_SOCKET_IFNAME=%s GPTLUA_SPEC_BACKEND=gloo timeout %d %s > /tmp/%s.log 2>&1; '
      .. 'echo "rank %d status $?" >> /tmp/%s.log) &'):format(n.name, r, #nodes, nodes[1].addr, port, n.ifname,
      limit or 120, cmd_of_rank(r, n), n.name, r, n.name)
  end
  local out = H.sh('bash -c ' .. ("'%s wait'"):format(table.concat(parts, ' '):gsub("'", "'\\''")), (limit or 120) + 10)
  local logs, statuses = {}, {}
  for r = 0, #nodes - 1 do
    local path = ('/tmp/%s.log'):format(nodes[r + 1].name)
    local f = io.open(path, 'rb')
    local s = f and f:read('*a') or ''
    if f then f:close() end
    os.remove(path)
    logs[#logs + 1] = ('--- rank %d (%s) ---\n%s'):format(r, nodes[r + 1].name, s)
    statuses[r + 1] = tonumber(s:match('rank %d+ status (%d+)'))
  end
  return out .. table.concat(logs, '\n'), statuses
end

return M
