"""The one thing pyproject.toml cannot say without an experimental table: the markers'
optional C accelerator (markers/_speedups.c, _driver.c, _iteration.c, _slots.c).
``optional=True``: without a compiler or the Python headers the build is skipped with a
warning, the install goes on, and markers.phase, markers.driver and markers.iteration use
their pure-Python paths (their ACCELERATED is then False)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "markers._speedups",
            [
                "markers/_speedups.c",
                "markers/_driver.c",
                "markers/_iteration.c",
                "markers/_slots.c",
            ],
            depends=["markers/_speedups.h"],
            optional=True,
        )
    ]
)
