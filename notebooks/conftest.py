"""nbval's configuration for the notebooks (``pytest notebooks/*.ipynb --nbval ...``, see the Makefile).

Here, not at the root: pytest imports every conftest as the module ``conftest``, and the tests share
their helpers through ``tests/oracle.py`` instead. tests/test_nbval_svg.py checks this hook.
"""


def pytest_collectstart(collector):
    # torchviz names graph nodes by id(), so an SVG differs on every run: never compare SVG outputs.
    # (Notebooks show graphs as PNG, which nbval never compares, but a reader may add an SVG cell.)
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("image/svg+xml",)
