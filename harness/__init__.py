"""Emulator servers on 127.0.0.1 for the tests, the benchmarks and the CI wheel check (not shipped).

``s3`` starts moto, ``gcs`` fake-gcs-server, ``azure`` Azurite; each launcher returns a handle to stop it.
The pytest fixtures built on them live in ``tests/servers/``.
"""
