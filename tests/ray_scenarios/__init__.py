"""Ray Train scenarios run as subprocesses by tests/faces/test_ray_train.py (and the facade benchmark)."""
