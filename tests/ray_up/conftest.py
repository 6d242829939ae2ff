import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/ray_up/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
