"""Benchmarks for envfleet (``python bench/throughput.py``); not part of the installed package."""
