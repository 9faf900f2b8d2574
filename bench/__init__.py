"""Benchmarks of fastckpt against the tools users pick (pyarrow, s3fs, boto3, s5cmd, obstore, cp, torch.save).

Entry point: ``python -m bench.run`` (also ``python bench/run.py``); see ``bench/run.py``.
"""
