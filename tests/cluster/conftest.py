# Fixtures (cluster, namespace, s3_bucket) live in tests/fixtures/cluster.py, which
# tests/conftest.py registers with `pytest_plugins = ["tests.fixtures.cluster"]`.
