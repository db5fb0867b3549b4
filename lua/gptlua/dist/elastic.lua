-- gptlua.dist.elastic — a job that survives a rank's failure:
-- `gptlua -n N --max_restarts=K [--min_ranks=M] script.lua args...`.
--
-- The launcher (gptlua.dist.launch, under mpirun or its own TCP rendezvous)
-- runs the job; when a rank dies or the job aborts, every rank is stopped
-- (mpirun does it, or launch.wait) and the job starts again, up to K times,
-- with --resume: from the run's last published checkpoint (a save that a
-- crash interrupted is only a temporary directory, removed on resume), on
-- any number of ranks, as a cross-world resume already is.  Before each
-- restart the launcher counts the ranks that can start; with fewer than N
-- but at least M the job continues on them with the same global batch
-- (--resume_keep_batch: more accumulation steps per rank), and with fewer
-- than M it gives up.  No restart follows a refusal of the configuration
-- (the same refusal would come again) or a stop the user asked for (Ctrl-C,
-- SIGTERM).
--
-- The restarted trainer (rank 0) records each restart in metrics.jsonl and
-- the journal ({restart, from, lost_steps, ranks}): lost_steps are the steps
-- the failed attempt had taken past the checkpoint (its journal's last step
-- + 1 - the checkpoint's step; without a journal, from metrics.jsonl's last
-- log line, a lower bound), which the launcher sums and reports at the end.
--
-- On several nodes (one TCP launcher a node, NNODES > 1) the launchers
-- meet before each attempt (gptlua.dist.rendezvous): the next world is the
-- nodes that reached node 0's launcher within --rdzv_timeout, and
-- --min_ranks counts the ranks of all of them.
--
-- Test hooks: GPTLUA_TEST_EXIT_AT=R:S makes rank R exit (status 3) before
-- step S in the job's first attempt (R:S:all, in every attempt);
-- GPTLUA_TEST_DEAD_SLOT=R makes the launcher find rank R's slot unable to
-- start from the first restart on (a node that did not come back);
-- GPTLUA_TEST_HOLD_AT=S:path holds every rank before step S of the first
-- attempt until path exists (a spec takes a link down meanwhile).
local ffi = require 'ffi'
local cjson = require 'cjson'
local launch = require 'gptlua.dist.launch'

local M = {}

local function say(...) io.stderr:write('gptlua -n: ', ...); io.stderr:write('\n'); io.stderr:flush() end

-- The ranks that can start for attempt a (0: the first) of a job of n.  On
-- one host every slot can; the test hook takes one away after a failure.
function M.startable(n, attempt)
  local dead = tonumber(os.getenv('GPTLUA_TEST_DEAD_SLOT') or '')
  if attempt > 0 and dead and dead >= 0 and dead < n then return n - 1 end
  return n
end

