"""Running a job's steps: shards (leases, copies, crashes, schema limits), plan and finalize, and the
reaper that re-sends the steps of dead workers."""
