"""The HTTP routes: jobs, schedules, and the service's own (health, models)."""
