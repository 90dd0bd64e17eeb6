"""The engines of a worker process: one long-lived host per model, and the rows between a job and its
engine."""
