-- Times trainers' steps in interleaved rounds, so that a loaded machine
-- slows them all alike (the step benchmarks: nanochat_step.lua,
-- moe_step.lua): each round runs iters training steps of every trainer in
-- turn; returns each trainer's median ms/step over the rounds.
--   local medians = dofile(gl.root .. '/recipes/tools/step_rounds.lua')(trainers, iters, rounds)
local now = require('gptlua.cli').now

return function(trainers, iters, rounds)
  local times = {}
  for i = 1, #trainers do times[i] = {} end
  for _ = 1, rounds do
    for i, t in ipairs(trainers) do
      local t0 = now()
      for _ = 1, iters do t:train_step() end
      times[i][#times[i] + 1] = (now() - t0) / iters * 1000
    end
  end
  local medians = {}
  for i, l in ipairs(times) do
    table.sort(l)
    medians[i] = l[math.ceil(#l / 2)]
  end
  return medians
end
