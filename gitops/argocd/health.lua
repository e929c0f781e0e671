-- Argo CD health of a rebound.dev RetryPolicy, read from the conditions rebound-operator
-- writes (kstatus conventions: Ready, plus Reconciling and Stalled as abnormal-true) and,
-- for a policy with spec.rollout, from status.rollout.phase (Argo Rollouts' phases).
-- Runs in Argo CD's restricted Lua (no string library): plain concatenation only.
local hs = {status = "Progressing", message = "Waiting for rebound-operator to compile this policy"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local generation = obj.metadata.generation
local function current(observed)
  return generation == nil or observed == nil or observed == generation
end
if not current(obj.status.observedGeneration) then
  hs.message = "Waiting for rebound-operator to compile generation " .. generation
  return hs
end
local ready, reconciling, stalled, degraded
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Ready" then
    ready = c
  elseif c.type == "Reconciling" then
    reconciling = c
  elseif c.type == "Stalled" then
    stalled = c
  elseif c.type == "Degraded" then
    degraded = c
  end
end
local function says(c)
  return (c.reason or "") .. ": " .. (c.message or "")
end
if ready ~= nil and not current(ready.observedGeneration) then
  hs.message = "Waiting for rebound-operator to compile generation " .. generation
  return hs
end
-- A rollout: rolled back is Degraded with the evidence, a step waiting for a person is
-- Suspended (Argo Rollouts' Paused), a running step Progressing; Healthy reads as below.
local rollout = obj.status.rollout
if rollout ~= nil then
  if degraded ~= nil and degraded.status == "True" and current(degraded.observedGeneration) then
    return {status = "Degraded", message = says(degraded)}
  end
  if rollout.phase == "Degraded" then
    return {status = "Degraded", message = "RolledBack: " .. (rollout.message or "")}
  end
  if stalled ~= nil and stalled.status == "True" then
    return {status = "Degraded", message = says(stalled)}
  end
  local message = rollout.message
  if message == nil or message == "" then
    message = "Rollout step " .. ((rollout.step or 0) + 1)
  end
  if rollout.phase == "Paused" then
    return {status = "Suspended", message = message}
  end
  if rollout.phase == "Progressing" then
    return {status = "Progressing", message = message}
  end
end
-- Stalled: the operator cannot serve this policy as written (InvalidSpec, Conflict,
-- ConfigMapNotOwned, DocumentTooLarge) until someone changes something.
if stalled ~= nil and stalled.status == "True" then
  return {status = "Degraded", message = says(stalled)}
end
if ready ~= nil and ready.status == "True" then
  return {status = "Healthy", message = ready.message or ""}
end
-- Reconciling: a transient failure (ApplyFailed) the operator retries with backoff.
if reconciling ~= nil and reconciling.status == "True" then
  return {status = "Progressing", message = says(reconciling)}
end
if ready ~= nil and ready.status == "False" then
  return {status = "Degraded", message = says(ready)}
end
return hs
