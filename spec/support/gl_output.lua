-- busted output handler for `make test`: a line per spec file with its
-- counts, the wall seconds its tests took and the CPU seconds they used,
-- this process's and its finished children's (mpirun ranks, subprocesses):
-- wall time swings with the machine's load, CPU time much less, so the CPU
-- column is the one to compare between runs (to keep CI's budget in sight),
-- every failure and error in full, and last the one line CI reads:
--   N passed, N failed, N skipped
-- (errors count as failed).
return function(options)
  local busted = require 'busted'
  local handler = require('busted.outputHandlers.base')()
  local per_file, order = {}, {}
  local failures = {}
  local now = require('gptlua.cli').now
  local started, cpu_started

  -- CPU seconds of this process and its waited-for children (utime, stime,
  -- cutime, cstime of /proc/self/stat, in clock ticks); 0 where there is no /proc
  local ffi = require 'ffi'
  local tick = 100
  pcall(function()
    pcall(ffi.cdef, 'long sysconf(int name);')
    local t = tonumber(ffi.C.sysconf(2))  -- _SC_CLK_TCK
    if t and t > 0 then tick = t end
  end)
  local function cpu_now()
    local f = io.open('/proc/self/stat')
    if not f then return 0 end
    local s = f:read('*a')
    f:close()
    local fields = {}
    for w in s:match('%) (.*)$'):gmatch('%S+') do fields[#fields + 1] = w end
    -- after the command's ')': state is field 3, utime .. cstime are 14 .. 17
    local sum = 0
    for i = 14, 17 do sum = sum + (tonumber(fields[i - 2]) or 0) end
    return sum / tick
  end

  local function file_of(element)
    local t = element.trace
    return t and t.short_src or '?'
  end

  local function note(element, status)
    local f = file_of(element)
    local c = per_file[f]
    if not c then c = { pass = 0, fail = 0, skip = 0, seconds = 0, cpu = 0 }; per_file[f] = c; order[#order + 1] = f end
    if started then c.seconds = c.seconds + (now() - started); started = nil end
    if cpu_started then c.cpu = c.cpu + (cpu_now() - cpu_started); cpu_started = nil end
    if status == 'success' then c.pass = c.pass + 1
    elseif status == 'pending' then c.skip = c.skip + 1
    else c.fail = c.fail + 1 end
  end

  handler.testStart = function()
    started, cpu_started = now(), cpu_now()
    return nil, true
  end

  handler.testEnd = function(element, parent, status)
    note(element, status)
    if status == 'failure' or status == 'error' then
      local list = status == 'failure' and handler.failures or handler.errors
      failures[#failures + 1] = list[#list]
    end
    io.write(status == 'success' and '.' or status == 'pending' and 's' or 'F')
    io.flush()
    return nil, true
  end

  handler.error = function(element, parent, message, trace)
    -- errors outside a test (a file that fails to load, a failing setup)
    if element and element.descriptor ~= 'it' then
      failures[#failures + 1] = { name = handler.getFullName(element), message = message, trace = trace,
                                  element = element }
    end
    return nil, true
  end

  handler.suiteEnd = function()
    io.write('\n')
    for _, f in ipairs(order) do
      local c = per_file[f]
      io.write(string.format('  %-44s %4d passed %3d failed %3d skipped %7.1f s %7.1f cpu-s\n', f, c.pass, c.fail,
        c.skip, c.seconds, c.cpu))
    end
    for i, t in ipairs(failures) do
      local msg = t.message
      if type(msg) ~= 'string' then msg = require('pl.pretty').write(msg) end
      local where = t.element and t.element.trace and (t.element.trace.short_src .. ':' .. t.element.trace.currentline) or ''
      io.write(string.format('\nFAIL %d: %s (%s)\n%s\n', i, t.name or '?', where, tostring(msg)))
      if t.trace and t.trace.traceback and options.verbose then io.write(t.trace.traceback, '\n') end
    end
    local failed = #handler.failures + #handler.errors
    -- errors outside tests are not in handler.errors' test counts
    for _, t in ipairs(failures) do if t.element and t.element.descriptor ~= 'it' then failed = failed + 1 end end
    io.write(string.format('%d passed, %d failed, %d skipped\n', #handler.successes, failed, #handler.pendings))
    io.flush()
    return nil, true
  end

  busted.subscribe({ 'test', 'start' }, handler.testStart, { predicate = handler.cancelOnPending })
  busted.subscribe({ 'test', 'end' }, handler.testEnd, { predicate = handler.cancelOnPending })
  busted.subscribe({ 'suite', 'end' }, handler.suiteEnd)
  busted.subscribe({ 'error' }, handler.error)
  busted.subscribe({ 'failure' }, handler.error)
  return handler
end
