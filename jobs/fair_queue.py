"""Which shard a free worker runs next: higher priority first, then fair shares between tenants, then
between one tenant's jobs. Without it a model's Celery queue is first-in first-out, and a 100-row job
submitted after a 1M-row job waits for every shard of the big one.

The planner *offers* each shard here and sends one interchangeable ticket per shard to the model's
queue (worker/process/tasks.py); a worker that takes a ticket *takes* the next shard from here, so the order
is decided when a worker is free, not when the job was submitted.

Per model, in Redis (one hash slot, so the scripts are atomic):
- `prios`: the priorities (0-9) that have shards waiting, highest first;
- `tenants:<p>`: the tenants with shards waiting at priority p, scored by the cost of the shards they
  have been given (their virtual time); `jobs:<p>:<tenant>`: that tenant's jobs, scored the same way;
- `pending:<job>`: the job's shards waiting (`index:cost`), in input order; `offered:<job>`: the
  shards ever offered, so a planner that runs twice offers nothing twice.

A shard's cost is its estimated tokens (prompt + max_tokens x n per row: jobs/planning/shard_cost.py), not its
rows, so a tenant whose rows ask 16 long samples each is charged for them. The least-served tenant
gets the next shard, then its least-served job; each take adds the shard's cost to both scores.
A tenant or job that arrives (or comes back) starts just below the lowest score
of those already waiting (it goes next, ties broken its way), so it neither waits behind the others'
history nor banks credit while idle (start-time fair queueing).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from bulkinfer.jobs.names import NO_TENANT, shards_started_key

JOB_PLACEHOLDER = "\x00job\x00"

# KEYS: prios, tenants:<p>, jobs:<p>:<tenant>, pending:<job>, offered:<job>
# ARGV: job, shard index, cost, priority, tenant
OFFER_SCRIPT = """
if redis.call('SADD', KEYS[5], ARGV[2]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[5], 604800)
redis.call('RPUSH', KEYS[4], ARGV[2] .. ':' .. ARGV[3])
local function join(key, member)
  if redis.call('ZSCORE', key, member) then return end
  local lowest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  redis.call('ZADD', key, lowest[2] and (tonumber(lowest[2]) - 0.5) or 0, member)
end
join(KEYS[3], ARGV[1])
join(KEYS[2], ARGV[5])
redis.call('ZADD', KEYS[1], -tonumber(ARGV[4]), ARGV[4])
return 1
"""

# KEYS: prios; ARGV: the key prefix of the model's scheduler keys, then the job's started-shards set
# key around the job id (prefix, suffix). Returns {job, shard index, cost} or nil. The shard taken
# is marked started in the same step, so a worker that dies before it takes the shard's lease leaves
# a started shard with no lease, which the reaper re-sends: no shard is lost between take and run.
TAKE_SCRIPT = """
local prefix = ARGV[1]
while true do
  local top = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not top then return nil end
  local tenants = prefix .. 'tenants:' .. top
  local tenant = redis.call('ZRANGE', tenants, 0, 0)[1]
  if not tenant then
    redis.call('ZREM', KEYS[1], top)
  else
    local jobs = prefix .. 'jobs:' .. top .. ':' .. tenant
    local job = redis.call('ZRANGE', jobs, 0, 0)[1]
    if not job then
      redis.call('ZREM', tenants, tenant)
    else
      local entry = redis.call('LPOP', prefix .. 'pending:' .. job)
      if not entry then
        redis.call('ZREM', jobs, job)
      else
        local sep = string.find(entry, ':', 1, true)
        local cost = tonumber(string.sub(entry, sep + 1))
        if redis.call('LLEN', prefix .. 'pending:' .. job) == 0 then
          redis.call('ZREM', jobs, job)
        else
          redis.call('ZINCRBY', jobs, cost, job)
        end
        if redis.call('ZCARD', jobs) == 0 then
          redis.call('ZREM', tenants, tenant)
        else
          redis.call('ZINCRBY', tenants, cost, tenant)
        end
        if redis.call('ZCARD', tenants) == 0 then redis.call('ZREM', KEYS[1], top) end
        local started = ARGV[2] .. job .. ARGV[3]
        redis.call('SADD', started, string.sub(entry, 1, sep - 1))
        redis.call('EXPIRE', started, 604800)
        return {job, string.sub(entry, 1, sep - 1), tostring(cost)}
      end
    end
  end
end
"""


@dataclass(frozen=True)
class TakenShard:
    job_id: str
    shard_index: int
    cost: int  # what its tenant and job were charged (estimated tokens)


class FairQueue:
    """The scheduler of one deployment (all models); see the module docstring."""

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self.client = client
        self.namespace = namespace
        self._offer = client.register_script(OFFER_SCRIPT)
        self._take = client.register_script(TAKE_SCRIPT)

    def _prefix(self, model: str) -> str:
        return f"{self.namespace}:{{sched:{model}}}:"

    def offer(self, model: str, job_id: str, shard_index: int, cost: int, priority: int,
              tenant: str | None) -> bool:
        """Make the shard takeable, charging `cost` (its estimated tokens: jobs/planning/shard_cost.py) to
        its tenant and job when taken; False if it was offered before (nothing changes)."""
        prefix, who = self._prefix(model), tenant or NO_TENANT
        keys = [f"{prefix}prios", f"{prefix}tenants:{priority}", f"{prefix}jobs:{priority}:{who}",
                f"{prefix}pending:{job_id}", f"{prefix}offered:{job_id}"]
        return bool(self._offer(keys=keys, args=[job_id, shard_index, max(1, cost), priority, who]))

    def take(self, model: str) -> TakenShard | None:
        """The next shard to run for `model`, or None when none is waiting."""
        prefix = self._prefix(model)
        around = shards_started_key(self.namespace, JOB_PLACEHOLDER).split(JOB_PLACEHOLDER)
        taken = self._take(keys=[f"{prefix}prios"], args=[prefix, *around])
        if not taken:
            return None
        job, index, cost = (item.decode() if isinstance(item, bytes) else item for item in taken)
        return TakenShard(job, int(index), int(cost))

    def drop(self, model: str, job_id: str) -> None:
        """Forget a job's waiting shards (it was cancelled or has ended); the emptied job leaves the
        scores on the next take that reaches it."""
        self.client.delete(f"{self._prefix(model)}pending:{job_id}")

    def waiting(self, model: str, job_id: str) -> int:
        return int(self.client.llen(f"{self._prefix(model)}pending:{job_id}"))

    def waiting_total(self, model: str, job_ids: list[str]) -> int:
        """The shards of these jobs waiting for `model`, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.llen(f"{self._prefix(model)}pending:{job_id}")
        return sum(int(n) for n in pipe.execute())
