"""pytest configuration shared by the unit tests and nbval."""


def pytest_collectstart(collector):
    # torchviz names graph nodes by id(), so an SVG differs on every run: never compare SVG outputs.
    # (Notebooks show graphs as PNG, which nbval never compares, but a reader may add an SVG cell.)
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("image/svg+xml",)
