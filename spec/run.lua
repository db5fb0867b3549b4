-- Runs the busted specs under the gptlua executable, so every spec uses
-- exactly the engine and library users get.  `build/gptlua spec/run.lua`
-- runs all of spec/; extra arguments go to busted (a file, --tags=cuda, ...).
-- Specs tagged #cuda run only with --tags=cuda (make test-cuda).
local root = GPTLUA and GPTLUA.root or '.'
local user = {}
for i = 1, #arg do user[#user + 1] = arg[i] end
local has_tags, has_path = false, false
for _, a in ipairs(user) do
  if a:match('^%-%-tags') or a:match('^%-t') then has_tags = true end
  if not a:match('^%-') then has_path = true end
end
local args = { '--lpath=' .. root .. '/spec/?.lua', '-o', root .. '/spec/support/gl_output.lua',
               '--pattern=_spec', '-v' }
if not has_tags then args[#args + 1] = '--exclude-tags=cuda' end
for _, a in ipairs(user) do args[#args + 1] = a end
if not has_path then args[#args + 1] = root .. '/spec' end
arg = args
arg[0] = 'busted'
-- busted's exit() raises a nil error for a non-zero status under Lua 5.1
local ok = pcall(require('busted.runner'), { standalone = false })
io.stdout:flush()
os.exit(ok and 0 or 1)
