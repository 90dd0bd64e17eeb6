"""Planning a job before it runs: shards, their cost, duplicate rows, retry plans and dry-run estimates."""
