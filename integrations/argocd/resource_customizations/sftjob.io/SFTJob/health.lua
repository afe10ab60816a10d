-- Health of a sftjob.io SFTJob (a supervised fine-tuning run), from status.phase.
-- A training job is Progressing until it finishes, like a batch/v1 Job: Healthy once it
-- succeeded, Degraded once it failed, Suspended while spec.suspend holds it.
-- Uses no standard library beyond base, so it also runs from argocd-cm without UseOpenLibs.
local hs = {}

local function ready_reason(status)
  if status.conditions == nil then
    return nil
  end
  for _, condition in ipairs(status.conditions) do
    if condition.type == "Ready" then
      return condition.reason
    end
  end
  return nil
end

local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the SFTJob operator to pick up the job"
  return hs
end

-- A spec the operator has not yet seen says nothing about the job as it now is.
local generation = obj.metadata.generation
if generation ~= nil and status.observedGeneration ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe the spec (generation " .. generation ..
    ", observed " .. status.observedGeneration .. ")"
  return hs
end

local message = status.message or ""
local phase = status.phase
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = message
elseif phase == "Failed" then
  hs.status = "Degraded"
  local reason = ready_reason(status)
  if reason ~= nil then
    hs.message = reason .. ": " .. message
  else
    hs.message = message
  end
elseif phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = message
elseif phase == "Running" then
  hs.status = "Progressing"
  if status.progress ~= nil and status.progress.summary ~= nil then
    hs.message = "Training, step " .. status.progress.summary .. ": " .. message
  else
    hs.message = "Training: " .. message
  end
elseif phase == "Pending" or phase == "Restarting" then
  hs.status = "Progressing"
  hs.message = phase .. ": " .. message
else
  hs.status = "Unknown"
  hs.message = "Unknown SFTJob phase " .. phase .. ": " .. message
end
return hs
