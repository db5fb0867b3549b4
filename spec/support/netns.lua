-- Two "nodes" on one machine: Linux network namespaces joined by a veth
-- pair, each running ranks that rendezvous over TCP as on separate hosts
-- (spec/dist_netns_spec.lua).  Needs root (CAP_NET_ADMIN) and `ip`; the
-- link may be shaped with tc's token bucket (tbf: a rate and a queue), not
-- netem (not in every kernel).  Latency comes from a TCP relay instead
-- (netns_relay.c, one in each namespace, on loopback): with o.delay_ms the
-- ranks run with netns_connect_shim.so preloaded, so their connections to
-- the other node pass their own node's relay, which holds each direction's
-- bytes delay_ms (a round trip: twice that, plus the link's own).
--
--   local NS = require 'support.netns'
--   local ok, why = NS.available()            -- false and the reason where it cannot run
--   NS.with({ rate = '20mbit', delay_ms = 20 }, function(nodes)
--     -- nodes[i] = { name = <namespace>, addr = '10.231.X.i', ifname = <its veth>,
--     --              env = <variables that route its connections through its relay> }
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

-- the relay and the connect shim, compiled into a directory of their own
-- (kept until M.with ends): their paths, or an error naming the compiler's complaint
local built
function M.relay_build()
  if built then return built.relay, built.shim end
  local dir = os.tmpname()
  os.remove(dir)
  os.execute('mkdir -p ' .. dir)
  local src = GPTLUA.root .. '/spec/support/'
  local relay, shim = dir .. '/netns_relay', dir .. '/netns_connect_shim.so'
  for _, cmd in ipairs({ ('cc -O2 -o %s %snetns_relay.c'):format(relay, src),
    ('cc -O2 -shared -fPIC -o %s %snetns_connect_shim.c -ldl'):format(shim, src) }) do
    local out, rc = sh(cmd)
    if rc ~= 0 then error(('netns: %s failed: %s'):format(cmd, out), 2) end
  end
  built = { relay = relay, shim = shim, dir = dir }
  return relay, shim
end

-- starts a relay in node n's namespace holding bytes delay_ms each way on
-- 127.0.0.1:port; sets n.env and n.relay_pid (its own process group)
local function start_relay(n, other, port, delay_ms)
  local relay, shim = M.relay_build()
  local log = ('/tmp/%s.relay'):format(n.name)
  local out = sh(('setsid ip netns exec %s %s %d %g > %s 2>&1 & echo "pid=$!"'):format(n.name, relay, port, delay_ms, log))
  n.relay_pid = tonumber(out:match('pid=(%d+)'))
  local now = require('gptlua.cli').now
  local t0 = now()
  repeat   -- until it listens (or says why it cannot)
    local f = io.open(log, 'rb')
    local s = f and f:read('*a') or ''
    if f then f:close() end
    if s:find('listening', 1, true) then break end
    if s:find('netns_relay:', 1, true) or now() - t0 > 10 then error('netns: the relay did not start: ' .. s, 0) end
    sh('sleep 0.05')
  until false
  os.remove(log)
  n.env = ('LD_PRELOAD=%s GPTLUA_RELAY_TO=%s GPTLUA_RELAY_PORT=%d'):format(shim, other.addr, port)
end

-- Sets up two namespaces and a veth between them (10.231.N.1 and .2/24,
-- N from the pid), runs fn(nodes), removes both; returns fn's results.
-- o.rate (e.g. '20mbit'): both ends shaped by tc tbf to that rate;
-- o.delay_ms: a relay in each namespace delays every byte that many ms
-- each way (M.run_ranks routes the ranks through it).
function M.with(o, fn)
  local t = tag()
  local subnet = 1 + require('gptlua.dist.launch').getpid() % 250
  local nodes = {}
  for i = 1, 2 do
    nodes[i] = { name = ('%s-%d'):format(t, i), ifname = ('%sv%d'):format(t, i), addr = ('10.231.%d.%d'):format(subnet, i) }
  end
  local function down()
    for _, n in ipairs(nodes) do
      if n.relay_pid then sh(('kill -- -%d'):format(n.relay_pid)); n.relay_pid = nil end
      sh('ip netns del ' .. n.name)
    end
    if built then sh('rm -rf ' .. built.dir); built = nil end
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
  if o.delay_ms then
    local ok, err = pcall(function()
      local port = require('gptlua.dist.launch').free_port()
      for i, n in ipairs(nodes) do start_relay(n, nodes[3 - i], port, o.delay_ms) end
    end)
    if not ok then down(); error(err, 2) end
  end
  local res = { pcall(fn, nodes) }
  down()
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- Starts rank r (0-based) of #nodes in nodes[r + 1]'s namespace, all at once
-- and in the background, each with the torchrun-style variables (MASTER_ADDR:
-- node 1's address, GLOO_SOCKET_IFNAME: its own veth, and node.env: its
-- relay's, if any); cmd_of_rank(r, node) is the command, ended by `timeout`
-- after limit s.  Returns a job for M.finish (each rank's log ends with its
-- status and the wall time it ended).
function M.start_ranks(nodes, port, cmd_of_rank, limit)
  local parts = {}
  for r = 0, #nodes - 1 do
    local n = nodes[r + 1]
    parts[#parts + 1] = ('(ip netns exec %s env RANK=%d WORLD_SIZE=%d LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=%s '
      .. 'MASTER_PORT=%d GLOO_SOCKET_IFNAME=%s GPTLUA_SPEC_BACKEND=gloo %s timeout %d %s > /tmp/%s.log 2>&1; '
      .. 'echo "rank %d status $? ended at $(date +%%s.%%N)" >> /tmp/%s.log) &'):format(n.name, r, #nodes, nodes[1].addr,
      port, n.ifname, n.env or '', limit or 120, cmd_of_rank(r, n), n.name, r, n.name)
  end
  local done = ('/tmp/%s.done'):format(nodes[1].name)
  os.remove(done)
  local script = ('/tmp/%s.sh'):format(nodes[1].name)
  local f = assert(io.open(script, 'wb'))
  f:write(table.concat(parts, '\n'), '\nwait\ntouch ', done, '\n')
  f:close()
  os.execute(('bash %s > /dev/null 2>&1 &'):format(script))
  return { nodes = nodes, done = done, limit = limit or 120 }
end

local function exists(p) local f = io.open(p, 'rb'); if f then f:close() end return f ~= nil end

-- Polls every 0.1 s until pred() is true or limit s have passed; returns whether it became true.
function M.wait_for(pred, limit)
  local t0 = os.time()
  while not pred() do
    if os.time() - t0 > limit then return false end
    os.execute('sleep 0.1')
  end
  return true
end

-- Waits for a job of M.start_ranks to end; returns the ranks' output, their
-- exit statuses and the wall times they ended at (lists, by rank + 1).
function M.finish(job)
  M.wait_for(function() return exists(job.done) end, job.limit + 10)
  os.remove(job.done)
  os.remove(('/tmp/%s.sh'):format(job.nodes[1].name))
  local logs, statuses, ended = {}, {}, {}
  for r = 0, #job.nodes - 1 do
    local path = ('/tmp/%s.log'):format(job.nodes[r + 1].name)
    local f = io.open(path, 'rb')
    local s = f and f:read('*a') or ''
    if f then f:close() end
    os.remove(path)
    logs[#logs + 1] = ('--- rank %d (%s) ---\n%s'):format(r, job.nodes[r + 1].name, s)
    local st, at = s:match('rank %d+ status (%d+) ended at ([%d.]+)')
    statuses[r + 1], ended[r + 1] = tonumber(st), tonumber(at)
  end
  return table.concat(logs, '\n'), statuses, ended
end

-- Runs the ranks as M.start_ranks does and waits for them (M.finish): their
-- output and exit statuses.
function M.run_ranks(nodes, port, cmd_of_rank, limit)
  local out, statuses = M.finish(M.start_ranks(nodes, port, cmd_of_rank, limit))
  return out, statuses
end

-- Takes node's link down (its end of the veth): the node drops off the network.
function M.link_down(node)
  local out, rc = sh(('ip -n %s link set %s down'):format(node.name, node.ifname))
  if rc ~= 0 then error(('netns: link down on %s failed: %s'):format(node.name, out), 2) end
end

-- The wall clock (s, sub-second), as the ranks' logs give their end.
function M.now()
  local p = io.popen('date +%s.%N')
  local t = tonumber(p:read('*a'))
  p:close()
  return t
end

return M
