-- The KV-cache engine's decode step replayed as a CUDA graph
-- (lua/gptlua/infer_graph.lua): each replayed step's logits equal the same
-- step run op by op, bit for bit (GPT-2's position table, nanochat's
-- rotary tables, a batch of prompts of different lengths), the steps after
-- the warm-up are replays, generating with the graph gives what generating
-- without it does, and a sliding window shorter than the cache is refused
-- (op by op instead).  Runs on a GPU and under the CUDA simulator.
local gl = require 'gptlua'
local infer = require 'gptlua.infer'
local infer_graph = require 'gptlua.infer_graph'
local twin = require 'support.cuda_twin'
local DEV = twin.DEV

local gpu_it = twin.gpu_it(it, pending)

local SIZES = { vocab_size = 40, block_size = 16, n_layer = 2, n_head = 2, n_embd = 32 }
local function build(make, extra, device)
  local c = {}
  for k, v in pairs(SIZES) do c[k] = v end
  for k, v in pairs(extra or {}) do c[k] = v end
  gl.manual_seed(7)
  local m = make(c)
  -- random weights everywhere (nanochat zeroes its output projections at init)
  gl.no_grad(function()
    for _, p in ipairs(m:parameters()) do if p:numel() > 1 then p:copy_(gl.randn(p.shape, { seed = p:numel() }) * 0.3) end end
  end)
  if device then m:to(device) end
  m:eval()
  return m
end
local MODELS = {
  { 'gpt2', function(c) return require('gptlua.models.gpt2').GPT(c) end },
  { 'nanochat v1', function(c) return require('gptlua.models.nanochat').GPT(c) end },
}

-- the logits of `steps` decode steps after prefilling prompts, through
-- infer_graph's step with or without capturing
local function decode_logits(m, prompts, steps, capture)
  local e = infer.Engine.new(m, nil)
  local out, step = {}, nil
  gl.no_grad(function()
    local B = #prompts
    local longest = 0
    for _, p in ipairs(prompts) do longest = math.max(longest, #p) end
    local caches = e:prefill(B == 1 and prompts[1] or prompts, 1, longest + steps + 1)
    step = infer_graph.new(e, caches, B, { capture = capture, required = true })
    for s = 1, steps do
      local ids = {}
      for b = 1, B do ids[b] = (s * 7 + b * 3) % SIZES.vocab_size end
      out[s] = step:step(ids):to('cpu')
    end
  end)
  step:free()
  return out, step
end

describe('the decode step as a CUDA graph #cuda', function()
  gpu_it('replays each step as the same step run op by op computes it, bit for bit', function()
    for _, case in ipairs(MODELS) do
      local m = build(case[2], nil, DEV)
      for _, prompts in ipairs({ { { 3, 1, 4, 1 } }, { { 5, 9, 2 }, { 6 }, { 5, 3, 5, 8, 9 } } }) do
        local eager, s0 = decode_logits(m, prompts, 6, false)
        local replayed, s1 = decode_logits(m, prompts, 6, true)
        assert.are.equal(0, s0.replays)
        -- the first step is the warm-up, the second is captured and replayed, the rest replay
        assert.are.equal(5, s1.replays, case[1])
        assert.is_true(s1.nodes > 0, case[1])
        for s = 1, 6 do
          assert.are.equal(0, replayed[s]:max_abs_diff(eager[s]), ('%s, %d prompts, step %d'):format(case[1], #prompts, s))
        end
        -- each step's logits differ from the last: the replays ran
        assert.is_true(replayed[5]:max_abs_diff(replayed[6]) > 0, case[1])
      end
    end
  end)

  gpu_it('generates with the graph what it generates without, to the rounding of the summation order', function()
    for _, case in ipairs(MODELS) do
      local m, ref = build(case[2], nil, DEV), build(case[2], { }, nil):to('float64')
      local e, e64 = infer.Engine.new(m, nil), infer.Engine.new(ref, nil)
      for _, prompts in ipairs({ { 3, 1, 4, 1 }, { { 5, 9, 2 }, { 6 }, { 5, 3, 5, 8, 9 } } }) do
        local opts = { max_tokens = 8, temperature = 1, seed = 5 }
        opts.cuda_graph = true
        local with = e:generate(prompts, opts)
        assert.are.equal(6, e.decode_graph.replays, case[1])
        opts.cuda_graph = false
        local without = e:generate(prompts, opts)
        assert.is_nil(e.decode_graph)
        for b = 1, #with do
          assert.are.same(without[b].ids, with[b].ids, ('%s row %d'):format(case[1], b))
          -- both are float32 evaluations of one function, each within the logits rule of the float64
          -- one (spec/infer_spec.lua), so they differ by at most the sum of their distances to it
          local prompt = type(prompts[1]) == 'table' and prompts[b] or prompts
          local seq = { unpack(prompt) }
          for _, id in ipairs(with[b].ids) do seq[#seq + 1] = id end
          local exact = e64:logprobs(seq)
          for i, v in ipairs(with[b].logprobs) do
            local j, w = #prompt - 1 + i, without[b].logprobs[i]
            assert.is_true(math.abs(v - w) <= 2 * math.abs(w - exact[j]) + 2 * 2 ^ -23 * math.sqrt(4 * SIZES.n_embd)
              * math.max(1, math.abs(exact[j])), ('%s row %d token %d: %.9g with, %.9g without'):format(case[1], b, i, v, w))
          end
        end
      end
    end
  end)

  gpu_it('decodes a sliding window shorter than the cache op by op, and says why when a graph is asked for', function()
    local m = build(MODELS[2][2], { version = 'v2', n_kv_head = 1, short_window = 8 }, DEV)  -- a window of 9 keys
    local e = infer.Engine.new(m, nil)
    -- (3 + 12 tokens and the graph's slot: 16 slots, more than the short layers' window)
    local rows = e:generate({ 1, 2, 3 }, { max_tokens = 12, temperature = 0 })
    assert.are.equal(12, #rows[1].ids)
    assert.is_nil(e.decode_graph)
    local ok, err = pcall(e.generate, e, { 1, 2, 3 }, { max_tokens = 12, cuda_graph = true })
    assert.is_false(ok)
    assert.matches('generate: cuda_graph: a sliding window of %d+ keys %(shorter than the cache\'s 16 slots%) counts from '
      .. 'the query\'s slot in a graph', err)
    -- a short generation: the window hides nothing there, and the graph runs
    e:generate({ 1, 2, 3 }, { max_tokens = 4, temperature = 0, cuda_graph = true })
    assert.are.equal(2, e.decode_graph.replays)
  end)
end)