-- the arguments of a restart: the run resumed from its last checkpoint,
-- keeping its global batch on however many ranks start
function M.restart_args(args)
  local out = {}
  for _, a in ipairs(args or {}) do
    local dropped = a == '--resume' or a:match('^%-%-resume=') or a:match('^%-%-overwrite') or a:match('^%-%-resume_keep_batch')
    if not dropped then
      out[#out + 1] = a
    end
  end
  out[#out + 1] = '--resume'
  out[#out + 1] = '--resume_keep_batch=true'
  return out
end

-- the restarts' reports (one JSON object a line, from the restarted rank 0s)
local function read_reports(path)
  local lost, n = 0, 0
  local f = io.open(path, 'rb')
  if not f then return 0, 0 end
  for line in f:lines() do
    local ok, r = pcall(cjson.decode, line)
    if ok and type(r) == 'table' then n = n + 1; lost = lost + (tonumber(r.lost_steps) or 0) end
  end
  f:close()
  return lost, n
end

-- The launchers' meeting before each attempt of a TCP job on several nodes
-- (NNODES > 1), or nil on one node: round(attempt) -> this node's place
-- ({world, first_rank, port}), or nil and the line to stop with.
local function meeting(n, K, min, timeout)
  local nnodes, node = launch.nodes_of_env()
  if nnodes == 1 then return nil end
  local rdzv = require 'gptlua.dist.rendezvous'
  local o = { nnodes = nnodes, n = n, min_ranks = min, max_restarts = K, timeout = timeout }
  local addr, port = os.getenv('MASTER_ADDR'), tonumber(os.getenv('MASTER_PORT'))
  if node == 0 then
    local host, why = rdzv.host(port, o)
    if not host then return nil, why end
    return { round = function(_, a) return host:round(a, say) end, close = function() host:close() end }
  end
  return { round = function(_, a) return rdzv.join(addr, port, node, n, a, o) end, close = function() end }
end

function M.main(n, script, args, launcher, opts)
  local K, timeout = opts.max_restarts or 0, opts.rdzv_timeout or 60
  if type(K) ~= 'number' or K < 0 or K ~= math.floor(K) then
    say('--max_restarts expected an integer >= 0, got ', tostring(opts.max_restarts)); return 1
  end
  if type(timeout) ~= 'number' or not (timeout > 0) then
    say('--rdzv_timeout expected a number of seconds > 0, got ', tostring(opts.rdzv_timeout)); return 1
  end
  -- on several nodes (one TCP launcher a node) --min_ranks counts the whole job's ranks
  local nnodes, _, why = 1, nil, nil
  if launcher == 'tcp' then
    nnodes, _, why = launch.nodes_of_env()
    if not nnodes then say(why); return 1 end
  end
  local total = nnodes * n
  local min = opts.min_ranks or total
  if type(min) ~= 'number' or min < 1 or min > total or min ~= math.floor(min) then
    say(('--min_ranks expected an integer in 1..%d (the ranks of %s), got %s'):format(total,
      nnodes > 1 and ('NNODES x -n') or '-n', tostring(opts.min_ranks)))
    return 1
  end
  local meet
  if nnodes > 1 then
    local err
    meet, err = meeting(n, K, min, timeout)
    if not meet then say(err); return 1 end
  end
  local report = os.tmpname()
  ffi.C.setenv('GPTLUA_RESTART_REPORT', report, 1)
  local status, ranks = 1, n
  local function finish(rc)
    os.remove(report)
    if meet then meet:close() end
    return rc
  end
  for attempt = 0, K do
    ffi.C.setenv('GPTLUA_RESTART_ATTEMPT', tostring(attempt), 1)
    local place
    if meet then
      local line
      place, line = meet:round(attempt)
      if not place then say(line); return finish(status ~= 0 and status or 1) end
      ranks = place.world
    else
      ranks = M.startable(n, attempt)
      if ranks < min then
        say(('only %d of %d ranks can start, fewer than --min_ranks=%d: giving up after %d restart%s')
          :format(ranks, n, min, attempt - 1, attempt == 2 and '' or 's'))
        return finish(status ~= 0 and status or 1)
      end
    end
    if attempt > 0 then
      say(('restart %d of %d on %d rank%s%s, from the last checkpoint'):format(attempt, K, ranks,
        ranks == 1 and '' or 's', place and (' (node%s %s)'):format(#place.nodes == 1 and '' or 's',
        table.concat(place.nodes, ', ')) or ''))
    end
    local stopped, refused
    status, stopped, refused = launch.run_once(meet and n or ranks, script, attempt == 0 and args or M.restart_args(args),
      launcher, place)
    if status == 0 or stopped or refused then break end
    if attempt == K then
      local lost = read_reports(report)
      say(('the job failed (status %d) and its %d restart%s are used up (--max_restarts=%d); %d steps were lost '
        .. 'to the restarts'):format(status, K, K == 1 and '' or 's', K, lost))
      return finish(status)
    end
    say(('the job failed (status %d); stopping every rank and restarting%s'):format(status,
      meet and ' (the nodes meet at the rendezvous first)' or ''))
  end
  local lost, restarts = read_reports(report)
  if status == 0 and restarts > 0 then
    say(('finished after %d restart%s on %d rank%s; %d steps lost and trained again'):format(restarts,
      restarts == 1 and '' or 's', ranks, ranks == 1 and '' or 's', lost))
  end
  return finish(status)
end

-- --------------------------------------------------------- the trainer side
-- Called by the trainer once the run is open (every rank): the restart's
-- record (rank 0) and the exit hook.
function M.on_start(t, resumed_from, first_step)
  local attempt = tonumber(os.getenv('GPTLUA_RESTART_ATTEMPT') or '') or 0
  local hook = os.getenv('GPTLUA_TEST_EXIT_AT')
  local r, s, every = (hook or ''):match('^(%d+):(%d+)(:?a?l?l?)$')
  if r and tonumber(r) == t.rank and (attempt == 0 or every == ':all') then
    local step = t.train_step
    t.train_step = function(self, ...)
      if self.step == tonumber(s) then
        io.stderr:write(('[rank %d] test hook: exiting before step %d\n'):format(t.rank, self.step))
        io.stderr:flush()
        os.exit(3)
      end
      return step(self, ...)
    end
  end
  -- GPTLUA_TEST_HOLD_AT=S:path: in the first attempt every rank stops before
  -- step S (no collective pending), says so in path.rank<R>, and goes on once
  -- path exists, publishing meanwhile a background save once it is written
  local hs, hpath = (os.getenv('GPTLUA_TEST_HOLD_AT') or ''):match('^(%d+):(.+)$')
  if hs and attempt == 0 then
    local step = t.train_step
    t.train_step = function(self, ...)
      if self.step == tonumber(hs) then
        local f = io.open(hpath .. '.rank' .. t.rank, 'wb')
        if f then f:close() end
        local f = io.open(hpath, 'rb')
        while not f do
          if self.ckpt_writer then self.ckpt_writer:poll() end
          ffi.C.poll(nil, 0, 50)
          f = io.open(hpath, 'rb')
        end
        f:close()
      end
      return step(self, ...)
    end
  end
  if attempt == 0 or t.rank ~= 0 then return end
  -- the failed attempt's last step: from this run's journal (a record a
  -- step), else its metrics (a record a log line: a lower bound)
  local lost, reached
  local ok, j = pcall(require('gptlua.journal').read, t.run_dir .. '/journal.jsonl')
  if ok and j.last >= 0 then reached = j.last + 1
  else
    local f = io.open(t.run_dir .. '/metrics.jsonl', 'rb')
    for line in f and f:lines() or function() end do
      local okr, r = pcall(cjson.decode, line)
      if okr and type(r) == 'table' and type(r.step) == 'number' then reached = math.max(reached or 0, r.step) end
    end
    if f then f:close() end
  end
  if resumed_from and reached then lost = math.max(reached - first_step, 0) end
  local rec = { step = first_step, restart = attempt, from = resumed_from, lost_steps = lost, ranks = t.world }
  t:write_metrics(rec)
  if t.journal then t.journal:write({ restart = attempt, at = first_step, from = resumed_from, lost_steps = lost,
    ranks = t.world }) end
  t:print(('restart %d: %s, %s steps lost'):format(attempt,
    resumed_from and ('resumed from ' .. resumed_from) or 'no checkpoint yet, started over',
    lost and tostring(lost) or 'all previous'))
  local path = os.getenv('GPTLUA_RESTART_REPORT')
  local f = path and path ~= '' and io.open(path, 'ab')
  if f then f:write(cjson.encode({ attempt = attempt, lost_steps = lost or 0 }), '\n'); f:close() end
end

return M
