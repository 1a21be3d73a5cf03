-- Argo CD health of a serving.peregrine.dev LoraAdapter, from the conditions the operator writes.
-- Install: docs/operations.md ("Argo CD"). Tested by operator/tests/argocd_health.rs.
-- Written for Argo CD's Lua 5.1 (gopher-lua).
local hs = { status = "Progressing", message = "waiting for the operator" }

local function condition(conditions, type_)
  if conditions == nil then return nil end
  for _, c in ipairs(conditions) do
    if c.type == type_ then return c end
  end
  return nil
end

if obj.status == nil then return hs end
local status = obj.status
if obj.metadata.generation ~= nil and status.observedGeneration ~= obj.metadata.generation then
  hs.message = "the operator has not acted on generation " .. tostring(obj.metadata.generation) .. " yet"
  return hs
end

-- Another adapter (or the base model) already serves this name: requests would reach the wrong weights.
local conflict = condition(status.conditions, "Conflict")
if conflict ~= nil and conflict.status == "True" then
  hs.status = "Degraded"
  hs.message = conflict.message or conflict.reason
  return hs
end

local ready = condition(status.conditions, "Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or ready.reason
  return hs
end
-- Failed everywhere (retried with backoff) or a spec the operator cannot act on.
if status.phase == "Failed" then
  hs.status = "Degraded"
  local loaded = condition(status.conditions, "Loaded")
  hs.message = loaded ~= nil and (loaded.reason .. ": " .. (loaded.message or "")) or "loading failed"
  return hs
end
local loaded = condition(status.conditions, "Loaded")
if loaded ~= nil then
  hs.message = loaded.reason .. ": " .. (loaded.message or "")
end
return hs
