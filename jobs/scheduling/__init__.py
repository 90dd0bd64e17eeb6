"""Scheduled ETL: schedules (cron, input, job template) and their ticks."""
