"""Ray Train scenarios run as subprocesses by tests/test_ray_train.py (and the facade benchmark)."""
