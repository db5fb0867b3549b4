-- gptlua.dist.errors — how a rank speaks and fails: rank 0's prints
-- (dist.print0), the "[rank N] " prefix (dist.prefix), ending every rank
-- (dist.abort), and the top-level error path (dist.on_error) with its hook
-- dist.before_abort.  install(dist) puts them on gptlua.dist's table; the
-- world and the backend library are dist.get_world() and dist.backend_lib().
local M = {}

function M.install(dist)
  -- Prints on rank 0 only (progress lines).
  function dist.print0(...)
    if dist.rank() == 0 then
      print(...)
      io.stdout:flush()   -- under mpirun stdout is a pipe: show progress now
    end
  end

  -- Prints msg prefixed with this rank and ends every rank now.
  function dist.abort(msg, code)
    io.stdout:flush()
    local mpi, world = dist.backend_lib(), dist.get_world()
    if mpi and world and world.c then
      mpi.gl_dist_abort(code or 1, msg and tostring(msg) or nil)
    end
    if msg then io.stderr:write(tostring(msg), '\n') end
    os.exit(code or 1)
  end

  -- Rank prefix for every line of msg: "[rank 1] ...".
  function dist.prefix(msg)
    local world = dist.get_world()
    if not (world and world.size > 1) then return msg end
    local p = ('[rank %d] '):format(world.rank)
    return p .. tostring(msg):gsub('\n', '\n' .. p)
  end

  -- For the top-level error path (gptlua.cli): prints the error with its rank
  -- and, in a world of several ranks, brings the others down at once.
  -- dist.before_abort: a function the failing rank calls before the abort
  -- (the trainer's: publish a checkpoint its writer has finished); it must
  -- not communicate
  function dist.on_error(msg)
    io.stdout:flush()
    io.stderr:write(dist.prefix(msg), '\n')
    io.stderr:flush()
    if dist.before_abort then pcall(dist.before_abort) end
    local mpi, world = dist.backend_lib(), dist.get_world()
    if mpi and world and world.c then mpi.gl_dist_abort(1, nil) end
  end
end

return M
