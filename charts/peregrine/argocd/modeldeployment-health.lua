-- Argo CD health of a serving.peregrine.dev ModelDeployment, from the conditions the operator writes.
-- Install: docs/operations.md ("Argo CD"). Tested by operator/tests/argocd_health.rs.
-- Written for Argo CD's Lua 5.1 (gopher-lua): no goto, no integer division.
local hs = { status = "Progressing", message = "waiting for the operator" }

local function condition(conditions, type_)
  if conditions == nil then return nil end
  for _, c in ipairs(conditions) do
    if c.type == type_ then return c end
  end
  return nil
end

local function is_true(c) return c ~= nil and c.status == "True" end

if obj.status == nil then return hs end
local status = obj.status
-- A status written for an older spec says nothing about this one.
if obj.metadata.generation ~= nil and status.observedGeneration ~= obj.metadata.generation then
  hs.message = "the operator has not acted on generation " .. tostring(obj.metadata.generation) .. " yet"
  return hs
end
local conditions = status.conditions

local degraded = condition(conditions, "Degraded")
if is_true(degraded) then
  hs.status = "Degraded"
  hs.message = degraded.reason .. ": " .. (degraded.message or "")
  return hs
end
local failed = condition(conditions, "RolloutFailed")
if is_true(failed) then
  hs.status = "Degraded"
  hs.message = "rollout failed: " .. (failed.message or failed.reason)
  return hs
end

-- A staged rollout under way: Ready stays True while the stable pods serve, but the change is not out.
local paused = condition(conditions, "RolloutPaused")
if is_true(paused) and paused.reason == "PausedByAnnotation" then
  hs.status = "Suspended"
  hs.message = paused.message or "rollout paused"
  return hs
end
local rolling = condition(conditions, "RolloutProgressing")
if is_true(rolling) then
  if rolling.reason == "AwaitingPromotion" then
    hs.status = "Suspended"
  end
  hs.message = "rollout: " .. (rolling.message or rolling.reason)
  return hs
end

local ready = condition(conditions, "Ready")
local progressing = condition(conditions, "Progressing")
if is_true(progressing) then
  hs.message = progressing.message or progressing.reason
  return hs
end
if is_true(ready) then
  hs.status = "Healthy"
  hs.message = ready.message or ready.reason
  return hs
end
if ready ~= nil then
  hs.message = ready.reason .. ": " .. (ready.message or "")
end
return hs
