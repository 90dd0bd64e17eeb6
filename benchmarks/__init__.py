"""Benchmarks, run as `bulkinfer bench ...`: the only package that may import every other one."""
