"""The job domain: spec, status machine, object store, row formats, sharding and manifest.

Nothing here imports the engine, the worker, the API or torch; the API imports this package at
start-up, so modules stay light and import their heavy dependencies (pyarrow, boto3) where used.
"""
