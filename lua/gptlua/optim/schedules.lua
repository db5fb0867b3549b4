-- gptlua.optim.schedules — plain functions of the 0-based step returning a
-- multiplier: learning-rate schedules, Muon's momentum warm-up, the decay of
-- Muon's weight decay.
local check = require 'gptlua.check'
local optim = {}

-- --------------------------------------------------------------- schedules
-- plain functions of the step (0-based) returning an lr multiplier
optim.schedules = {}
function optim.schedules.constant() return function() return 1 end end
function optim.schedules.linear_warmup(warmup)
  return function(step) return warmup > 0 and math.min(1, (step + 1) / warmup) or 1 end
end
-- warmup, then cosine from 1 down to min_ratio at total_steps
function optim.schedules.cosine(warmup, total, min_ratio)
  min_ratio = min_ratio or 0.1
  return function(step)
    if step < warmup then return (step + 1) / warmup end
    if step >= total then return min_ratio end
    local p = (step - warmup) / math.max(1, total - warmup)
    return min_ratio + 0.5 * (1 - min_ratio) * (1 + math.cos(math.pi * p))
  end
end
-- warmup-stable-decay: constant, then linear warm-down over the last
-- `cooldown_frac` of training to `final_ratio`
function optim.schedules.wsd(warmup, total, cooldown_frac, final_ratio)
  cooldown_frac, final_ratio = cooldown_frac or 0.2, final_ratio or 0.0
  local cooldown_start = total - math.floor(cooldown_frac * total)
  return function(step)
    if step < warmup then return (step + 1) / warmup end
    if step < cooldown_start then return 1 end
    local p = (step - cooldown_start) / math.max(1, total - cooldown_start)
    return 1 - p * (1 - final_ratio)
  end
end
-- Muon momentum warmup (nanochat): 0.85 -> 0.95 over the first 300 steps
function optim.schedules.muon_momentum(from, to, steps)
  from, to, steps = from or 0.85, to or 0.95, steps or 300
  return function(step) local f = math.min(step / steps, 1); return (1 - f) * from + f * to end
end

-- cosine from 1 at step 0 to 0 at `total` (nanochat's Muon weight decay)
function optim.schedules.cosine_to_zero(total)
  return function(step) return 0.5 * (1 + math.cos(math.pi * math.min(step, total) / total)) end
end

-- schedule constructors: numbers in, a function of the step out
local SCHEDULES = {
  linear_warmup = 'warmup:number', cosine = 'warmup:number, total:number, min_ratio:number?',
  wsd = 'warmup:number, total:number, cooldown_frac:number?, final_ratio:number?',
  muon_momentum = 'from:number?, to:number?, steps:number?',
  cosine_to_zero = 'total:count',
}
check.wrap_table(optim.schedules, SCHEDULES, 'schedules.')

return optim.schedules
